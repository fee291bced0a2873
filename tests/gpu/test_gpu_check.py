"""scripts/gpu_check.sh without a GPU: its syntax, its dry run (what it carries, the NCCL it installs, the version
decision, the ws 2 / ws 4 plan), and the pure pieces it relies on (the ws >= 2 decision, the mapped-library
reader, the timing labels of nccl_check, gpu_e2e's bitwise requirement, its phases and its bound)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full.update(OWNER_REDUCE_PY=sys.executable, OUT=str(tmp_path / "out"), GPU_CHECK_WHL_DIR=str(tmp_path / "whl"),
                **env)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=180,
                          env=full, cwd=tmp_path)


def _carried(whl: Path, xz_bytes: int = 43_600_000) -> None:
    """What --fetch-wheels leaves: wheels, and nccl/ with the stripped library (sparse here) and its manifest."""
    (whl / "nccl").mkdir(parents=True)
    (whl / "deepspeed-0.19.8-py3-none-any.whl").write_bytes(b"w" * 2_200_000)
    with open(whl / "nccl" / "libnccl.so.2.xz", "wb") as f:
        f.truncate(xz_bytes)
    (whl / "nccl" / "manifest.json").write_text(json.dumps({
        "library": "libnccl.so.2", "package": "nvidia-nccl-cu13", "nccl_version": "2.32.3", "arch": 90,
        "wheel": "nvidia_nccl_cu13-2.32.3-py3-none-manylinux_2_27_x86_64.whl",
        "bytes": {"wheel": 305_100_000, "original": 343_864_936, "kept_device_code": 33_100_000, "xz": xz_bytes},
        "sha256": {"original": "a" * 64, "stripped": "b" * 64}}))


def test_bash_syntax():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("args", [["--frobnicate"], ["--fetch-wheels", "--arch"]])
def test_unknown_argument_is_refused(args):
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_an_arch_with_a_dot_is_refused_naming_the_value():
    done = subprocess.run(["bash", str(SCRIPT), "--fetch-wheels", "--arch", "9.0"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2
    assert "--arch must be a compute capability without the dot (90 for sm_90), got '9.0'" in done.stderr


def test_a_cuda_major_without_an_extra_is_refused_naming_the_value():
    env = {**os.environ, "GPU_CHECK_CUDA_MAJOR": "11"}
    done = subprocess.run(["bash", str(SCRIPT), "--fetch-wheels"], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    assert "GPU_CHECK_CUDA_MAJOR must be 12 or 13 (owner_reduce's extras cu12, cu13), got '11'" in done.stderr


PLAN_WS2 = ("nccl_ws2", "nccl_ws4", "e2e_ws2", "pytest_cuda", "bf16_ws4", "e2e_ws4", "two_level_ws4", "e2e_ws1")


@pytest.mark.timeout(240)
def test_dry_run_shows_the_carry_the_nccl_install_the_versions_and_the_ws2_ws4_plan(tmp_path):
    _carried(tmp_path / "whl")
    done = _dry_run(tmp_path, GPU_CHECK_GPU_ARCH="90")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    text = done.stdout
    assert lines[0].startswith("gpu_check --dry-run: nothing is installed, written or run here. Budget on the GPU "
                               "machine: 420s.")
    assert "      43.6 MB  nccl/libnccl.so.2.xz" in lines
    assert "       2.2 MB  deepspeed-0.19.8-py3-none-any.whl" in lines
    assert "  total 45.8 MB = 43.7 MiB of 64 MiB: fits" in lines
    install = lines.index("NCCL install (first, before anything loads NCCL):")
    assert lines[install + 1] == ("  nccl_install: carried NCCL 2.32.3, sm_90 only: " + str(tmp_path / "whl") +
                                  "/nccl/libnccl.so.2.xz 43.6 MB -> 343.9 MB")
    versions = next(i for i, line in enumerate(lines) if line.startswith("NCCL: "))
    assert install < versions
    assert lines[versions].startswith("NCCL: 2.32.3 through cupy (GPU_CHECK_NCCL_VERSION); torch ")
    assert "  (the versions below are the carried NCCL's: what torch and cupy load once it is installed)" in lines
    assert next(line for line in lines if line.startswith("ws>=2 on one GPU: ")).startswith(
        "ws>=2 on one GPU: will run: one GPU shared by 2 or 4 ranks: NCCL 2.32.3 >= 2.30")
    order = [next(i for i, line in enumerate(lines) if line.startswith(f"  {name} ")) for name in PLAN_WS2]
    assert order == sorted(order) and versions < order[0]
    step = {name: lines[i] for name, i in zip(PLAN_WS2, order, strict=True)}
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1 scripts/nccl_check.py --world-size 4" in step["nccl_ws4"]
    assert "--world-size 2" in step["e2e_ws2"] and "--modes plain,owner,handoff,native" in step["e2e_ws2"]
    assert "--require-bitwise" in step["e2e_ws2"] and "--require-bitwise" in step["e2e_ws4"]
    assert ("--world-size 4 --steps 4 --bf16 --dim 1024 --layers 8 --vocab 32000 --bucket 500000000 "
            "--modes owner,native") in step["bf16_ws4"]
    assert "-m pytest -q -m cuda" in step["pytest_cuda"] and ", optional:" in step["e2e_ws1"]
    assert ("--world-size 4 --ranks-per-node 2 --model exact_linear --steps 4 --require-bitwise --modes "
            "plain,two_level") in step["two_level_ws4"] and ", optional:" in step["two_level_ws4"]
    assert "required" in step["bf16_ws4"] and "TORCH_CUDA_ARCH_LIST from the GPU, e.g. 9.0" in text
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    # issue 37: the review's two mechanism checks and the product's stall in a deep model (scripts/nccl_mechanisms.py),
    # each with its own timeout, right after nccl_ws2 (so that the budget reaches them), on capped channels
    issue37 = ("nccl_ws2", "mech_launch_stall", "mech_abort_order", "stall_deep", "nccl_ws4")
    at = [next(i for i, line in enumerate(lines) if line.startswith(f"  {name} ")) for name in issue37]
    assert at == list(range(at[0], at[0] + len(issue37))), at  # one after another, in this order
    assert lines[at[1]] == ("  mech_launch_stall timeout 50s, optional: scripts/nccl_mechanisms.py launch-stall "
                            "--launches 5000 --timeout 40")
    assert lines[at[2]] == ("  mech_abort_order timeout 60s, optional: scripts/nccl_mechanisms.py abort-order "
                            "--alone-s 10 --join-s 20 --timeout 50")
    assert lines[at[3]] == ("  stall_deep  timeout 80s, required: scripts/nccl_mechanisms.py product-stall --layers "
                            "128 --bucket 16384 --deadline 8 --timeout 70")
    assert ("              (multi-rank steps on the shared GPU: NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_NCHANNELS=4, "
            "channels") in lines


@pytest.mark.timeout(240)
def test_dry_run_says_when_the_carry_does_not_fit(tmp_path):
    _carried(tmp_path / "whl", xz_bytes=66_000_000)
    done = _dry_run(tmp_path, GPU_CHECK_GPU_ARCH="90")
    assert done.returncode == 0, done.stderr
    assert "  total 68.2 MB = 65.0 MiB of 64 MiB: DOES NOT FIT" in done.stdout.splitlines()


@pytest.mark.timeout(240)
def test_dry_run_without_nccl_2_30_plans_ws1_and_says_ws2_ws4_are_skipped(tmp_path):
    done = _dry_run(tmp_path, GPU_CHECK_NCCL_VERSION="2.28.9")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "carry: " + str(tmp_path / "whl") + "/ does not exist: prepare it with 'bash scripts/gpu_check.sh " \
        "--fetch-wheels'" in lines
    assert any(line.startswith("  no NCCL carried (") for line in lines)
    assert lines[next(i for i, line in enumerate(lines) if line.startswith("NCCL: "))].startswith(
        "NCCL: 2.28.9 through cupy (GPU_CHECK_NCCL_VERSION); torch ")
    gpus = torch.cuda.device_count()
    assert f"GPUs: {gpus or 1} (GPU_CHECK_GPUS; torch sees {gpus})" in lines  # no GPU: planned for one
    assert ("ws>=2 on one GPU: will be SKIPPED: one GPU and NCCL 2.28.9 < 2.30: ranks cannot share a GPU "
            "(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)") in lines
    order = [next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
             for name in ("nccl_ws1", "pytest_cuda", "e2e_ws1", "ws 2, ws 4", "summary")]
    assert order == sorted(order)
    assert "the check then fails (issue 17 needs ws 2 and 4)" in lines[order[3]]
    assert not any(line.startswith(("  nccl_ws2", "  bf16_ws4")) for line in lines)
    assert "  mech_launch_stall, mech_abort_order, stall_deep  SKIPPED with them: two ranks are needed" in lines
    assert not any(line.startswith(("  mech_launch_stall ", "  mech_abort_order ", "  stall_deep ")) for line in lines)


def test_dry_run_with_the_real_libnccl(tmp_path):
    """No override, nothing carried: the NCCL that cupy loads here (libnccl loads without a GPU) decides."""
    pytest.importorskip("cupy.cuda.nccl")  # the base install (no cu12/cu13 extra) has no cupy
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    nccl = _load("gpu_plan")
    from owner_reduce.runtime.nccl_binding import nccl_runtime_version

    version = nccl_runtime_version()
    line = next(line for line in done.stdout.splitlines() if line.startswith("NCCL: "))
    assert line.startswith(f"NCCL: {nccl.fmt(version)} through cupy; torch ")
    mapped = next(line for line in done.stdout.splitlines() if line.startswith("NCCL mapped by this process"))
    assert "libnccl" in mapped
    expected = "will run" if version >= (2, 30, 0) and not torch.cuda.is_available() or \
        version >= (2, 30, 0) and tuple(torch.cuda.nccl.version()) >= (2, 30, 0) else "will be SKIPPED"
    assert f"ws>=2 on one GPU: {expected}" in done.stdout
    # whether this interpreter's cupy fits its torch's CUDA (what install() warns about), from package metadata
    from owner_reduce.wiring.cuda_extra import describe_environment

    assert describe_environment() in done.stdout.splitlines()
    assert describe_environment().startswith(f"CUDA extra: torch {torch.__version__} ")


def test_ws2_decision():
    decide = _load("gpu_plan").decide_ws2
    assert decide(None, 1) == (False, "cupy's NCCL cannot be loaded, so no NCCL check runs at all")
    assert decide((2, 32, 3), 0) == (False, "no GPU is visible")
    assert decide((2, 28, 9), 1)[0] is False
    assert decide((2, 29, 99), 1)[0] is False
    assert decide((2, 30, 0), 1)[0] is True
    assert decide((2, 28, 9), 2) == (True, "2 GPUs: one rank per GPU (NCCL 2.28.9)")
    # ranks sharing a GPU need it in torch's NCCL too (DeepSpeed's process group), not only in cupy's
    assert decide((2, 32, 3), 1, (2, 32, 3))[0] is True
    ok, why = decide((2, 32, 3), 1, (2, 28, 9))
    assert ok is False and why.startswith("one GPU and torch's NCCL 2.28.9 < 2.30 (cupy's 2.32.3)")
    assert decide((2, 28, 9), 1, (2, 32, 3))[0] is False


def test_mapped_nccl_reads_each_library_file_once():
    mapped = _load("gpu_plan").mapped_nccl
    maps = ("7f00-7f01 r--p 00000000 08:01 12 /site/nvidia/nccl/lib/libnccl.so.2\n"
            "7f01-7f02 r-xp 00001000 08:01 12 /site/nvidia/nccl/lib/libnccl.so.2\n"
            "7f03-7f04 r--p 00000000 08:01 13 /usr/lib/x86_64-linux-gnu/libnccl.so.2.28.9 (deleted)\n"
            "7f05-7f06 rw-p 00000000 00:00 0 \n"
            "7f07-7f08 r--p 00000000 08:01 14 /site/torch/lib/libtorch_cuda.so\n")
    assert mapped(maps) == ["/site/nvidia/nccl/lib/libnccl.so.2",
                            "/usr/lib/x86_64-linux-gnu/libnccl.so.2.28.9 (deleted: replaced after it was mapped)"]
    assert mapped("") == []


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


def test_gpu_e2e_phase_keys_and_slowest_rank():
    e2e = _load("gpu_e2e")
    assert e2e._short("step 1 forward (DeepCompile compiles and profiles the forward graph)") == "step_1_forward"
    assert e2e._short("engine.compile (DeepCompile init)") == "engine_compile"
    assert e2e._short("first flush: issuing its collectives") == "first_flush"
    rows = [{"phases": [{"phase": "a", "seconds": 1.0}, {"phase": "b", "seconds": 5.0}]},
            {"phases": [{"phase": "a", "seconds": 3.0}, {"phase": "b", "seconds": 2.0}]}]
    assert e2e.phase_seconds(rows) == {"a": 3.0, "b": 5.0}


@pytest.mark.timeout(120)
def test_gpu_e2e_past_its_bound_fails_naming_each_rank_phase(monkeypatch):
    """The bound of a mode: a job that cannot finish in 4 s fails with where each rank was, not a bare timeout."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    e2e = importlib.import_module("gpu_e2e")
    # 100,000 steps: with its imports preloaded, a 2-step job finishes in about 3.5 s on a 2-core box.
    job = e2e.Job(mode="owner", steps=100_000, micro_batch=2, dim=8, layers=1, vocab=16, seq=4, cpu=True)
    with pytest.raises(RuntimeError) as caught:
        e2e.launch(job, 2, timeout=4)
    message = str(caught.value)
    assert message.startswith("owner job overstayed its bound of 4 s: ranks [0, 1] of 2 did not finish within 4s")
    assert "; where each rank was: rank 0: " in message and "; rank 1: " in message



def test_nccl_check_dry_run_prints_the_plan_lines_the_run_prints(capsys):
    check = _load("nccl_check")
    assert check.main(["--dry-run", "--world-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "nccl_check: dry run, no GPU touched: ws=2; bucket 32 MiB; the plan each rank would run"
    for line, dtype in zip(lines[1:], ("float32", "bfloat16"), strict=True):
        assert line.startswith(f"  {dtype}: ") and " Reduce, " in line and "; received per rank " in line, line
        shares = [float(s.rstrip("%")) for s in line.split("received per rank ")[1].split(", ")]
        assert len(shares) == 2 and abs(sum(shares) - 100.0) < 0.2, line  # the owner path: each element to one rank


def _launched_rank(rank, world_size):
    """One rank of nccl_check under a launcher, with the GPU part (``rank_main``) and cupy's id stood in for: what
    the gloo bootstrap carries (rank 0's id out, every rank's result back to rank 0's report)."""
    import contextlib
    import io

    import owner_reduce.runtime.nccl_binding as nccl_binding

    check = _load("nccl_check")
    nccl_binding.new_unique_id = lambda: b"id-of-rank-%d" % rank
    row = {"dtype": "float32", "elems": 4, "params": 1, "ranges": 1, "reduce_ranges": 1, "allreduce_ranges": 0,
           "owner_share": 1.0, "rtol": 0.0, "atol": 0.0, "bitwise_equal": True, "within_tolerance": True,
           "max_abs_err": 0.0, "received_elems": 2, "allreduce_ms": 1.0 + rank, "owner_ms": 0.5}
    seen = []

    def rank_main(r, ws, unique_id, args, local_rank):
        seen.append(unique_id)
        return {"device": local_rank, "rows": [row], "gathered": [[q, 1] for q in range(ws)]}

    check.rank_main = rank_main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = check.launched(check.argparse.Namespace(timeout=60.0, json=None), {"gpus": world_size})
    return code, out.getvalue(), seen


@pytest.mark.timeout(120)
def test_nccl_check_under_a_launcher_hands_rank_0s_id_out_and_reports_every_rank():
    from harness.launch import run_ranks

    (code0, out0, seen0), (code1, out1, seen1) = run_ranks(_launched_rank, 2, timeout=90,
                                                           dist_backend=None)
    assert seen0 == seen1 == [b"id-of-rank-0"], (seen0, seen1)
    assert code0 == code1 == 0 and out1 == "", out1
    assert "received per rank 50.0%, 50.0%" in out0 and "AllReduce 2.000 ms, owner 0.500 ms" in out0, out0
    assert "RESULT nccl_check ws=2 dtype=float32 " in out0 and out0.endswith("nccl_check: all checks passed\n"), out0
