"""Reproducible with the measured guard on (issue 31): on three gloo ranks, different data per rank, bf16, ZeRO stage 1,
real DeepSpeed and DeepCompile, the guard's samples the streams' real clock.

At three ranks different algorithms add the ranks' terms in different orders, so a verdict that changes changes the
last bits. What must hold: two runs replaying one verdict file (``compile.reduce_to_owner_verdicts``) give the same
bits, whatever the verdicts the first run measured. Negative control: a run replaying a file whose verdicts say
otherwise gives other bits, so the comparison can fail (the algorithms do differ here) and the file's verdicts are what
runs. A checkpoint
saved at any step (before, in and after the trial) and a run that saves against one that does not:
``test_checkpoint_trial_e2e.py`` (issue 40), on fixed samples.

Each run is one launch of fresh processes (at most one owner engine per process); runs are made on first use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.launch import run_ranks
from harness.toy_training import TrainSpec, train_each
from owner_reduce.planning.measured import TRIAL_ROUNDS

VERDICTS_KEY = "reduce_to_owner_verdicts"
WS = 3
LEARNED = 1  # the first backward learns the schedule (arrival order)
DECIDED_AFTER = LEARNED + 2 * TRIAL_ROUNDS  # steps until the trial's verdict
STEPS = DECIDED_AFTER + 1  # the measuring run: its trial, then a step with the winners
REPLAY_STEPS = LEARNED + 3  # a replaying run: the schedule learned, then three steps on the file's verdicts

# Four flushes of many gradients: native's calls (one AllReduce per gradient) take several times the model's choice on
# gloo, so the verdict is no coin toss (``measured`` Note (beyond the noise)); where the two are within the noise a new
# trial may decide otherwise, which is what the checkpoint and the verdict file pin.
BUCKET = 20_000

_RUNS: dict[tuple[int, str], tuple] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reproducible")


def _spec(stage: int, workdir: Path, **changes) -> TrainSpec:
    base = dict(mode="owner", backend="eager", model="tiny_transformer", zero_stage=stage, steps=REPLAY_STEPS,
                same_data=False, bf16=True, reduce_probe=False, reduce_bucket_size=BUCKET)
    return TrainSpec(**{**base, **changes})


def _verdict_file(workdir: Path) -> str:
    return str(workdir / "verdicts-z1.json")


def _run(stage: int, name: str, workdir: Path) -> tuple:
    """Each named run's results by rank, launched once (runs that read another's files make that one first)."""
    key = (stage, name)
    if key not in _RUNS:
        verdicts = _verdict_file(workdir)
        if name == "saving":  # also writes the verdict file (it does not exist yet): recording changes nothing
            spec = _spec(stage, workdir, steps=STEPS, compile_keys=((VERDICTS_KEY, verdicts),) if stage == 1 else ())
        elif name in ("replaying", "replaying again"):
            _run(stage, "saving", workdir)
            spec = _spec(stage, workdir, compile_keys=((VERDICTS_KEY, verdicts),))
        else:
            assert name == "replaying flipped verdicts"
            _run(stage, "saving", workdir)
            flipped = Path(verdicts).with_name("flipped.json")
            book = json.loads(Path(verdicts).read_text())
            for schedule in book["schedules"]:
                for flush in schedule["flushes"]:
                    flush["native_wins"] = not flush["native_wins"]
            flipped.write_text(json.dumps(book))
            spec = _spec(stage, workdir, compile_keys=((VERDICTS_KEY, str(flipped)),))
        by_rank = run_ranks(train_each, WS, args=((spec,),), timeout=240)
        _RUNS[key] = tuple(r[0] for r in by_rank)
    return _RUNS[key]


def _assert_ran(results: tuple, decided: int, replayed: int) -> None:
    for rank, r in enumerate(results):
        s = r["stats"]
        assert s.scheduled_flushes > 0 and s.owner_elems > 0, (rank, s)
        assert (s.trials_decided, s.trials_replayed) == (decided, replayed), (rank, s)


def _assert_same_bits(a: tuple, b: tuple, first_step: int = 0) -> None:
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["losses"][first_step:] == y["losses"], f"rank {rank}: losses differ"
        for name, p in y["params"].items():
            assert torch.equal(x["params"][name], p), \
                f"rank {rank}: {name} differs by up to {(x['params'][name] - p).abs().max().item():.3e}"


@pytest.mark.timeout(600)
def test_two_runs_replaying_one_verdict_file_are_bitwise_equal_and_the_files_verdicts_are_what_runs(workdir):
    saving = _run(1, "saving", workdir)
    assert f"verdicts written to {_verdict_file(workdir)}" in saving[0]["stats"].measured_lines[0]
    first, second = _run(1, "replaying", workdir), _run(1, "replaying again", workdir)
    for run in (first, second):
        _assert_ran(run, decided=0, replayed=1)
        assert all(r["stats"].trial_steps == 0 for r in run)
        assert f"verdicts replayed from compile.{VERDICTS_KEY}={_verdict_file(workdir)}" in \
            run[0]["stats"].measured_lines[0]
    _assert_same_bits(first, second)
    # Negative control: the flipped verdicts run other algorithms, and that shows in the bits.
    flipped = _run(1, "replaying flipped verdicts", workdir)
    _assert_ran(flipped, decided=0, replayed=1)
    differ = any(not torch.equal(f["params"][n], p) for f, r in zip(flipped, first, strict=True)
                 for n, p in r["params"].items())
    assert differ, "other verdicts gave the same bits: the comparisons above could not fail"
