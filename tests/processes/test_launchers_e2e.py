"""``python -m owner_reduce.run`` under the launchers users have, on 2 gloo ranks, with training scripts that never
import owner_reduce (``launched_train.py``, ``launched_trainer.py``): ``accelerate launch`` with a DeepSpeed config
file (ZeRO-1 with gradient accumulation 1 and 2, ZeRO-2 with 1, one launch) and ``torchrun`` with the transformers
Trainer (ZeRO-2, gradient accumulation 2). DeepSpeed's own launcher (``--module``, which puts ``--local_rank=N`` before
the script): ``test_settings_e2e.py``, whose launch goes through it and checks what each rank's script gets.

The reference ("flags off") is plain DeepSpeed ZeRO of the same stage on the same model and data, in the same process
group right after the owner run: DeepCompile's native runtime is the other flags-off run, but it needs its C++/CUDA
extension (a GPU); owner_reduce's AllReduce path (``reduce_probe`` only) would compare the runtime with itself. Every
rank trains on its own random tokens; at ws 2 a reduction is one sum of two terms, the same in either order, so the
owner path (a Reduce or ReduceScatter to the keeper) and ZeRO's own reduction agree bitwise, and any gradient that
is dropped, sent to the wrong rank or not pre-divided changes the parameters (the comparison's own negative control is
``test_the_comparison_fails_on_one_ulp_or_a_runtime_that_did_not_run``). That the runtime really ran is read from
DeepCompile's handle (``deepspeed.compile.util.dc_handle``, owner_reduce's runtime and its counters) and from the
init and probe lines on stdout (logged at INFO through DeepSpeed's logger: the config sets ``log_level``; every
rank's probe lines: ``reduce_probe_all_ranks``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from harness.launch import free_port
from tests.support.launched import launch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHED = ROOT / "tests" / "support" / "launched"  # the scripts the launchers start
RUNTIME = "owner_reduce.runtime.handle.OwnerReduceRuntime"
N_PARAMS = 21  # the tiny Llama: embeddings, 2 x (4 attention + 3 MLP + 2 norm weights), final norm, lm_head
STEPS = 3
LAUNCH_TIMEOUT_S = 360
# After DeepSpeed's logger prefix ("[time] [INFO] [file:line:function] "): the line itself, unchanged
INIT_RE = re.compile(r"\] DeepCompile reduce_to_owner: 20/21 gradients reduce to one rank; 1 straddling gradient "
                     r"reduces in slices to its owners \(100\.0% of elements on the owner path\)$", re.M)
OWNER_PROBE_RE = re.compile(r"\] \[dc-probe\]\[r(\d)\] flushReduceBucket #\d+ dtype=Float tasks=21 .* owner_tasks=21 "
                            r"owner_elems=[1-9]\d* \(100\.0%\)", re.M)
COMPILE = {"deepcompile": True, "reduce_to_owner": True, "reduce_probe": True, "reduce_probe_all_ranks": True}
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
             "compile": COMPILE, "steps_per_print": 1_000_000, "log_level": "info"}


def _launch(cmd: list[str], out: Path) -> tuple[str, list[dict]]:
    """Run a launcher (``launched.launch``: bounded, killed whole); its output and each rank's results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return launch(cmd, cwd=ROOT, env=env, timeout_s=LAUNCH_TIMEOUT_S, results=[out / f"rank{r}.pt" for r in range(2)])


def _write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj) if path.suffix == ".json" else str(obj))
    return path


def assert_owner_run_equals_plain(dc: dict, plain: dict, rank: int, steps: int, grad_accum: int, stage: int) -> None:
    """One rank: the owner runtime ran (its counters), took the owner path, and trained bitwise as plain ZeRO."""
    assert dc["handle"] == RUNTIME, f"rank {rank}: DeepCompile's handle was {dc['handle']}, not owner_reduce's runtime"
    assert plain["handle"] is None, f"rank {rank}: the reference ran DeepCompile ({plain['handle']})"
    s, micro = dc["stats"], steps * grad_accum
    assert s["reduce_grad_calls"] == micro * N_PARAMS and s["end_backward_calls"] == micro, (rank, s)
    assert s["flushes"] >= (micro if stage == 2 else steps), (rank, s)  # stage 1 accumulates locally
    assert s["owner_elems"] > 0 and s["reduce_calls"] + s["reduce_scatter_calls"] > 0, (rank, s)
    assert len(dc["losses"]) == len(plain["losses"]) > 0
    assert dc["losses"] == plain["losses"], f"rank {rank}: losses differ: {dc['losses']} vs {plain['losses']}"
    differ = [n for n in plain["params"] if not torch.equal(dc["params"][n], plain["params"][n])]
    assert not differ, f"rank {rank}: parameters differ from plain ZeRO-{stage}: {differ[:3]}"


def _assert_lines(log: str, engines: int) -> None:
    assert len(INIT_RE.findall(log)) == engines, "rank 0 prints the init line once per owner engine"
    assert {m.group(1) for m in OWNER_PROBE_RE.finditer(log)} == {"0", "1"}, "both ranks probe owner-path flushes"


def test_the_comparison_fails_on_one_ulp_or_a_runtime_that_did_not_run():
    stats = {"reduce_grad_calls": STEPS * N_PARAMS, "end_backward_calls": STEPS, "flushes": STEPS, "owner_elems": 9,
             "reduce_calls": 0, "reduce_scatter_calls": STEPS}
    plain = {"handle": None, "losses": [1.0, 0.5], "params": {"w": torch.ones(4), "b": torch.zeros(2)}}
    dc = {**copy.deepcopy(plain), "handle": RUNTIME, "stats": stats}
    assert_owner_run_equals_plain(dc, plain, 0, STEPS, 1, 1)
    one_ulp = copy.deepcopy(dc)
    one_ulp["params"]["w"][2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(AssertionError, match=r"parameters differ .*\['w'\]"):
        assert_owner_run_equals_plain(one_ulp, plain, 0, STEPS, 1, 1)
    with pytest.raises(AssertionError, match="not owner_reduce's runtime"):
        assert_owner_run_equals_plain({**dc, "handle": None}, plain, 0, STEPS, 1, 1)
    with pytest.raises(AssertionError):
        assert_owner_run_equals_plain({**dc, "stats": {**stats, "owner_elems": 0}}, plain, 0, STEPS, 1, 1)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_accelerate_launch_with_a_deepspeed_config_file_zero_1_2_gradient_accumulation_1_2(tmp_path):
    """``accelerate launch --config_file acc.yaml -m owner_reduce.run --accelerate-backend gloo launched_train.py``:
    the config file accelerate names carries the two keys (and ``train_batch_size: auto``, which accelerate fills
    from its own process count: wrong without the backend on CPU). Three variants, one launch."""
    ds = _write(tmp_path / "ds_config.json", {**DS_CONFIG, "train_batch_size": "auto"})
    acc = _write(tmp_path / "accelerate.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                 f"deepspeed_config:\n  deepspeed_config_file: {ds}\nnum_machines: 1\nnum_processes: 2\n"
                 "machine_rank: 0\nmain_training_function: main\nuse_cpu: false\n")
    out = tmp_path / "out"
    variants = [(1, 1), (1, 2), (2, 1)]  # ZeRO-2 with GA 2: the Trainer test below
    log, results = _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc),
                            "--main_process_port", str(free_port()), "-m", "owner_reduce.run",
                            "--accelerate-backend", "gloo", str(LAUNCHED / "launched_train.py"), "--api", "accelerate",
                            "--variants", ",".join(f"{s}:{g}" for s, g in variants), "--steps", str(STEPS),
                            "--out", str(out)], out)
    for rank, r in enumerate(results):
        assert r["world_size"] == 2
        for stage, ga in variants:
            dc, plain = r["runs"][f"{stage}:{ga}:dc"], r["runs"][f"{stage}:{ga}:plain"]
            assert dc["accelerate_processes"] == plain["accelerate_processes"] == 2, "accelerate counts the world"
            assert_owner_run_equals_plain(dc, plain, rank, STEPS, ga, stage)
    assert results[0]["runs"]["1:1:dc"]["losses"] != results[1]["runs"]["1:1:dc"]["losses"], "same data on both ranks"
    _assert_lines(log, engines=len(variants))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_torchrun_with_the_transformers_trainer(tmp_path):
    """``torchrun -m owner_reduce.run --accelerate-backend gloo launched_trainer.py --deepspeed ds.json
    --torch_compile_backend eager --accelerator_config '{"use_configured_state": true}'``: the Trainer's torch-compile
    option makes accelerate call ``engine.compile()``, which runs DeepCompile with owner_reduce's runtime. On CPU the
    Trainer passes no backend to accelerate with DeepSpeed, so it keeps the state the launcher made (see the guide)."""
    out, stage, grad_accum = tmp_path / "out", 2, 2
    ds = _write(tmp_path / "ds_config.json", {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "compile": COMPILE, "log_level": "info"})
    log, results = _launch([
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "owner_reduce.run", "--accelerate-backend", "gloo", str(LAUNCHED / "launched_trainer.py"),
        "--deepspeed", str(ds), "--torch_compile_backend", "eager",
        "--accelerator_config", '{"use_configured_state": true}', "--output_dir", str(tmp_path / "trainer"),
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(grad_accum),
        "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none",
        "--save_strategy", "no", "--out", str(out)], out)
    for rank, r in enumerate(results):
        assert r["world_size"] == r["trainer_world_size"] == 2, "the Trainer counts the world"
        dc, plain = r["runs"]["dc"], r["runs"]["plain"]
        assert dc["compiled"] and not plain["compiled"]
        assert_owner_run_equals_plain(dc, plain, rank, STEPS, grad_accum, stage)
    _assert_lines(log, engines=1)
