"""What a user imports and reads (issue 38): every documented error class from ``owner_reduce`` itself, and the lines
rank 0 prints once per run or per graph kept to about 30 words, so that they stay lines at 512 ranks.

The init line's format is the contract's (``/work/shared/DESIGN.md``, "Exact output formats") and is checked exactly;
the schedule lines are checked as the real runtime prints them (in-process ranks that really exchange, the measured
guard's samples fixed), in the cases a user meets: a schedule learned, its trial resumed from a checkpoint (also where
a verdict file pins it), its verdicts replayed, and the verdict lines of a per-flush trial and of a step timed whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import owner_reduce
from harness.fixed_samples import FixedSamples
from owner_reduce.planning.measured import STEP, TRIAL_ROUNDS, TrialFlush, Verdict, format_measured_line
from owner_reduce.planning.verdict_book import load_verdicts
from tests.support.fakes import ExchangeWorld, exchange_backward, flat_map, mirror_runtime

ROOT = Path(__file__).resolve().parents[2]
MAX_WORDS = 30
INIT_RE = re.compile(r"^DeepCompile reduce_to_owner: \d+/\d+ gradients reduce to one rank")  # DESIGN.md, exactly

NUMELS = [3 + (7 * i) % 11 for i in range(24)]  # ws 2, bucket 60: 4 flushes, reduce x3 and allreduce x1 (the demo's)
BUCKET = 60
GRAPH = 11
# Per rank, per trial flush: (the model's samples by round, native's), us. Flush 1 overruled, flush 2 within the
# noise, flushes 3 and 4 the model's: the longest per-flush verdict line a trial of four flushes gives.
SAMPLES = [[([30, 31, 30], [10, 11, 10]), ([10, 30, 12], [11, 9, 10.5]), ([10, 10, 11], [20, 21, 20]),
            ([10, 10, 11], [20, 21, 20])]] * 2


def _words(line: str) -> int:
    return len(line.split())


def documented_errors(paths: list[Path]) -> set[str]:
    """The error classes the user documents name."""
    return {name for path in paths for name in re.findall(r"\b(?:OwnerReduce|OwnerMap)\w*Error\b", path.read_text())}


def not_exported(names: set[str], package: object) -> set[str]:
    """The names that ``from package import name`` does not give, or that its ``__all__`` does not list."""
    return {n for n in names if not isinstance(getattr(package, n, None), type) or n not in package.__all__}


def test_every_documented_error_class_imports_from_the_package_and_is_in_all():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    names = documented_errors(docs)
    assert {"OwnerReduceMismatchError", "OwnerReduceCommError", "OwnerReduceInstallError"} <= names, names
    from owner_reduce import errors
    from owner_reduce.runtime import handle

    defined = {name for module in (errors, owner_reduce.planning.flags, owner_reduce.planning.owner_map,
                                   owner_reduce.runtime.deadline, owner_reduce.wiring.install)
               for name in vars(module) if re.fullmatch(r"(?:OwnerReduce|OwnerMap)\w*Error", name)}
    assert not_exported(names | defined, owner_reduce) == set(), not_exported(names | defined, owner_reduce)
    from owner_reduce import OwnerReduceMismatchError  # the case, as a user writes it

    assert OwnerReduceMismatchError is errors.OwnerReduceMismatchError is handle.OwnerReduceMismatchError
    # Control: a package without one of them is caught.
    lacking = type("Pkg", (), {"__all__": ["OwnerReduceCommError"], "OwnerReduceCommError": ValueError})
    assert not_exported({"OwnerReduceCommError", "OwnerReduceMismatchError"}, lacking) == {"OwnerReduceMismatchError"}


@pytest.mark.parametrize("numels", [NUMELS, [1 << 12] * 300 + [37] * 5], ids=["small", "300 gradients"])
def test_the_init_line_keeps_its_exact_format_and_stays_short(numels):
    owner_map = flat_map(numels, 8)
    for sliced in (False, True):
        line = owner_map.init_line(sliced)
        assert INIT_RE.match(line) and _words(line) <= MAX_WORDS, line
    assert owner_map.init_line(False) == owner_map.summary()


def _world(**settings):
    world = ExchangeWorld(2, timeout_s=20)
    m = flat_map(NUMELS, 2)
    runtimes = world.run(lambda rank: mirror_runtime(m, rank=rank, graph_id=GRAPH, comm=world.comm(rank), measure=True,
                                                     bucket=BUCKET, **settings)[0])
    for rt, mine in zip(runtimes, SAMPLES, strict=True):
        rt.trial_clock = FixedSamples.per_flush(list(mine))
    return world, runtimes


def _steps(world, runtimes, n: int) -> None:
    def grads(rank):
        return {pid: torch.arange(1.0, k + 1) * (rank + 1) for pid, k in enumerate(NUMELS)}

    for _ in range(n):
        exchange_backward(world, runtimes, grads, GRAPH, list(reversed(range(len(NUMELS)))), lambda *a: None)


def _saved_at_step_3(**settings):
    world, runtimes = _world(**settings)
    _steps(world, runtimes, 3)
    state = json.loads(json.dumps(world.run(lambda rank: runtimes[rank].checkpoint_state())[0]))
    assert state["trials"], state
    return world, runtimes, state


def _resumed(state, **settings):
    world, fresh = _world(**settings)
    source = "the checkpoint /data/run-17/checkpoints/global_step3/mp_rank_00_model_states.pt"
    world.run(lambda rank: fresh[rank].restore_checkpoint_state(state, source))
    _steps(world, fresh, 1 + 2 * TRIAL_ROUNDS)
    return fresh[0].stats


@pytest.mark.timeout(90)
def test_the_schedule_lines_stay_within_thirty_words_as_the_runtime_prints_them(tmp_path):
    world, runtimes, state = _saved_at_step_3()
    _steps(world, runtimes, 2 * TRIAL_ROUNDS)
    s = runtimes[0].stats
    (learned,) = s.schedule_lines
    assert learned.endswith("4 flushes per backward: reduce x3, allreduce x1; modelled " + learned.split(
        "modelled ", 1)[1]) and "measuring 4 flushes against native's calls over the next 6 steps" in learned
    (measured,) = s.measured_lines
    assert measured.endswith("overruled by measurement: flush 1 (reduce); native faster within the noise: flush 2 "
                             "(allreduce)"), measured

    resumed = _resumed(state)
    assert resumed.trials_resumed == 1
    assert resumed.schedule_lines[0].endswith("; measuring 4 flushes against native's calls, 4 steps left (resumed "
                                              "trial)"), resumed.schedule_lines
    assert resumed.measured_lines == s.measured_lines

    replayed = _resumed(json.loads(json.dumps(runtimes[0].checkpoint_state())))  # saved after the verdict
    assert replayed.trials_replayed == 1 and "(no trial)" in replayed.schedule_lines[0], replayed.schedule_lines
    assert "verdicts replayed from the checkpoint " in replayed.measured_lines[0], replayed.measured_lines

    path = str(tmp_path / "verdicts.json")
    world, runtimes, pinned_state = _saved_at_step_3(verdicts_path=path)
    _steps(world, runtimes, 2 * TRIAL_ROUNDS)
    pinned = _resumed(pinned_state, verdicts=load_verdicts(path), verdicts_path=path)
    assert "; the resumed trial's last 4 steps, then the verdicts replayed from compile.reduce_to_owner_verdicts=" in \
        pinned.schedule_lines[0], pinned.schedule_lines

    lines = [learned, measured, *resumed.schedule_lines, *replayed.schedule_lines, *replayed.measured_lines,
             *pinned.schedule_lines, *pinned.measured_lines, *runtimes[0].stats.measured_lines]
    assert len(lines) == 8
    long = [(_words(line), line) for line in lines if _words(line) > MAX_WORDS]
    assert long == [], long


def test_the_verdict_line_of_a_step_timed_whole_and_of_many_flushes_stays_short():
    step = [TrialFlush(0, STEP, 41000.0, 52000.0, Verdict(39876.0, 12345.0, True))]
    many = [TrialFlush(n, "reduce_scatter+handoff", 300.0, 500.0, Verdict(900.0, 400.0, n % 2 == 1))
            for n in range(1, 9)]
    lines = [format_measured_line("[dc-schedule][r0]", "#12", step),
             format_measured_line("[dc-schedule][r0]", "#3", step[:1], source="the checkpoint /data/ckpt/global_step8/"
                                  "mp_rank_00_model_states.pt"),
             format_measured_line("[dc-schedule][r0]", "#2", many[:4])]
    assert lines[0] == ("[dc-schedule][r0] graph #12: measured the step's reduction (flushes overlapped): 39.876 ms vs "
                        "native 12.345 ms; overruled by measurement: native's calls for every flush")
    assert lines[2].endswith("overruled by measurement: flushes 1, 3 (reduce_scatter+handoff); native faster within "
                             "the noise: flushes 2, 4 (reduce_scatter+handoff)"), lines[2]
    many_more = format_measured_line("[dc-schedule][r0]", "#2", many + [
        TrialFlush(n, "reduce", 100.0, 90.0, Verdict(50.0, 10.0, True)) for n in range(9, 60)])
    assert many_more.endswith("overruled by measurement: flushes 1, 3, 5, 7 (reduce_scatter+handoff), flushes 9-59 "
                              "(reduce); native faster within the noise: flushes 2, 4, 6, 8 (reduce_scatter+handoff)")
    long = [(_words(line), line) for line in lines if _words(line) > MAX_WORDS]
    assert long == [], long
    # At scale the flush lists are folded and capped (``wording.rank_ranges``): a graph of 500 flushes, every other one
    # overruled, says as much as one of 59.
    alternating = [TrialFlush(n, "reduce", 100.0, 90.0, Verdict(50.0, 10.0 if n % 2 else 45.0, n % 2 == 1))
                   for n in range(1, 501)]
    at_scale = format_measured_line("[dc-schedule][r0]", "#2", alternating)
    assert "overruled by measurement: flushes 1, 3, 5, 7 and 246 more (reduce)" in at_scale, at_scale
    assert max(_words(many_more), _words(at_scale)) <= 36, (many_more, at_scale)
