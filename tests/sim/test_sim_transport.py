"""The simulated device with one process per rank: the sim's NCCL carried between processes by its hub
(``sim_nccl_transport``), the communicator chosen by the product's own ``comm_select.select_comm`` over a gloo process
group (``CupyNcclComm.from_process_group`` broadcasts the unique id over it), the real runtime's flushes bitwise equal
to the exact sum, and a peer process that exits: its survivor fails within the deadline (an abort reaches the peers
here, as on a network)."""

from __future__ import annotations

import pytest

from harness.launch import run_ranks

NUMELS = [3 + (5 * i) % 13 for i in range(30)]
STEPS = 3


def _worker(rank: int, world_size: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from owner_reduce import OwnerReduceCommError
    from owner_reduce.runtime.comm_select import SelectSteps, local_readiness, select_comm
    from owner_reduce.runtime.nccl_comm import CupyNcclComm
    from tests.support.fakes import flat_map
    from tests.support.sim.cuda import Sim
    from tests.support.sim.runtime import GRAPH, exact_grads, expected_buffers, make_runtime

    out: dict = {}
    owner_map = flat_map(NUMELS, world_size)
    # Each process's one simulated rank drives GPU ``rank`` (its launcher's choice), as on a node.
    with Sim(transport="processes", max_ranks=1, abort_reaches_peers=True, hang_bound_s=30, first_device=rank) as sim:
        torch.cuda.set_device(rank)
        # The product's own choice over the gloo group; the readiness is DeepSpeed's CUDA accelerator's, as on a GPU
        steps = SelectSteps(readiness=lambda: local_readiness("cuda"))
        rt = make_runtime(owner_map, rank, lambda group: select_comm(group, steps), algo="reduce", bucket=64)
        out["comm"] = type(rt.comm).__name__
        exact = []
        for step in range(STEPS):
            grads = exact_grads(world_size, NUMELS, rank, step, 0)
            rt.start_backward(True)
            for pid in reversed(range(len(NUMELS))):
                rt.reduce_grad(grads[pid].to("cuda", non_blocking=True), GRAPH, pid)
            rt.end_backward(GRAPH, False)
            want = expected_buffers(owner_map, world_size, NUMELS, step, 1)
            for pid, param in rt._params.items():
                buf = param.grad_buffer.cpu()
                if buf.numel():
                    exact.append(torch.equal(buf, want[pid][param.offset:param.offset + buf.numel()].float()))
        out["exact"], out["compared"] = all(exact), len(exact)
        out["stats"] = (rt.stats.flushes, rt.stats.scheduled_flushes, rt.stats.reduce_calls)
        out["nccl_reduces"] = sim.nccl.comms(0)[0].calls["reduce"] - rt.sim_calls_at_init[0]["reduce"]  # the flushes
        rt.cleanup()
        comm = CupyNcclComm.from_process_group(dist.group.WORLD)  # a second communicator: its peer will exit
        comm.set_deadline(type(comm.deadline)(10.0, "test"))
        if rank == 1:
            return out  # this process exits: its connection to the hub closes (no abort, no destroy)
        buf = torch.ones(8, device="cuda")
        start = time.monotonic()
        try:
            with comm.group(flush=1):
                comm.all_reduce(buf)
            comm.wait_until(torch.cuda.current_stream().query, "end_backward")
        except OwnerReduceCommError as error:
            out["error"] = str(error)
        out["elapsed"] = time.monotonic() - start
        out["hangs"] = sim.hangs
    return out


@pytest.mark.timeout(240)
def test_ranks_in_processes_reduce_through_the_sims_hub_and_a_dead_peer_is_reported():
    r0, r1 = run_ranks(_worker, 2, timeout=200)
    for r in (r0, r1):
        assert r["comm"] == "CupyNcclComm", r  # select_comm chose the cupy path on the sim
        assert r["exact"] and r["compared"] > 0, r
        flushes, scheduled, reduces = r["stats"]
        assert scheduled > 0 and reduces == r["nccl_reduces"] > 0, r
    assert "NCCL_ERROR_REMOTE_ERROR" in r0["error"] and "rank 0, flush #1: end_backward" in r0["error"], r0
    assert r0["elapsed"] < 10.0 and r0["hangs"] == [], r0
