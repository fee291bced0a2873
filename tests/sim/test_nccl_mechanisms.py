"""scripts/nccl_mechanisms.py without a GPU: its answer when none is visible, the deep model's partition (what each
rank registers must be what the owner map gives it: checked by the real runtime here), how it judges rank 0's
failure in the product's stall (the GPU run's verdict), and each of its checks (``launch-stall``, ``abort-order``,
``product-stall``) run whole on the simulated device: the script's parent as ``scripts/gpu_check.sh`` runs it, each rank
a process on ``Sim(transport="processes")``. What only a GPU can show (the real launch queue, NCCL's real abort and
its timings) is measured where a GPU is lent, by ``scripts/gpu_check.sh``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.owner_map import OwnerMap
from owner_reduce.planning.settings import MODEL, OwnerReduceSettings
from owner_reduce.runtime.handle import OwnerReduceRuntime
from tests.support.fakes import MirrorComm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "nccl_mechanisms.py"


@pytest.fixture(scope="module")
def mech():
    spec = importlib.util.spec_from_file_location("_scripts_nccl_mechanisms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_without_a_gpu_it_says_so_and_exits_3():
    done = subprocess.run([sys.executable, str(SCRIPT), "product-stall"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "nccl_mechanisms product-stall: no CUDA GPU is visible" in done.stdout


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_registers_what_the_owner_map_gives_it(mech, rank):
    """The GPU run's registration, on CPU tensors: the runtime refuses a grad buffer outside what reaches the rank."""
    numels = mech.deep_model_numels(128)
    assert len(numels) == 256 and sum(numels) == 128 * (4096 + 64)
    owner_map = OwnerMap.from_group_tables([mech.owner_tables(numels, 2)], 2)
    rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False), algo=MODEL), owner_map,
                            lambda group: MirrorComm(rank=rank, world_size=2))
    rt.init(None, types.SimpleNamespace(double_buffer=True), 16384)
    kept = 0
    for pid, n in enumerate(numels):
        offset, length = mech.kept_slice(numels, 2, rank, pid)
        rt.register_param(pid, (n,), torch.zeros(n), torch.zeros(length), offset)
        kept += length
    assert kept == sum(numels) // 2  # the two partitions, equal
    rt.cleanup()


def test_the_product_stall_is_judged_on_the_bound_and_the_named_error(mech):
    raised = ("Traceback ...\nowner_reduce.runtime.deadline.OwnerReduceCommError: owner_reduce: rank 0, flush #70: "
              "flush watchdog: reduce(root=1, count=8256, dtype=float32) (call 1 of 2) on the data-parallel "
              "communicator timed out after waiting 8 s (the deadline, from compile.reduce_to_owner_timeout_s; "
              "measured 8.0 s)\n")
    ended = ("owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 0, flush #70: flush watchdog: "
             "reduce(root=1, count=8256, dtype=float32) (call 1 of 2) on the data-parallel communicator timed out "
             "after waiting 8 s (the deadline, from compile.reduce_to_owner_timeout_s; measured 8.0 s)\n"
             "owner_reduce: the main thread is inside an NCCL group ...; owner_reduce ends this process (exit status "
             "1), as torch's NCCL watchdog does\n")
    ok, why = mech.judge_product_stall(1, 9.3, 8.0, raised)
    assert ok and "flush #70: flush watchdog: reduce(root=1" in why
    assert mech.judge_product_stall(1, 9.3, 8.0, ended)[0]
    assert mech.judge_product_stall(1, 18.5, 8.0, raised) == (
        False, "rank 0 failed 18.5 s after the stall, past the deadline + 10 s")
    assert mech.judge_product_stall(None, None, 8.0, "") == (False, "rank 0 was still running at the check's bound")
    assert mech.judge_product_stall(0, 3.0, 8.0, "") == (False, "rank 0 finished every step: the stall did not stall "
                                                                "it")
    assert mech.judge_product_stall(1, 9.0, 8.0, "RuntimeError: CUDA error") == (
        False, "rank 0 exited 1 without owner_reduce's bounded error")


_ON_THE_SIM = """
import importlib.util, sys
sys.path[:0] = [{root!r}]
from tests.support.sim.cuda import Sim
spec = importlib.util.spec_from_file_location("nccl_mechanisms", {script!r})
mech = importlib.util.module_from_spec(spec)
sys.modules["nccl_mechanisms"] = mech
spec.loader.exec_module(mech)
with Sim(transport="processes", max_ranks=1, hang_bound_s=30.0):
    mech.main(sys.argv[1:])
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [["launch-stall"], ["abort-order", "--alone-s", "2"],
                                  ["product-stall"]])  # its 8 s deadline: a healthy flush may lag 3 s under load
def test_each_check_passes_on_the_simulated_device(mech, monkeypatch, tmp_path, capsys, argv):
    """The script as gpu_check runs it (its parent: spawning, bounds, verdict, RESULT line), each rank process on the
    simulated device (``Sim(transport="processes")``: CUDA's launch queue, NCCL's abort waiting for the last kernel), so
    that its first run on a GPU is not its first run."""
    boot = _ON_THE_SIM.format(root=str(ROOT), script=str(SCRIPT))
    monkeypatch.setattr(mech, "_rank_command", lambda args, rank, out: [sys.executable, "-c", boot, *args, "--rank",
                                                                       str(rank), "--dir", str(out)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the parent's check; the ranks run on the sim
    code = mech.main([*argv, "--timeout", "120", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    logs = "".join(p.read_text(errors="replace")[-1500:] for p in (tmp_path / "nccl_mechanisms").glob("*.log"))
    assert code == 0, out + logs
    assert f"RESULT nccl_mechanisms check={argv[0]} ok=1 " in out, out
