"""The measured guard's verdicts as data (``planning.verdict_book``): the file, its key, its replay by the runtime, and
the runtime's checkpoint state (verdicts and schedules as learned) restored by every rank alike."""

from __future__ import annotations

import json

import pytest
from test_measured_guard import GRAPH, NUMELS, TRIAL_ROUNDS, _SlowReduceScatter, _steps, _world

from owner_reduce.planning.measured import TrialFlush, Verdict
from owner_reduce.planning.verdict_book import (
    CHECKPOINT_FORMAT,
    ScheduleVerdicts,
    VerdictBook,
    load_verdicts,
    parse_checkpoint_payload,
    schedule_key,
    write_verdicts,
)
from owner_reduce.runtime.handle import OwnerReduceMismatchError

DECIDED = 1 + 2 * TRIAL_ROUNDS  # backwards until a trial's verdict (the first learns the schedule)


def _book() -> VerdictBook:
    flushes = (TrialFlush(1, "reduce_scatter", 10.0, 20.0, Verdict(15.0, 12.0, True)),
               TrialFlush(3, "reduce", 5.0, 9.0, Verdict(4.0, 3.5, False)))
    return VerdictBook(4, (ScheduleVerdicts("abc", 3, flushes),))


def test_the_file_round_trips_is_validated_and_written_whole(tmp_path):
    book = _book()
    path = tmp_path / "v.json"
    write_verdicts(path, book)
    assert load_verdicts(path) == book and load_verdicts(path).digest() == book.digest()
    assert not (tmp_path / ".v.json.tmp").exists()
    data = json.loads(path.read_text())
    data["schedules"][0]["flushes"][0]["native_wins"] = "yes"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"verdicts .*v.json: key 'schedules\[0\].flushes\[0\].native_wins' must be "
                                         r"bool, got 'yes'"):
        load_verdicts(path)
    with pytest.raises(ValueError, match="key 'format' must be 'owner_reduce.verdicts/1'"):
        VerdictBook.from_dict({"format": "x"})
    with pytest.raises(ValueError, match="cannot be read"):
        load_verdicts(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="measured on 4 ranks, this run has 8"):
        book.check_world_size(8)


def test_a_schedules_key_follows_its_flushes_and_choices_and_a_later_verdict_replaces_an_earlier():
    flushes = [("bfloat16", (3, 2), (10, 5), "reduce")]
    assert schedule_key(4, flushes) == schedule_key(4, list(flushes))
    assert len({schedule_key(4, flushes), schedule_key(8, flushes), schedule_key(4, [("float32", (3, 2), (10, 5),
                                                                                    "reduce")]),
                schedule_key(4, [("bfloat16", (3, 2), (10, 5), "allreduce")])}) == 4
    book = _book()
    later = ScheduleVerdicts("abc", 3, book.schedules[0].flushes[:1])
    assert book.with_schedule(later).schedules == (later,)
    other = ScheduleVerdicts("def", 3, ())
    assert book.merged(VerdictBook(4, (other,))).schedules == (book.schedules[0], other)
    assert book.schedules[0].matches([(1, "reduce_scatter"), (3, "reduce")])
    assert not book.schedules[0].matches([(1, "reduce_scatter")])


def test_checkpoint_payload_is_validated():
    with pytest.raises(ValueError, match="is not owner_reduce.checkpoint/1 data"):
        parse_checkpoint_payload({"format": "x"}, "ckpt")
    with pytest.raises(ValueError, match="its schedules are not"):
        parse_checkpoint_payload({"format": CHECKPOINT_FORMAT, "verdicts": None, "schedules": [[[1]]]}, "ckpt")
    book, recordings = parse_checkpoint_payload({"format": CHECKPOINT_FORMAT, "verdicts": None,
                                                 "schedules": [[["float32", [1, 0], [5, 6]]]]}, "ckpt")
    assert book is None and recordings == [[("float32", (1, 0), (5, 6))]]


# ---- the runtime: in-process ranks that really exchange ------------------------------------------------------


def _calls_after(world, runtimes, steps, first):
    per_step = _steps(world, runtimes, steps, first=first)
    return [sorted({kind for kind, _, _ in calls[0]}) for calls in per_step]


@pytest.mark.timeout(60)
def test_verdicts_written_by_one_run_are_replayed_by_the_next_without_a_trial(tmp_path, monkeypatch):
    """Run 1 records (the file does not exist yet); run 2 replays it: no trial, native's calls from its first scheduled
    backward (what run 1 decided), every rank alike."""
    path = str(tmp_path / "v.json")
    world, runtimes = _world({1: _SlowReduceScatter}, verdicts_path=path)
    _steps(world, runtimes, DECIDED)
    (line,) = runtimes[0].stats.measured_lines
    assert line.endswith(f"; verdicts written to {path}"), line
    book = load_verdicts(path)
    assert [f.verdict.native_wins for s in book.schedules for f in s.flushes] == [True]
    world, runtimes = _world(verdicts=book, verdicts_path=path)  # no slow rank now: the file decides
    assert _calls_after(world, runtimes, 2, 0)[1] == ["all_reduce"]  # learned, then native's calls at once
    for rt in runtimes:
        assert (rt.stats.trials_decided, rt.stats.trials_replayed, rt.stats.trial_steps) == (0, 1, 0), rt.stats
    assert runtimes[0].stats.measured_lines[0].startswith(
        f"[dc-schedule][r0] graph #1: verdicts replayed from compile.reduce_to_owner_verdicts={path}, as measured 1 "
        "flush")
    assert (f"verdicts replayed from compile.reduce_to_owner_verdicts={path} (no trial)"
            in runtimes[0].stats.schedule_lines[0])


@pytest.mark.timeout(60)
def test_a_schedule_learned_again_in_the_same_run_keeps_its_verdict():
    world, runtimes = _world({1: _SlowReduceScatter})
    _steps(world, runtimes, DECIDED)
    for rt in runtimes:
        rt.reset()  # DeepCompile recompiles: every graph learns its schedule again
        rt.register_graph_z1(GRAPH, list(range(len(NUMELS))))
    assert _calls_after(world, runtimes, 2, DECIDED)[1] == ["all_reduce"]
    for rt in runtimes:
        assert (rt.stats.trials_decided, rt.stats.trials_replayed) == (1, 1), rt.stats


@pytest.mark.timeout(60)
def test_the_checkpoint_state_restores_schedules_and_verdicts_on_every_rank(monkeypatch):
    """What a checkpoint keeps, handed to fresh runtimes: the first backward follows the saved schedule with its
    winner (native's calls) at once, in place of an arrival-order backward and a new trial."""
    world, runtimes = _world({1: _SlowReduceScatter})
    _steps(world, runtimes, DECIDED)
    state = runtimes[0].checkpoint_state()
    assert state == runtimes[1].checkpoint_state() and state["schedules"] and state["verdicts"]["schedules"]
    world, fresh = _world()
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(json.loads(json.dumps(state)), "ckpt/x"))
    assert _calls_after(world, fresh, 1, 0) == [["all_reduce"]]  # the very first backward: the saved winner
    for rt in fresh:
        s = rt.stats
        assert (s.schedules_restored, s.trials_replayed, s.trials_decided, s.trial_steps) == (1, 1, 0, 0), s
    # Ranks that read different states refuse together.
    world, fresh = _world()
    other = dict(state, schedules=[])
    with pytest.raises(OwnerReduceMismatchError, match="the ranks read different owner_reduce state from ckpt/x"):
        world.run(lambda rank: fresh[rank].restore_checkpoint_state(state if rank == 0 else other, "ckpt/x"))


@pytest.mark.timeout(60)
def test_a_restored_schedule_is_adopted_only_by_the_graph_whose_first_gradient_it_is():
    world, runtimes = _world({1: _SlowReduceScatter})
    _steps(world, runtimes, 1)
    state = runtimes[0].checkpoint_state()
    world, fresh = _world()
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    order = list(range(len(NUMELS)))  # another arrival order: another first gradient
    _steps(world, fresh, 1, order=order)
    for rt in fresh:
        assert (rt.stats.schedules_restored, rt.stats.schedules_learned) == (0, 1), rt.stats
