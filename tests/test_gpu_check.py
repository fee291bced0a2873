"""scripts/gpu_check.sh without a GPU: its syntax, its dry run (plan and NCCL-version decision), and the pure
pieces it relies on (the ws=2 decision, the timing labels of nccl_check, gpu_e2e's bitwise requirement)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full.update(OWNER_REDUCE_PY=sys.executable, OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=180, env=full,
                          cwd=tmp_path)


def test_bash_syntax():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_unknown_argument_is_refused():
    done = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("version", "runs"), [("2.28.9", False), ("2.30.0", True)])
def test_dry_run_prints_the_nccl_version_first_then_the_decision_and_the_plan(tmp_path, version, runs):
    done = _dry_run(tmp_path, GPU_CHECK_NCCL_VERSION=version)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"NCCL: {version} through cupy (GPU_CHECK_NCCL_VERSION); torch "), lines[0]
    gpus = torch.cuda.device_count()
    assert f"GPUs: {gpus or 1} (GPU_CHECK_GPUS; torch sees {gpus})" in lines  # no GPU: planned for one
    decision = next(line for line in lines if line.startswith("nccl_check ws=2: "))
    if runs:
        assert "will run: one GPU shared by two ranks: NCCL 2.30.0 >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE" in decision
        assert any("nccl_ws2    timeout" in line and "NCCL_MULTI_RANK_GPU_ENABLE=1" in line for line in lines)
    else:
        assert decision == ("nccl_check ws=2: will be SKIPPED: one GPU and NCCL 2.28.9 < 2.30: two ranks cannot share "
                            "a GPU (NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)")
        assert "  nccl_ws2    SKIPPED (see 'nccl_check ws=2' above)" in lines
    order = [next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
             for name in ("nccl_ws1", "nccl_ws2", "pytest_cuda", "e2e_ws1", "native", "summary")]
    assert order == sorted(order), "cheap steps first, native DeepCompile last"
    text = done.stdout
    assert "correctness only; its timing is no communication measurement" in text
    assert "--require-bitwise (host us per reduce_grad, peak GPU memory)" in text
    assert "optional, last" in text
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_dry_run_with_the_real_libnccl(tmp_path):
    """No override: the NCCL that cupy loads here (libnccl loads without a GPU) decides."""
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    nccl = _load("gpu_plan")
    from owner_reduce.runtime.nccl_comm import nccl_runtime_version

    version = nccl_runtime_version()
    assert done.stdout.splitlines()[0].startswith(f"NCCL: {nccl.fmt(version)} through cupy; torch ")
    expected = "will run" if version >= (2, 30, 0) else "will be SKIPPED"
    assert f"nccl_check ws=2: {expected}" in done.stdout


def test_ws2_decision():
    decide = _load("gpu_plan").decide_ws2
    assert decide(None, 1) == (False, "cupy's NCCL cannot be loaded, so no NCCL check runs at all")
    assert decide((2, 32, 3), 0) == (False, "no GPU is visible")
    assert decide((2, 28, 9), 1)[0] is False
    assert decide((2, 29, 99), 1)[0] is False
    assert decide((2, 30, 0), 1)[0] is True
    assert decide((2, 28, 9), 2) == (True, "2 GPUs: one rank per GPU (NCCL 2.28.9)")


def test_parse_version():
    parse = _load("gpu_plan").parse_version
    assert parse("2.28.9") == (2, 28, 9) and parse("2.30") == (2, 30, 0)
    with pytest.raises(ValueError, match="2.28.9"):
        parse("2.28.9.1")


def test_nccl_check_labels_timings_that_measure_no_communication():
    label = _load("nccl_check").timing_label
    assert "no communication measurement" in label(1, 1) and "correctness only" in label(1, 8)
    assert label(2, 1) == "ranks share a GPU: not an interconnect measurement"
    assert label(2, 2) is None


def test_gpu_e2e_require_bitwise_refuses_a_last_bit_difference():
    compare = _load("gpu_e2e").compare
    a = {"params": {"w": torch.ones(3)}, "losses": [1.0, 0.5]}
    b = {"params": {"w": torch.ones(3) + 1e-7}, "losses": [1.0, 0.5]}
    assert compare("owner vs plain", a, b, atol=1e-4)["ok"] is True
    row = compare("owner vs plain", a, b, atol=1e-4, require_bitwise=True)
    assert row["ok"] is False and row["bitwise"] is False
    assert compare("owner vs plain", a, a, atol=1e-4, require_bitwise=True)["ok"] is True
