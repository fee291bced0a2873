"""A checkpoint saved during the measured guard's trial (issue 40), on in-process ranks that really exchange: the
trial's state travels with the checkpoint and a resumed run goes on with the same trial from the same step with the
same samples, so it runs what the uninterrupted run runs, step by step; saving changes nothing the guard decides.

Samples are fixed (``harness.fixed_samples``, issue 41), close to each other on purpose: where the model's choice and
native's calls are close, a trial measured again would decide by chance. The end-to-end counterpart on gloo with
DeepSpeed is ``test_checkpoint_trial_e2e.py``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from harness.fixed_samples import FixedSamples
from owner_reduce.planning.verdict_book import CHECKPOINT_KEY
from owner_reduce.runtime.trial_clock import StreamClock
from owner_reduce.wiring.checkpoint import RUNTIME_ATTR, wrap_save_checkpoint
from tests.exchange.test_measured_guard import NUMELS, TRIAL_ROUNDS, WS, fixed_clocks
from tests.support.fakes import ExchangeWorld, exchange_backward, flat_map, mirror_runtime

GRAPH = 11
STEPS = 1 + 2 * TRIAL_ROUNDS + 2  # learned, the trial, two steps after the verdict
# Close, and native's calls win: every native step beats every model step by less than the model's own spread. A
# trial measured again (fresh samples: ``AGAIN``) keeps the model's choice, so a resumed run that dropped the trial's
# state differs.
CLOSE = ([([30, 24, 26], [21, 22, 23])], [([29, 25, 27], [22, 23, 22])])
AGAIN = ([([30, 24, 26], [28, 22, 23])], [([29, 25, 27], [22, 23, 22])])  # native's first step slow: model kept


def _world(**settings):
    world = ExchangeWorld(WS, timeout_s=20)
    m = flat_map(NUMELS, WS)
    runtimes = world.run(lambda rank: mirror_runtime(m, rank=rank, graph_id=GRAPH, comm=world.comm(rank),
                                                     measure=True, **settings)[0])
    for rt in runtimes:
        rt.record_collectives = True
    return world, runtimes


def _grads(rank: int, step: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {pid: torch.randn(n, generator=g) for pid, n in enumerate(NUMELS)}


def _right(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Every step's reduced gradients are the true mean, bitwise: at ws 2 each variant adds two halves (halving is
    exact), one sum whose order cannot matter; the comparison between runs is ``_same``'s."""
    assert torch.equal(got, want), f"{what}: differs from the true mean by up to {(got - want).abs().max():.3e}"


def _run(world, runtimes, steps: range) -> list[tuple[list, list[torch.Tensor]]]:
    """Each step's calls (rank 0's; the ranks matched them) and every rank's grad buffers after it."""
    out = []
    for step in steps:
        before = len(world.comm(0).calls)
        exchange_backward(world, runtimes, lambda rank, step=step: _grads(rank, step), GRAPH,
                          list(reversed(range(len(NUMELS)))), _right)
        buffers = [torch.cat([p.grad_buffer.clone() for p in rt._params.values()]) for rt in runtimes]
        out.append((world.comm(0).calls[before:], buffers))
        for rt in runtimes:
            for p in rt._params.values():
                p.grad_buffer.zero_()
    return out


def _same(a, b, what: str) -> None:
    assert len(a) == len(b)
    for step, ((calls_a, bufs_a), (calls_b, bufs_b)) in enumerate(zip(a, b, strict=True)):
        assert calls_a == calls_b, f"{what}: step {step}: other calls"
        for rank, (x, y) in enumerate(zip(bufs_a, bufs_b, strict=True)):
            assert torch.equal(x, y), f"{what}: step {step}, rank {rank}: reduced gradients differ"


def _uninterrupted():
    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    return _run(world, runtimes, range(STEPS)), runtimes


@pytest.fixture(scope="module")
def uninterrupted():
    return _uninterrupted()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("save_after", [1, 3, 1 + 2 * TRIAL_ROUNDS])
def test_a_run_resumed_from_any_step_runs_what_the_uninterrupted_run_runs(save_after, uninterrupted):
    """Saved after the schedule was learned (step 1), in the trial (step 3: one sample of each variant) and after the
    verdict: the saving run, and fresh runtimes restored from its state, each equal the uninterrupted run step by
    step (calls and bits); the resumed trial asks the clock only for the rounds after the save."""
    reference, ref_runtimes = uninterrupted
    assert ref_runtimes[0].stats.measured_overruled == 1 and ref_runtimes[0].stats.close_lines  # close, native won
    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    before = _run(world, runtimes, range(save_after))
    state = world.run(lambda rank: runtimes[rank].checkpoint_state())
    assert state[0] == state[1]
    state = json.loads(json.dumps(state[0]))  # as DeepSpeed's client state keeps it
    in_trial = save_after < 1 + 2 * TRIAL_ROUNDS
    assert len(state["trials"]) == int(in_trial) and (state["verdicts"] is None) == in_trial, state
    after = _run(world, runtimes, range(save_after, STEPS))
    _same(before + after, reference, "the saving run vs the uninterrupted run")

    world, fresh = _world()
    clocks = fixed_clocks(fresh, CLOSE)
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    resumed = _run(world, fresh, range(save_after, STEPS))
    _same(resumed, reference[save_after:], "the resumed run vs the uninterrupted run")
    done = save_after - 1  # trial steps before the save
    asked = [(p.variant, p.round) for p in clocks[0].asked]
    assert asked == [(k % 2, k // 2) for k in range(done, 2 * TRIAL_ROUNDS)] if in_trial else asked == [], asked
    s = fresh[0].stats
    assert (s.schedules_restored, s.trials_resumed, s.trials_replayed) == \
        (1, int(in_trial), int(not in_trial)), s
    if in_trial:  # the verdict is the resumed run's, decided at the same step as the uninterrupted run's
        assert s.trials_decided == 1 and s.measured_lines == ref_runtimes[0].stats.measured_lines


@pytest.mark.timeout(90)
def test_negative_control_a_resumed_run_whose_trial_state_is_dropped_differs(uninterrupted):
    """The same checkpoint (step 3) with its trial dropped: the resumed run measures a new trial from its first step
    (other variants at other steps; its fresh samples keep the model's choice), and that shows in the calls and the
    bits, so the comparison above can fail."""
    reference, _ = uninterrupted
    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    _run(world, runtimes, range(3))
    state = json.loads(json.dumps(world.run(lambda rank: runtimes[rank].checkpoint_state())[0]))
    assert state["trials"]
    state["trials"] = []
    world, fresh = _world()
    fixed_clocks(fresh, AGAIN)
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    resumed = _run(world, fresh, range(3, STEPS))
    with pytest.raises(AssertionError, match="the dropped state's run vs the uninterrupted run: step"):
        _same(resumed, reference[3:], "the dropped state's run vs the uninterrupted run")
    assert fresh[0].stats.trials_resumed == 0


@pytest.mark.timeout(90)
def test_a_trial_not_resumed_yet_is_kept_by_the_next_save_and_a_foreign_one_is_measured_anew(caplog):
    """Saved again before the resumed run's first backward: the trial still travels. A saved trial whose flushes are
    not this schedule's (another release's, a hand-edited payload) is not resumed: rank 0 says why, the trial starts
    at its first step."""
    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    _run(world, runtimes, range(3))
    state = json.loads(json.dumps(world.run(lambda rank: runtimes[rank].checkpoint_state())[0]))
    world, fresh = _world()
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    again = json.loads(json.dumps(world.run(lambda rank: fresh[rank].checkpoint_state())[0]))
    assert again == state

    state["trials"][0]["flushes"][0]["algo"] = "reduce"
    world, fresh = _world()
    for rt in fresh:
        rt.trial_clock = FixedSamples.per_flush(list(CLOSE[0]))
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/y"))
    import logging

    with caplog.at_level(logging.WARNING):
        _run(world, fresh, range(3, 4))
    assert fresh[0].stats.trials_resumed == 0 and fresh[0].stats.trial_steps == 1
    warned = [r.getMessage() for r in caplog.records if "not resuming the measured guard's trial" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("owner_reduce: not resuming the measured guard's trial saved in "
                                                     "ckpt/y: the saved trial of schedule "), warned
    assert warned[0].endswith("this schedule is measured from its first trial step"), warned


@pytest.mark.timeout(90)
def test_a_verdict_file_written_after_the_save_pins_the_resumed_trial(uninterrupted, tmp_path):
    """The pin rank 0 names: the saving run wrote its verdicts to a file after the trial; a run resumed from its
    checkpoint of step 3 that replays the file runs the trial's remaining steps as the saving run did, then the file's
    verdicts (not its own samples, which here would keep the model's choice): bitwise the uninterrupted run."""
    from owner_reduce.planning.verdict_book import load_verdicts

    reference, _ = uninterrupted
    path = str(tmp_path / "v.json")
    world, runtimes = _world(verdicts_path=path)
    fixed_clocks(runtimes, CLOSE)
    _run(world, runtimes, range(3))
    state = json.loads(json.dumps(world.run(lambda rank: runtimes[rank].checkpoint_state())[0]))
    _run(world, runtimes, range(3, STEPS))
    assert runtimes[0].stats.close_lines == []  # pinned: nothing to warn about
    world, fresh = _world(verdicts=load_verdicts(path), verdicts_path=path)
    fixed_clocks(fresh, AGAIN)
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    _same(_run(world, fresh, range(3, STEPS)), reference[3:], "the resumed run replaying the file")
    s = fresh[0].stats
    assert (s.trials_resumed, s.trials_replayed, s.trials_decided) == (1, 1, 0), s
    assert f"; the resumed trial's last 4 steps, then the verdicts replayed from " \
           f"compile.reduce_to_owner_verdicts={path}" in s.schedule_lines[0], s.schedule_lines
    assert s.measured_lines[0].startswith(f"[dc-schedule][r0] graph #1: verdicts replayed from "
                                          f"compile.reduce_to_owner_verdicts={path}, measured"), s.measured_lines


@pytest.mark.timeout(90)
def test_a_step_timed_as_a_whole_resumes_too(monkeypatch):
    """Four ranks in two nodes whose flushes overlap (the trial times the step as a whole: trial flush 0): saved
    after three steps, resumed in fresh runtimes, the same calls step by step as the uninterrupted run."""
    from tests.exchange.test_measured_guard import _four_rank_steps, _overlapping_world

    world, runtimes = _overlapping_world(monkeypatch, slow_rail=True)
    reference = _four_rank_steps(world, runtimes, STEPS)
    world, runtimes = _overlapping_world(monkeypatch, slow_rail=True)
    _four_rank_steps(world, runtimes, 3)
    state = json.loads(json.dumps(world.run(lambda rank: runtimes[rank].checkpoint_state())[0]))
    assert [(f["number"], f["algo"]) for f in state["trials"][0]["flushes"]] == [(0, "the step")]
    world, fresh = _overlapping_world(monkeypatch, slow_rail=True)
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    resumed = _four_rank_steps(world, fresh, STEPS - 3, first=3)
    assert resumed == reference[3:]
    assert fresh[0].stats.trials_resumed == 1 and fresh[0].stats.measured_lines[0].endswith(
        "overruled by measurement: native's calls for every flush")


@pytest.mark.timeout(90)
def test_ranks_at_different_points_of_a_trial_refuse_the_save_together_naming_them_in_folded_ranges(monkeypatch):
    """``save_checkpoint`` gathers every rank's samples; ranks whose trials are at different points (which the
    invariants exclude: injected here into rank 1's trial) refuse together, each naming the ranks by value. At 512
    ranks the message stays a line: ranks folded into ranges (``wording``), not listed one by one."""
    from owner_reduce import OwnerReduceMismatchError

    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    _run(world, runtimes, range(3))
    trial = runtimes[1].placer.running_trials()[0]
    trial.add_sample(0, 0, 25.0)  # rank 1 one sample ahead

    def save(rank):
        try:
            runtimes[rank].checkpoint_state()
        except OwnerReduceMismatchError as error:
            return str(error)
        return None

    said = world.run(save)
    assert said == [f"owner_reduce on rank {r}: save_checkpoint: the ranks are at different points of the measured "
                    f"guard's trials: 1 trial in a row of 6 integers on rank 0, 1 trial in a row of 7 integers on "
                    f"rank 1" for r in range(2)], said

    world, runtimes = _world()
    fixed_clocks(runtimes, CLOSE)
    _run(world, runtimes, range(3))
    rt = runtimes[0]
    shapes = [[1, 7 if r == 256 else 6] for r in range(512)]
    monkeypatch.setattr(rt.comm, "all_gather_ints", lambda values: shapes)  # 512 ranks, rank 256 a sample ahead
    with pytest.raises(OwnerReduceMismatchError) as caught:
        rt.checkpoint_state()
    message = str(caught.value)
    assert message.endswith("trials: 1 trial in a row of 6 integers on ranks 0-255, 257-511, 1 trial in a row of 7 "
                            "integers on rank 256"), message
    assert len(message) < 250, message


# ---- saving does not change what the guard decides: no sample covers a save ---------------------------------------


class RecordingClock:
    """The product's clock (``trial_clock.StreamClock``: the host streams' marks, ``time.perf_counter``), recording
    each sample's point and its two marks in the order the trial asks for them."""

    def __init__(self) -> None:
        self.samples: list[tuple[Any, float, float]] = []

    def sample_us(self, point, streams, start, end) -> float:
        self.samples.append((point, start, end))
        return StreamClock.sample_us(point, streams, start, end)


class SavingEngine:
    """Where ``engine.save_checkpoint`` reaches DeepSpeed: DeepSpeed's own save (its signature), standing in for the
    file writes; the product's wrapper (``wiring.checkpoint``) goes around it as ``install`` puts it on the engine."""

    def __init__(self, runtime) -> None:
        setattr(self, RUNTIME_ATTR, runtime)
        self.client_states: list[dict] = []

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DeepSpeed's
                        exclude_frozen_parameters=False):
        self.client_states.append(dict(client_state))
        return True


SAVES_AFTER = (1, 3, 6, 1 + 2 * TRIAL_ROUNDS)  # the schedule learned; in the trial (twice); after the verdict


def _timed_saves(monkeypatch_flusher=None):
    """A run of ``STEPS`` backwards on two in-process ranks, the guard on the product's clock (recorded), saving
    through the product's ``save_checkpoint`` wrapper on every rank after each of ``SAVES_AFTER``: per rank the
    samples in the order asked, and each save as (index of the first sample asked after it, its start, its end)."""
    world, runtimes = _world()
    clocks = [RecordingClock() for _ in runtimes]
    for rt, clock in zip(runtimes, clocks, strict=True):
        rt.trial_clock = clock
    engines = [SavingEngine(rt) for rt in runtimes]
    save = wrap_save_checkpoint(SavingEngine.save_checkpoint)
    saves: list[list[tuple[int, float, float]]] = [[] for _ in runtimes]

    def saving(rank):
        started = time.perf_counter()
        save(engines[rank], "ckpt", client_state={"step": rank})
        saves[rank].append((len(clocks[rank].samples), started, time.perf_counter()))

    done = 0
    for after in SAVES_AFTER:
        _run(world, runtimes, range(done, after))
        world.run(saving)
        done = after
    _run(world, runtimes, range(done, STEPS))
    for rank, engine in enumerate(engines):  # the product's save path ran: the trial's state while under way
        trials = [len(state[CHECKPOINT_KEY]["trials"]) for state in engine.client_states]
        assert trials == [1, 1, 1, 0] and all(state["step"] == rank for state in engine.client_states), trials
        assert len(clocks[rank].samples) == 2 * TRIAL_ROUNDS and runtimes[rank].stats.trials_decided == 1
    return [clock.samples for clock in clocks], saves


def samples_covering_saves(samples, saves) -> list[str]:
    """Where a sample's interval is not wholly before or wholly after a save, in the order the trial asked for them:
    every sample asked before the save ended before the save began, every one asked after began after it ended."""
    out = []
    for rank, (mine, my_saves) in enumerate(zip(samples, saves, strict=True)):
        for number, (first_after, started, ended) in enumerate(my_saves):
            for k, (point, start, end) in enumerate(mine):
                if not (end < started if k < first_after else ended < start):
                    out.append(f"rank {rank}: sample {k} (variant {point.variant}, round {point.round}) covers save "
                               f"{number + 1}")
    return out


@pytest.mark.timeout(90)
def test_no_sample_of_the_trial_covers_a_save_so_saving_cannot_change_the_verdict():
    """Issue 40: saving a checkpoint does not change what the guard decides. Saves after steps 1, 3, 6 and 7 through
    the product's ``save_checkpoint`` wrapper (its gathers of every rank's samples included), the product's clock
    recording each sample's marks: the order of the marks, never their durations, shows every save outside every
    sample; saves 2 and 3 fall between sampled steps of the trial."""
    samples, saves = _timed_saves()
    assert samples_covering_saves(samples, saves) == []
    for my_saves in saves:
        assert [first_after for first_after, _, _ in my_saves] == [0, 2, 5, 6]  # samples asked before each save


@pytest.mark.timeout(90)
def test_negative_control_a_sample_moved_to_cover_the_save_is_caught(monkeypatch):
    """The flusher's start mark of each timed flush taken from the previous timed flush's end (injected into the
    product's ``Flusher._marked``): a sample then runs from the step before a save to the step after it, and the
    check names it."""
    from owner_reduce.runtime.flush import Flusher

    marked = Flusher._marked

    def from_the_last_end(self, key, start, streams, level=None):
        last = self.__dict__.get("_last_end")
        marked(self, key, start if key is None or last is None else last, streams, level)
        if key is not None and self.marks:
            self._last_end = self.marks[-1][2]

    monkeypatch.setattr(Flusher, "_marked", from_the_last_end)
    samples, saves = _timed_saves()
    covering = samples_covering_saves(samples, saves)
    assert covering, "a sample spanning the save was not caught"
    assert all(f"sample {k}" in " ".join(covering) for k in (2, 5)), covering  # the first samples after saves 2, 3
