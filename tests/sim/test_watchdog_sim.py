"""Issue 37 on the simulated device (``tests/support/sim/cuda.py``): the product's cupy path (``OwnerReduceRuntime``,
``CupyNcclComm``, ``CudaStreams``) with CUDA's asynchrony, the launch queue's bound and NCCL's abort semantics.

- The stalled-peer acceptance test of the issue's "Done when": a deep model (128 layers, small buckets: dozens of
  flushes per backward, more launches than the launch queue holds), three ranks, one stopping before its third
  backward: every surviving rank fails within the deadline plus 10 s, naming the call, the communicator and the flush.
  Without the flush watchdog the survivors block in a CUDA launch behind the stalled stream (the sim gives up after its
  hang bound, well past that: ``SimHang``). Run in a subprocess, so that a watchdog ending its process ends only that.
- Finding 6: ``all_gather_ints`` after a collective that never completes on the same stream fails within the deadline;
  with a blocking copy it waited behind that collective with no bound.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 3.0
BOUND_S = 10.0  # the issue: within the deadline plus 10 s


def stalled_peer_main(world_size: int, stall_rank: int, layers: int, kernels: int, bucket: int, steps: int,
                      stall_step: int, deadline_s: float = DEADLINE_S) -> None:
    """The acceptance scenario, in this process (``python -c``): prints one JSON line per rank."""
    from owner_reduce.runtime import nccl_binding, nccl_comm
    from tests.support.fakes import flat_map
    from tests.support.sim.cuda import Sim
    from tests.support.sim.runtime import GRAPH, make_runtime

    numels = [256, 16] * layers  # a weight and a bias per layer
    owner_map = flat_map(numels, world_size)
    release = threading.Event()  # the stopped rank goes on once every survivor is done
    stalled_at: list[float] = []
    survivors = [world_size - 1]
    lock = threading.Lock()
    computes: dict = {}  # rank -> its compute (current) stream
    fullest: dict = {}  # rank -> the most operations its compute stream held pending at once
    from torch.distributed import HashStore

    from owner_reduce.runtime import stall_report

    store = HashStore()  # torch's default store of a real job: the ranks' stall marks (``stall_report``)
    stall_report.default_store = lambda: store
    with Sim(hang_bound_s=30.0) as sim:  # launch_bound: the default, about a thousand
        uid = nccl_binding.new_unique_id()

        def rank_main(rank: int) -> dict:
            rt = make_runtime(owner_map, rank, lambda group: nccl_comm.CupyNcclComm(uid, rank, world_size),
                              bucket=bucket, timeout_s=deadline_s)
            grads = [torch.ones(n, device="cuda") for n in numels]
            out: dict = {"rank": rank}
            computes[rank] = torch.cuda.current_stream()
            try:
                for step in range(1, steps + 1):
                    if rank == stall_rank and step == stall_step:
                        stalled_at.append(time.monotonic())
                        release.wait(120)  # stopped: never joins this backward's flushes
                        out["stalled"] = True
                        return out
                    rt.start_backward(True)
                    for pid in reversed(range(len(numels))):
                        for _ in range(kernels):
                            sim.kernel(1e-5, name=f"layer {pid // 2}")
                        rt.reduce_grad(grads[pid], GRAPH, pid)
                    rt.end_backward(GRAPH, False)
                    out["steps"] = step
                    out["flushes"] = rt.stats.flushes
            except BaseException as error:  # noqa: BLE001 - the verdict is the test's
                out["error"] = f"{type(error).__name__}: {error}"
                out["failed_after_s"] = time.monotonic() - stalled_at[0] if stalled_at else None
            finally:
                if rank != stall_rank:
                    with lock:
                        survivors[0] -= 1
                        if not survivors[0]:
                            release.set()
            return out

        def watch_queues() -> None:  # whether a survivor's host really blocked in a launch (a full launch queue)
            while not release.is_set():
                for rank, stream in list(computes.items()):
                    fullest[rank] = max(fullest.get(rank, 0), len(stream.queue))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch_queues, daemon=True)
        watcher._sim_unbound = True  # reads queue lengths only: no simulated process of its own
        watcher.start()
        results = sim.run_ranks(rank_main, world_size, timeout_s=100, raise_first=False)
        release.set()
        watcher.join(5)
    for r in results:
        if isinstance(r, dict):
            r["fullest_launch_queue"] = fullest.get(r["rank"], 0)
            r["launch_bound"] = sim.launch_bound
        print("RANK " + json.dumps(r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"}), flush=True)
    # The stalled rank's simulated kernels spin forever on the sim's stream threads, as a hung GPU's would; an
    # interpreter shutdown that tears torch down under those threads can abort ("terminate called without an active
    # exception", seen once in CI after every rank had reported). The verdict is the lines above: leave at once.
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.timeout(240)
def test_a_stalled_peer_in_a_deep_model_fails_every_survivor_within_the_deadline_plus_10s():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = (f"from {__name__} import stalled_peer_main; "
            "stalled_peer_main(world_size=3, stall_rank=2, layers=128, kernels=8, bucket=1024, steps=4, stall_step=3)")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=200,
                          cwd=ROOT)
    ranks = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("RANK ")]
    detail = f"exit {done.returncode} after {time.monotonic() - started:.0f} s\n{done.stdout[-3000:]}\n" \
             f"{done.stderr[-4000:]}"
    assert done.returncode == 0 and len(ranks) == 3, detail
    assert ranks[2].get("stalled"), detail
    for r in ranks[:2]:
        assert r.get("steps") == 2 and r.get("flushes", 0) >= 2 * 40, detail  # two healthy steps, ~43 flushes each
        error = r.get("error", "")
        assert error.startswith(f"OwnerReduceCommError: owner_reduce: rank {r['rank']}, flush #"), detail
        assert "flush watchdog: " in error and " communicator timed out after waiting " in error, detail
        # The stall report: the rank that never reached the stalled flush, and its host (issue 48).
        assert f"(reduce on the data-parallel communicator): rank 2 on host {socket.gethostname()} never arrived" \
            in error, detail
        assert r["failed_after_s"] is not None and r["failed_after_s"] <= DEADLINE_S + BOUND_S, detail
        assert r["fullest_launch_queue"] >= r["launch_bound"], detail  # the host blocked in a launch (finding 1)


# ---- finding 6: no blocking copy outside the deadline ---------------------------------------------------------------


def _pair(sim, deadline_s: float):
    from owner_reduce.runtime import nccl_binding, nccl_comm
    from owner_reduce.runtime.deadline import Deadline
    from tests.support.sim.runtime import connect_comms

    uid = nccl_binding.new_unique_id()
    comms = sim.run_ranks(lambda rank: nccl_comm.CupyNcclComm(uid, rank, 2), 2)
    connect_comms(sim, comms)  # as the runtime's init (``comm`` Note (lazy connections))
    for comm in comms:
        comm.deadline = Deadline(deadline_s, "test")
        comm.watchdog.end = lambda code: None  # this test wants the raised error; a process end would fail it
    return comms


@pytest.mark.timeout(120)
def test_all_gather_ints_behind_a_collective_that_never_completes_fails_within_the_deadline():
    """Rank 0's stream holds an AllReduce rank 1 never joins; the agreement's gather after it must fail within the
    deadline. A blocking host-to-device copy of the values synchronized with that stream first: no bound at all (here:
    the sim's hang bound, 20 s)."""
    from owner_reduce import OwnerReduceCommError
    from tests.support.sim.cuda import Sim

    with Sim(hang_bound_s=20.0) as sim:
        comms = _pair(sim, deadline_s=1.0)

        def rank0(rank: int):
            comm = comms[rank]
            if rank == 1:
                return None
            buf = torch.ones(8, device="cuda")
            comm.all_reduce(buf)  # outside a group: on the current stream, never completes
            started = time.monotonic()
            try:
                comm.all_gather_ints([1, 2, 3])
            except OwnerReduceCommError as error:
                return time.monotonic() - started, str(error)
            return time.monotonic() - started, None

        results = sim.run_ranks(rank0, 2, raise_first=False)
        assert not isinstance(results[0], BaseException), results[0]
        waited, error = results[0]
        assert error is not None and waited < 1.0 + 5.0, (waited, error, sim.hangs)
        assert "all_reduce(count=8, dtype=float32)" in error, error
        assert sim.counters["blocking copy"] == 0


@pytest.mark.timeout(120)
def test_the_agreement_gathers_without_a_blocking_copy():
    from tests.support.sim.cuda import Sim

    with Sim() as sim:
        comms = _pair(sim, deadline_s=10.0)
        rows = sim.run_ranks(lambda rank: comms[rank].all_gather_ints([rank, 10 + rank]), 2)
        assert rows == [[[0, 10], [1, 11]]] * 2
        assert sim.counters["blocking copy"] == 0
