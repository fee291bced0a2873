"""The measured guard (issue 20 item 4): a trial of each model-chosen flush against native's calls, decided by the
slowest rank's medians, the same winner on every rank.

Ranks here are in-process ``ExchangeWorld`` ranks whose collectives really exchange data, so a rank that kept a
different winner would issue different calls (a mismatch) or sum the wrong elements (wrong gradients).
"""

from __future__ import annotations

import time

import pytest
import torch
from fakes import ExchangeComm, ExchangeWorld, exchange_backward, flat_map, mirror_runtime

from owner_reduce.planning.measured import (
    TRIAL_ROUNDS,
    TrialFlush,
    Verdict,
    format_measured_line,
    median,
    pack_samples,
    verdicts,
)
from owner_reduce.runtime.handle import OwnerReduceMismatchError

NUMELS = [3 + (7 * i) % 11 for i in range(24)]  # ws 2: one flush, the model's choice a ReduceScatter
WS = 2
GRAPH = 11
SLOW_S = 0.03


# ---- the arithmetic (pure) ----------------------------------------------------------------------------------


def test_the_verdict_times_each_step_by_its_slowest_rank_and_overrules_only_beyond_the_noise():
    """Per trial flush and step, the slowest rank's sample; native's calls win only where every native step was
    faster than every model step (Note (beyond the noise)); a lower median alone keeps the model's choice."""
    rows = [pack_samples([([1.0, 1.1, 0.9], [2.0, 2.1, 2.2]),  # flush 1: the model clearly faster
                          ([5.0, 5.5, 6.0], [1.0, 1.2, 1.1]),  # flush 2: native clearly faster (on rank 0 only)
                          ([3.0, 1.0, 3.2], [2.0, 2.1, 2.2])]),  # flush 3: native's median lower, within the noise
            pack_samples([([1.2, 1.0, 1.0], [1.9, 2.5, 2.0]),
                          ([1.0, 1.0, 1.0], [1.1, 1.3, 1.0]),
                          ([2.9, 1.1, 3.1], [2.4, 2.0, 2.0])])]
    got = verdicts(rows)
    assert got == (Verdict(1.1, 2.2, False), Verdict(5.5, 1.1, True), Verdict(3.0, 2.2, False))
    assert [v.native_wins for v in got] == [False, True, False]
    assert [v.within_noise for v in got] == [False, False, True]
    assert verdicts([pack_samples([([3.0] * 3, [3.0] * 3)])]) == (Verdict(3.0, 3.0, False),)  # a tie keeps the model
    with pytest.raises(RuntimeError, match="ranks measured different flushes"):
        verdicts([pack_samples([([1.0] * 3, [2.0] * 3)]), pack_samples([([1.0] * 3, [2.0] * 3)] * 2)])
    with pytest.raises(ValueError, match="needs 3"):
        pack_samples([([1.0, 2.0], [1.0, 2.0, 3.0])])
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5


def test_the_measured_line_names_kinds_times_and_what_was_overruled():
    flushes = [TrialFlush(1, "reduce_scatter", 100.0, 200.0, Verdict(1500.0, 1000.0, True)),
               TrialFlush(3, "reduce_scatter+handoff", 300.0, 500.0, Verdict(400.0, 900.0)),
               TrialFlush(4, "reduce", 50.0, 90.0, Verdict(700.0, 600.0))]
    line = format_measured_line("[dc-schedule][r0]", "#1", flushes)
    assert line == ("[dc-schedule][r0] graph #1: measured 3 flushes over 3 steps each way, slowest rank: "
                    "reduce_scatter x1 measured 1.500 ms vs native 1.000 ms (modelled 0.100 vs 0.200); "
                    "reduce_scatter+handoff x1 measured 0.400 ms vs native 0.900 ms (modelled 0.300 vs 0.500); "
                    "reduce x1 measured 0.700 ms vs native 0.600 ms (modelled 0.050 vs 0.090); "
                    "overruled by measurement, native from now on: flush 1 (reduce_scatter); "
                    "native faster within the noise, the model's choice kept: flush 4 (reduce)")
    kept = format_measured_line("[dc-schedule][r0]", "#2", flushes[1:2])
    assert kept.endswith("the model's choice kept for every flush")
    replayed = format_measured_line("[dc-schedule][r0]", "#2", flushes[1:2], source="the checkpoint ckpt/x")
    assert replayed.startswith("[dc-schedule][r0] graph #2: verdicts replayed from the checkpoint ckpt/x, as "
                               "measured 1 flush over 3 steps each way")


# ---- in-process ranks -----------------------------------------------------------------------------------------


class _SlowReduceScatter(ExchangeComm):
    """Rank ``rank``'s ReduceScatter takes ``SLOW_S`` longer on this rank only, after the exchange (the peer does not
    wait for it): only the maximum over ranks can see it."""

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        super().reduce_scatter(buf, per_rank)
        time.sleep(SLOW_S)


class _SlowAllReduce(ExchangeComm):
    def all_reduce(self, buf: torch.Tensor) -> None:
        super().all_reduce(buf)
        time.sleep(SLOW_S / 4)


def _grads(rank: int, step: int) -> dict[int, torch.Tensor]:
    """Integer-valued, different per rank and step: a sum over the wrong elements cannot come out right."""
    return {pid: torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1) + 100 * step + 10 * pid
            for pid, n in enumerate(NUMELS)}


def _world(slow: dict[int, type] | None = None, measure=(True, True), algo="auto", **settings):
    world = ExchangeWorld(WS, timeout_s=20)
    for rank, cls in (slow or {}).items():
        world._comms[rank] = cls(world, rank)
    m = flat_map(NUMELS, WS)
    runtimes = world.run(lambda rank: mirror_runtime(
        m, rank=rank, graph_id=GRAPH, comm=world.comm(rank), algo=algo, measure=measure[rank], **settings)[0])
    for rt in runtimes:
        rt.record_collectives = True
    return world, runtimes


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=what)


def _steps(world, runtimes, steps, order=None, first=0):
    """``steps`` backwards on every rank, each rank's grad buffers checked against the true reduced gradient; the
    calls of each step per rank."""
    per_step = []
    for step in range(first, first + steps):
        before = [len(c.calls) for c in world.comms]

        exchange_backward(world, runtimes, lambda rank, step=step: _grads(rank, step), GRAPH,
                          list(order if order is not None else reversed(range(len(NUMELS)))), _close)
        per_step.append([c.calls[n:] for c, n in zip(world.comms, before, strict=True)])
    return per_step


def _kinds(calls):
    return sorted({kind for kind, _, _ in calls})


@pytest.mark.timeout(60)
def test_a_reduce_scatter_slow_on_one_rank_makes_every_rank_keep_native_for_that_flush():
    world, runtimes = _world({1: _SlowReduceScatter})
    per_step = _steps(world, runtimes, 1 + 2 * TRIAL_ROUNDS + 2)
    assert _kinds(per_step[1][0]) == ["reduce_scatter"]  # the model's choice, first of the trial
    assert _kinds(per_step[2][0]) == ["all_reduce"] and len(per_step[2][0]) == len(NUMELS)  # native's calls
    for calls in per_step[-2:]:  # after the verdict: native's calls on both ranks (ExchangeWorld matched them)
        assert calls[0] == calls[1] and _kinds(calls[0]) == ["all_reduce"] and len(calls[0]) == len(NUMELS)
    for rt in runtimes:
        s = rt.stats
        assert (s.trial_steps, s.trials_decided, s.measured_overruled) == (6, 1, 1), s
        assert s.trial_native_flushes == TRIAL_ROUNDS  # the trial's extra work, counted
    (line,) = runtimes[0].stats.measured_lines
    assert "overruled by measurement, native from now on: flush 1 (reduce_scatter)" in line, line
    assert runtimes[1].stats.measured_lines == []  # rank 0 prints
    assert "measuring 1 flush against native's calls over the next 6 steps" in runtimes[0].stats.schedule_lines[0]


@pytest.mark.timeout(60)
def test_a_fast_choice_is_kept_and_the_trial_ends():
    """Native's AllReduces slow (on one rank): the model's ReduceScatter stays, and from the verdict on nothing is
    timed any more."""
    world, runtimes = _world({0: _SlowAllReduce})
    per_step = _steps(world, runtimes, 1 + 2 * TRIAL_ROUNDS + 2)
    for calls in per_step[-2:]:
        assert calls[0] == calls[1] and _kinds(calls[0]) == ["reduce_scatter"]
    for rt in runtimes:
        s = rt.stats
        assert (s.trial_steps, s.trials_decided, s.measured_overruled) == (6, 1, 0), s
        assert rt.flusher.timed is None and rt.flusher.marks == []
    assert runtimes[0].stats.measured_lines[0].endswith("the model's choice kept for every flush")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["off", "forced"])
def test_no_trial_when_turned_off_or_under_a_forced_algorithm(setting):
    world, runtimes = _world({1: _SlowReduceScatter}, measure=(False, False) if setting == "off" else (True, True),
                             algo="auto" if setting == "off" else "handoff")
    per_step = _steps(world, runtimes, 4)
    kinds = {tuple(_kinds(calls[0])) for calls in per_step[1:]}
    assert len(kinds) == 1 and ("all_reduce",) not in kinds, kinds  # the same choice every step, never native's
    for rt in runtimes:
        assert (rt.stats.trial_steps, rt.stats.trial_native_flushes, rt.flusher.timed) == (0, 0, None)
        assert "measuring" not in rt.stats.schedule_lines[0] if rt.stats.schedule_lines else True


@pytest.mark.timeout(30)
def test_ranks_that_disagree_on_measuring_refuse_to_start_naming_the_key():
    with pytest.raises(OwnerReduceMismatchError, match="compile.reduce_to_owner_algo differs across ranks: auto on "
                                                      "rank 0, model on rank 1"):
        _world(measure=(True, False))


@pytest.mark.timeout(60)
def test_leaving_the_schedule_mid_trial_drops_the_trial_on_every_rank_and_a_new_one_starts():
    world, runtimes = _world({1: _SlowReduceScatter})
    _steps(world, runtimes, 3)  # learned, then two trial steps
    shuffled = [5, 3, 1, *[p for p in reversed(range(len(NUMELS))) if p not in (5, 3, 1)]]
    _steps(world, runtimes, 1, order=shuffled, first=3)  # leaves the schedule: the trial is dropped alike
    for rt in runtimes:
        assert rt.stats.schedule_fallbacks == 1 and rt.flusher.timed is None
    _steps(world, runtimes, 1 + 2 * TRIAL_ROUNDS, first=4)  # relearn (arrival order of step 4), a full trial
    for rt in runtimes:
        s = rt.stats
        assert (s.trials_decided, s.measured_overruled, s.trial_steps) == (1, 1, 2 + 6), s


class _NoAgreement(_SlowReduceScatter):
    """A broken guard: every rank decides on its own medians (the gather returns this rank's row only)."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)] * self.world_size


class _NoAgreementFast(ExchangeComm):
    """A broken guard on the rank where the model's choice is faster: native's flush takes ``SLOW_S / 4`` longer here,
    after its group's last exchange (the peer's timed flush never waits for it), so this rank alone keeps the
    ReduceScatter whatever the noise of in-process timings."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)] * self.world_size

    def _group_end(self) -> None:
        super()._group_end()
        if self.calls and self.calls[-1][0] == "all_reduce":
            time.sleep(SLOW_S / 4)


@pytest.mark.timeout(60)
def test_negative_control_ranks_deciding_alone_diverge_and_the_exchange_sees_it():
    """Without the max over ranks, rank 0 (fast) keeps the ReduceScatter and rank 1 (slow) switches to native: the
    next flush's calls differ, which in-process ranks that really exchange report as a mismatch."""
    from fakes import ExchangeMismatch

    world, runtimes = _world({0: _NoAgreementFast, 1: _NoAgreement})
    with pytest.raises(ExchangeMismatch):
        _steps(world, runtimes, 1 + 2 * TRIAL_ROUNDS + 1)


# ---- a schedule whose flushes overlap: the step timed as a whole ------------------------------------------------


def _overlapping_world(monkeypatch, slow_rail: bool):
    """Four in-process ranks in two nodes of two whose step's plan runs every flush two-level (the planner told to
    pick the fastest two-level option for each: consecutive flushes overlap), the guard on; ``slow_rail``: every rail
    call takes ``SLOW_S`` longer on rank 1, so native's calls win the step; else native's AllReduces are the slow
    ones (on rank 0), so the plan wins."""
    from fakes import group_threads_as_nodes

    from owner_reduce.planning import owner_layout
    from owner_reduce.planning.step_plan import StepPlan, schedule

    def every_flush_two_level(options, native, buckets, per_bucket=2):
        picks = tuple(1 if len(o) > 1 else 0 for o in options)
        return StepPlan(picks, schedule([o[j] for o, j in zip(options, picks, strict=True)], buckets, per_bucket),
                        sum(native))

    monkeypatch.setattr(owner_layout, "plan_step", every_flush_two_level)
    group_threads_as_nodes(monkeypatch, 2)
    world = ExchangeWorld(4, timeout_s=20)
    m = flat_map(NUMELS, 4)
    runtimes = world.run(lambda rank: mirror_runtime(m, rank=rank, graph_id=GRAPH, comm=world.comm(rank),
                                                     measure=True, bucket=40)[0])
    if not slow_rail:  # native's AllReduces slow on rank 0: the plan clearly wins (never by chance)
        comm = runtimes[0].comm
        fast = comm.all_reduce
        comm.all_reduce = lambda buf, fast=fast: (fast(buf), time.sleep(SLOW_S / 4))
    else:
        rail = runtimes[1].flusher.levels.rail
        honest = rail.reduce

        def slow(buf, root):
            honest(buf, root)
            time.sleep(SLOW_S)

        rail.reduce = slow
        rail.reduce_scatter = lambda buf, per_rank, honest=rail.reduce_scatter: (honest(buf, per_rank),
                                                                                   time.sleep(SLOW_S))
    for rt in runtimes:
        rt.record_collectives = True
    return world, runtimes


def _four_rank_steps(world, runtimes, steps, first=0):
    per_step = []
    for step in range(first, first + steps):
        before = [len(rt.comm.calls) for rt in runtimes]
        two_level = [rt.stats.two_level_flushes for rt in runtimes]

        def backward(rank: int, step=step) -> None:
            rt = runtimes[rank]
            grads = {pid: torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1) + 100 * step + 10 * pid
                     for pid, n in enumerate(NUMELS)}
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS))):
                rt.reduce_grad(grads[pid], GRAPH, pid)
            rt.end_backward(GRAPH, False)

        world.run(backward)
        per_step.append([(rt.stats.two_level_flushes - t, rt.comm.calls[n:]) for rt, t, n in
                         zip(runtimes, two_level, before, strict=True)])
    return per_step


@pytest.mark.timeout(90)
@pytest.mark.parametrize("slow_rail", [True, False], ids=["native-wins", "plan-kept"])
def test_a_plan_whose_flushes_overlap_is_timed_as_a_whole_step_and_kept_or_overruled_whole(slow_rail, monkeypatch):
    world, runtimes = _overlapping_world(monkeypatch, slow_rail)
    per_step = _four_rank_steps(world, runtimes, 1 + 2 * TRIAL_ROUNDS + 2)
    assert "measuring the step against native's calls" in runtimes[0].stats.schedule_lines[0]
    for rt in runtimes:
        s = rt.stats
        assert (s.trial_steps, s.trials_decided) == (6, 1), s
        assert rt.flusher.timed is None and rt.flusher.step_start is None
    (line,) = runtimes[0].stats.measured_lines
    assert "the step's reduction (flushes overlapped) over 3 steps each way" in line, line
    two_level_after = [n for n, _ in per_step[-1]]
    if slow_rail:
        assert line.endswith("native's calls for every flush from now on, overruled by measurement"), line
        assert two_level_after == [0, 0, 0, 0]  # every rank runs native's calls, every flush
        assert all(kind == "all_reduce" for _, calls in per_step[-1] for kind, _, _ in calls)
    else:
        assert "the plan kept" in line, line
        assert all(n > 1 for n in two_level_after)  # the overlapped two-level plan, every rank
