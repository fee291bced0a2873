"""The measured guard's verdicts as data (``planning.verdict_book``): the file, its key, its replay by the runtime, and
the runtime's checkpoint state (verdicts and schedules as learned) restored by every rank alike."""

from __future__ import annotations

import json

import pytest

from owner_reduce.planning.measured import TrialFlush, Verdict
from owner_reduce.planning.verdict_book import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT_1,
    ScheduleVerdicts,
    TrialProgress,
    VerdictBook,
    checkpoint_payload,
    load_verdicts,
    parse_checkpoint_payload,
    schedule_key,
    write_verdicts,
)
from owner_reduce.runtime.handle import OwnerReduceMismatchError
from tests.exchange.test_measured_guard import GRAPH, NUMELS, SLOW_RANK, TRIAL_ROUNDS, _steps, _world, verdict_rule

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


def test_checkpoint_payload_is_validated_and_the_previous_releases_is_read():
    with pytest.raises(ValueError, match=r"'owner_reduce' is not owner_reduce.checkpoint/2 or "
                                         r"owner_reduce.checkpoint/1 data \(format 'x'\)"):
        parse_checkpoint_payload({"format": "x"}, "ckpt")
    with pytest.raises(ValueError, match="its schedules are not"):
        parse_checkpoint_payload({"format": CHECKPOINT_FORMAT, "verdicts": None, "schedules": [[[1]]], "trials": []},
                                 "ckpt")
    schedules = [[["float32", [1, 0], [5, 6]]]]
    # The previous release's payload (no trials under way): read, with none.
    book, recordings, trials = parse_checkpoint_payload({"format": CHECKPOINT_FORMAT_1, "verdicts": None,
                                                         "schedules": schedules}, "ckpt")
    assert book is None and recordings == [[("float32", (1, 0), (5, 6))]] and trials == ()
    progress = TrialProgress("abc", 3, 3, ((1, "reduce", (10_000, 12_000), (9_000,)),))
    payload = checkpoint_payload(None, [[("float32", (1, 0), (5, 6))]], [progress])
    assert payload["format"] == CHECKPOINT_FORMAT
    assert parse_checkpoint_payload(json.loads(json.dumps(payload)), "ckpt")[2] == (progress,)
    wrong = json.loads(json.dumps(payload))
    wrong["trials"][0]["flushes"][0]["native_ns"] = [9_000, 1]
    with pytest.raises(ValueError, match=r"checkpoint state ckpt: key 'trials\[0\].flushes\[0\].native_ns' must "
                                         r"hold 1 step times after 3 trial steps"):
        parse_checkpoint_payload(wrong, "ckpt")
    wrong["trials"][0]["steps"] = 6
    with pytest.raises(ValueError, match=r"key 'trials\[0\].steps' must be below 6"):
        parse_checkpoint_payload(wrong, "ckpt")
    del payload["trials"]
    with pytest.raises(ValueError, match="key 'trials' is missing"):
        parse_checkpoint_payload(payload, "ckpt")


# ---- the runtime: in-process ranks that really exchange ------------------------------------------------------


def _calls_after(world, runtimes, steps, first):
    per_step = _steps(world, runtimes, steps, first=first)
    return [sorted({kind for kind, _, _ in calls[0]}) for calls in per_step]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ["product", "fastest rank"])
def test_verdicts_written_by_one_run_are_replayed_by_the_next_without_a_trial(tmp_path, rule, monkeypatch):
    """Run 1 records (the file does not exist yet); run 2 replays it: no trial, native's calls from its first scheduled
    backward (what run 1 decided), every rank alike."""
    path = str(tmp_path / "v.json")
    with verdict_rule(monkeypatch, rule):
        world, runtimes = _world(SLOW_RANK, verdicts_path=path)
        _steps(world, runtimes, DECIDED)
        (line,) = runtimes[0].stats.measured_lines
        assert line.endswith(f"; verdicts written to {path}"), line
        book = load_verdicts(path)
        assert [f.verdict.native_wins for s in book.schedules for f in s.flushes] == [True], f"verdict: {line}"
    if rule != "product":
        return
    world, runtimes = _world(verdicts=book, verdicts_path=path)  # no samples now: the file decides
    assert _calls_after(world, runtimes, 2, 0)[1] == ["all_reduce"]  # learned, then native's calls at once
    for rt in runtimes:
        assert (rt.stats.trials_decided, rt.stats.trials_replayed, rt.stats.trial_steps) == (0, 1, 0), rt.stats
    assert runtimes[0].stats.measured_lines[0].startswith(
        f"[dc-schedule][r0] graph #1: verdicts replayed from compile.reduce_to_owner_verdicts={path}, measured "
        "0.092 ms vs native 0.021 ms")
    assert (f"verdicts replayed from compile.reduce_to_owner_verdicts={path} (no trial)"
            in runtimes[0].stats.schedule_lines[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ["product", "fastest rank"])
def test_a_schedule_learned_again_in_the_same_run_keeps_its_verdict(rule, monkeypatch):
    with verdict_rule(monkeypatch, rule):
        world, runtimes = _world(SLOW_RANK)
        _steps(world, runtimes, DECIDED)
        for rt in runtimes:
            rt.reset()  # DeepCompile recompiles: every graph learns its schedule again
            rt.register_graph_z1(GRAPH, list(range(len(NUMELS))))
        assert _calls_after(world, runtimes, 2, DECIDED)[1] == ["all_reduce"], "verdict: not native's calls"
        for rt in runtimes:
            assert (rt.stats.trials_decided, rt.stats.trials_replayed) == (1, 1), rt.stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ["product", "fastest rank"])
def test_the_checkpoint_state_restores_schedules_and_verdicts_on_every_rank(rule, monkeypatch):
    """What a checkpoint keeps, handed to fresh runtimes: the first backward follows the saved schedule with its
    winner (native's calls) at once, in place of an arrival-order backward and a new trial."""
    with verdict_rule(monkeypatch, rule):
        world, runtimes = _world(SLOW_RANK)
        _steps(world, runtimes, DECIDED)
        state, other_rank = world.run(lambda rank: runtimes[rank].checkpoint_state())
        assert state == other_rank and state["schedules"] and state["verdicts"]["schedules"] and state["trials"] == []
        world, fresh = _world()
        world.run(lambda rank: fresh[rank].restore_checkpoint_state(json.loads(json.dumps(state)), "ckpt/x"))
        assert _calls_after(world, fresh, 1, 0) == [["all_reduce"]], "verdict: the first backward runs otherwise"
        for rt in fresh:
            s = rt.stats
            assert (s.schedules_restored, s.trials_replayed, s.trials_decided, s.trial_steps) == (1, 1, 0, 0), s
    if rule != "product":
        return
    # Ranks that read different states refuse together.
    world, fresh = _world()
    other = dict(state, schedules=[])
    with pytest.raises(OwnerReduceMismatchError, match="the ranks read different owner_reduce state from ckpt/x"):
        world.run(lambda rank: fresh[rank].restore_checkpoint_state(state if rank == 0 else other, "ckpt/x"))


@pytest.mark.timeout(60)
def test_a_restored_schedule_is_adopted_only_by_the_graph_whose_first_gradient_it_is():
    world, runtimes = _world(SLOW_RANK)
    _steps(world, runtimes, 1)
    state = world.run(lambda rank: runtimes[rank].checkpoint_state())[0]  # a trial under way: every rank gathers
    world, fresh = _world()
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, "ckpt/x"))
    order = list(range(len(NUMELS)))  # another arrival order: another first gradient
    _steps(world, fresh, 1, order=order)
    for rt in fresh:
        assert (rt.stats.schedules_restored, rt.stats.schedules_learned) == (0, 1), rt.stats
