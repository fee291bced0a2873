"""Issue 38 end to end: every setting from a DeepSpeed config file, through DeepSpeed's own launcher, with no
``OWNER_REDUCE_*`` variable in any rank's environment; and the probe's lines at ws 8 from rank 0 only. The launch is
also the suite's test of DeepSpeed's launcher in module mode (``--module owner_reduce.run``): the command line and
``LOCAL_RANK`` each rank's script gets, and the keys accepted in that process before any run.

One launch of ``deepspeed --num_gpus 4 --module owner_reduce.run launched_settings.py`` (gloo, CPU) runs, in one
process group, four runs of one exact model (every sum exact: any order of addition gives the same bits, a lost or
doubled share does not), each owner run's config a JSON file naming its settings:

- ``auto``: the owner path, the probe (rank 0's lines), ``algo: auto`` with a calibration (its digest in the settings
  line; its AllReduce dear, so the model picks the owner path and the measured guard tries it against native's calls)
  and a verdicts file that does not exist yet (written after the trial);
- ``forced``: ``algo: handoff`` (the hand-off in every rank's collective log, no trial), every rank's probe lines and
  the flushes' deadline from the config;
- ``replay``: ``auto``'s config again at DeepSpeed's default log level: the verdicts file now exists and is replayed
  (no trial), and the probe says once that the level hides its lines;
- ``plain``: plain ZeRO-1 on the same data, the reference for every owner run's parameters, bitwise.

Each setting is read back from what it changes (collective logs, trial counters, the settings line, the file, the
lines on the launcher's stdout), and each run differs from another in that respect, so a setting that did not take
effect fails its assertion. The deadline is DeepSpeed's own, the script's ``init_distributed(timeout=900 s)``, except in
``forced``, whose ``compile.reduce_to_owner_timeout_s`` is 300 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import owner_reduce
from harness.launch import free_port, run_ranks
from harness.toy_training import TrainSpec, ds_config, train_each
from owner_reduce.planning.measured import TRIAL_ROUNDS
from owner_reduce.planning.verdict_book import load_verdicts
from tests.processes.test_calibration import _cal
from tests.support.launched import launch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHED = ROOT / "tests" / "support" / "launched"  # the scripts the launchers start
WS = 4
STEPS = 2 + 2 * TRIAL_ROUNDS  # the schedule learned at step 1, the trial's steps, one step with the winners
LAUNCH_TIMEOUT_S = 420
PROBE_RE = re.compile(r"\[dc-probe\]\[r(\d+)\] flushReduceBucket #\d+ ")
HIDDEN = ("owner_reduce: compile.reduce_probe's lines are logged at INFO, which DeepSpeed's log level (WARNING) hides: "
          'add "log_level": "info" to the DeepSpeed config to see them')
BASE = TrainSpec(mode="owner", backend="eager", model="exact_linear", steps=STEPS, same_data=False,
                 record_collectives=True, destroy=True, probe_all_ranks=False)


def _launch(cmd: list[str], env: dict[str, str], out: Path) -> tuple[str, list[dict]]:
    return launch(cmd, cwd=ROOT, env=env, timeout_s=LAUNCH_TIMEOUT_S, results=[out / f"rank{r}.pt" for r in range(WS)])


def _config_file(path: Path, spec: TrainSpec, log_level: str, **keys: object) -> dict:
    """``spec``'s DeepSpeed config with ``keys`` under ``compile`` and ``log_level``, written to ``path``: the fields
    of a run that DeepSpeed reads from that file."""
    config = ds_config(spec)
    config["compile"].update(keys)
    config["log_level"] = log_level
    path.write_text(json.dumps(config, indent=1))
    return dataclasses.asdict(dataclasses.replace(spec, config_file=str(path)))


def _assert_bitwise(run: list[dict], plain: list[dict], name: str) -> None:
    for rank, (o, p) in enumerate(zip(run, plain, strict=True)):
        assert o["losses"] == p["losses"], f"{name}, rank {rank}: losses differ from plain ZeRO"
        differ = [n for n in p["params"] if not torch.equal(o["params"][n], p["params"][n])]
        assert not differ, f"{name}, rank {rank}: parameters differ from plain ZeRO-1: {differ}"


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_every_setting_from_a_config_file_through_deepspeeds_launcher_without_owner_reduce_variables(tmp_path):
    calibration = _cal(world_size=WS, allreduce=1000.0, reduce=10.0, reduce_scatter=10.0)
    cal_path = tmp_path / "calibration.json"
    cal_path.write_text(calibration.to_json())
    verdicts = tmp_path / "verdicts.json"
    every = dict(reduce_to_owner=True, reduce_probe=True, reduce_probe_all_ranks=False, reduce_to_owner_algo="auto",
                 reduce_to_owner_calibration=str(cal_path), reduce_to_owner_verdicts=str(verdicts))
    runs = [
        ("auto", _config_file(tmp_path / "auto.json", BASE, "info", **every)),
        # forced: buckets of 300 elements, so that a flush holds owner regions of unequal lengths and the hand-off
        # really moves pieces (a flush of the whole model is cut at the partitions, where the aligned chunks of the
        # hand-off's ReduceScatter fall: nothing to hand off)
        ("forced", _config_file(tmp_path / "forced.json", dataclasses.replace(BASE, reduce_bucket_size=300), "info", **{
            **every, "reduce_to_owner_algo": "handoff", "reduce_probe_all_ranks": True,
            "reduce_to_owner_verdicts": None, "reduce_to_owner_timeout_s": 300})),
        ("replay", _config_file(tmp_path / "replay.json", BASE, "warning", **every)),
        ("plain", dataclasses.asdict(dataclasses.replace(BASE, mode="plain", destroy=False))),
    ]
    assert json.loads((tmp_path / "auto.json").read_text())["compile"] == {"deepcompile": True, **every}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNER_REDUCE_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    out = tmp_path / "out"
    log, results = _launch([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(WS), "--master_port",
                            str(free_port()), "--module", "owner_reduce.run", str(LAUNCHED / "launched_settings.py"),
                            "--runs", json.dumps(runs), "--out", str(out)], env, out)
    assert all(r["world_size"] == WS and r["owner_reduce_env"] == [] for r in results), "the environment was scrubbed"
    # DeepSpeed's launcher runs ``python -u -m owner_reduce.run --local_rank=N launched_settings.py ...``: the script
    # gets ``--local_rank=N`` right after its name, as if the launcher had started it, and DeepSpeed's config parsing
    # there takes the owner runs' keys before any run (install() ran in that process: owner_reduce.run).
    for rank, r in enumerate(results):
        assert r["argv"][:2] == [str(LAUNCHED / "launched_settings.py"), f"--local_rank={rank}"], r["argv"]
        assert r["local_rank_arg"] == rank and r["env_local_rank"] == str(rank), r
        assert r["keys_accepted"] == [True, True, True], f"rank {rank}: DeepSpeed rejected the keys: no install()"
    by_run = {name: [r["runs"][name] for r in results] for name, _ in runs}
    for name in ("auto", "forced", "replay"):
        _assert_bitwise(by_run[name], by_run["plain"], name)
        assert all(r["stats"].owner_elems > 0 and r["stats"].scheduled_flushes > 0 for r in by_run[name]), name

    auto, forced, replay = by_run["auto"], by_run["forced"], by_run["replay"]
    book = load_verdicts(verdicts)  # written by run auto's rank 0 after its trial
    timeout = "timeout 900 s (init_distributed)"  # DeepSpeed's own, from the script's init_distributed

    def runs_on(bucket: int = 500_000_000) -> str:  # DeepSpeed's launcher sets LOCAL_SIZE (4 on one host)
        return (f"; torch.distributed gloo, 4 ranks = 1 node x 4 (host names = LOCAL_SIZE), bucket {bucket} elements, "
                f"owner_reduce {owner_reduce.__version__}")

    assert auto[0]["stats"].settings_line == (f"owner_reduce: settings: algo=auto, calibration {calibration.digest()}, "
                                              f"verdicts write {verdicts}, probe rank 0, {timeout}{runs_on()}")
    assert forced[0]["stats"].settings_line == (f"owner_reduce: settings: algo=handoff, calibration "
                                                f"{calibration.digest()}, verdicts none, probe all ranks, timeout "
                                                f"300 s (compile.reduce_to_owner_timeout_s){runs_on(300)}")
    assert replay[0]["stats"].settings_line == (f"owner_reduce: settings: algo=auto, calibration "
                                                f"{calibration.digest()}, verdicts replay {book.digest()} (1 "
                                                f"schedule), probe rank 0, {timeout}{runs_on()}")
    assert all(r[0]["stats"].settings_line in log for r in (auto, forced)), "rank 0 logged them at INFO"
    assert all(r["stats"].settings_line is None for run in (auto, forced, replay) for r in run[1:]), "rank 0 only"

    # algo auto + calibration: the model's choice (the ReduceScatter the calibration makes cheap), tried by the guard;
    # the verdicts file written there, then replayed with no trial; algo handoff: the hand-off, no trial.
    for rank in range(WS):
        a, f, r = auto[rank]["stats"], forced[rank]["stats"], replay[rank]["stats"]
        assert (a.trials_decided, a.trial_steps, a.trials_replayed) == (1, 2 * TRIAL_ROUNDS, 0), a
        assert (r.trials_decided, r.trial_steps, r.trials_replayed) == (0, 0, 1), r
        assert (f.trials_decided, f.trial_steps) == (0, 0) and f.handoff_rounds > 0, f
        names = {name for name, *_ in forced[rank]["collective_log"]}
        assert "handoff" in names, names
        auto_names = {name for name, *_ in auto[rank]["collective_log"]}
        assert "handoff" not in auto_names and auto_names & {"reduce", "reduce_scatter"}, auto_names
    assert book.world_size == WS and len(book.schedules) == 1
    assert f"verdicts written to {verdicts}" in auto[0]["stats"].measured_lines[0]
    assert replay[0]["stats"].measured_lines[0].startswith(
        f"[dc-schedule][r0] graph #1: verdicts replayed from compile.reduce_to_owner_verdicts={verdicts}")

    # Probe lines on the launcher's stdout: rank 0's (auto), every rank's (forced), none at WARNING (replay).
    assert [len(r["stats"].probe_lines) > 0 for r in auto] == [True, False, False, False]
    assert all(len(r["stats"].probe_lines) > 0 for r in forced)
    printed = [int(m.group(1)) for m in PROBE_RE.finditer(log)]
    for rank in range(WS):
        shown = len(forced[rank]["stats"].probe_lines) + len(auto[rank]["stats"].probe_lines)
        assert printed.count(rank) == shown, (rank, printed.count(rank), shown)
    assert log.count(HIDDEN) == 1, "the replay run's probe, hidden by the log level, is said once"


@pytest.mark.timeout(300)
def test_at_ws_8_only_rank_0_prints_probe_lines_by_default():
    """Eight gloo ranks, one step, the probe on and nothing else asked: rank 0 logs its probe lines (and the init and
    settings lines), no other rank logs any, and training is plain ZeRO's bitwise. What each rank's DeepSpeed logger
    let through at INFO is what its terminal would show."""
    owner = dataclasses.replace(BASE, steps=1, log_level="info", capture_log=True, record_collectives=False)
    plain = dataclasses.replace(owner, mode="plain", destroy=False, capture_log=False)
    by_rank = run_ranks(train_each, 8, args=((owner, plain),), timeout=240)
    runs, reference = [r[0] for r in by_rank], [r[1] for r in by_rank]
    _assert_bitwise(runs, reference, "ws 8")
    probe = [[line for line in r["log"] if PROBE_RE.match(line)] for r in runs]
    assert len(probe[0]) >= 1 and probe[0] == runs[0]["stats"].probe_lines, probe[0]
    assert all(lines == [] and r["stats"].probe_lines == [] for lines, r in zip(probe[1:], runs[1:], strict=True))
    assert sum(r["stats"].flushes for r in runs) >= 8, "every rank flushed: the probe had something to say"
    assert runs[0]["stats"].init_line in runs[0]["log"] and runs[0]["stats"].settings_line in runs[0]["log"]
    assert re.search(r", probe rank 0, timeout \d+ s \(init_distributed\); torch.distributed gloo, 8 ranks = 1 node "
                     r"x 8 \(host names = LOCAL_WORLD_SIZE\), ", runs[0]["stats"].settings_line)
    rank_0_lines = ("owner_reduce: settings:", "DeepCompile reduce_to_owner:")
    assert all(not any(line.startswith(rank_0_lines) for line in r["log"]) for r in runs[1:])
