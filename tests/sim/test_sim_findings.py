"""Issue 37's findings 1, 2, 3, 5 and 6 on the simulated device, each as the product's behaviour the fix must bring,
so each FAILS on the product before its fix (``xfail(strict=True)``: the suite passes, and a test that starts passing
is reported; the fixes remove the marks). What each shows before the fix is in its docstring.

Bounds: the product's deadline (``compile.reduce_to_owner_timeout_s``) is 1 s; the sim's hang bound (what a GPU
would never return from) is longer, so a hang is told from a failure within the deadline; each test's own bound is the
issue's "within the deadline plus 10 s"."""

from __future__ import annotations

import re
import threading
import time
import traceback
import types

import pytest
import torch
from torch.distributed import HashStore

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import deadline as deadlines
from owner_reduce.runtime import stall_report
from owner_reduce.runtime.nccl_binding import new_unique_id
from owner_reduce.runtime.nccl_comm import CupyNcclComm
from tests.support.fakes import MirrorComm, flat_map
from tests.support.sim.cuda import Sim, SimHang
from tests.support.sim.runtime import GRAPH, connect_comms, cupy_runtimes, exact_grads, group_ranks_as_nodes, train_step

DEADLINE_S = 1.0
HANG_BOUND_S = 5.0  # a blocked host wait past this is a hang (each test's bound: the deadline + 4 s)
NUMELS = [3 + (5 * i) % 13 for i in range(30)]


def _backward_outcomes(sim, runtimes, step, between=None, skip=(), numels=NUMELS):
    """One backward on every rank (ranks in ``skip`` have died: they issue nothing); each rank's exception (or None)
    and the seconds it took."""
    ws = len(runtimes)

    def backward(rank):
        if rank in skip:
            return None, 0.0
        start = time.monotonic()
        rt = runtimes[rank]
        grads = exact_grads(ws, numels, rank, step, 0)
        try:
            rt.start_backward(True)
            for pid in reversed(range(len(numels))):
                if between is not None:
                    between(rank, pid)
                rt.reduce_grad(grads[pid].to("cuda", non_blocking=True), GRAPH, pid)
            rt.end_backward(GRAPH, False)
        except BaseException as error:  # noqa: BLE001 - the outcome under test
            return error, time.monotonic() - start
        return None, time.monotonic() - start

    return sim.run_ranks(backward, ws, timeout_s=3 * HANG_BOUND_S + 20)


def _assert_bounded_failures(sim, outcomes, ranks):
    """Every rank in ``ranks`` failed with owner_reduce's error within the bound, none in a hang."""
    for rank in ranks:
        error, took = outcomes[rank]
        assert error is not None, f"rank {rank} finished its backward"
        assert not isinstance(error, SimHang), f"rank {rank} hung: {error}"
        assert isinstance(error, RuntimeError) and "owner_reduce" in str(error), (rank, repr(error))
        assert took < HANG_BOUND_S, (rank, took)
    assert sim.hangs == [], sim.hangs


# ---- finding 1 -------------------------------------------------------------------------------------------------

DEEP = [8] * 128  # 128 layers of 8-element gradients; 32-element buckets: a flush every 4 layers


@pytest.mark.timeout(120)
def test_a_stalled_peer_in_a_deep_model_fails_every_rank_within_the_deadline(monkeypatch):
    """Rank 1's data-parallel kernels stop completing (a hung GPU) in the second backward of a 128-layer model with
    four compute ops per layer between its ``reduce_grad`` calls. Before the fix nothing watches the flushes: flush i
    never completes, flush i + 2 reuses its bucket, the compute stream waits on its free event, and the backward keeps
    launching onto the blocked stream until the launch queue (256 here) blocks the host inside the backward: every
    rank hangs (``SimHang``), never reaching ``end_backward``'s bounded wait."""
    store = HashStore()  # torch's default store of a real job: the stall report's marks (``stall_report``)
    monkeypatch.setattr(stall_report, "default_store", lambda: store)
    with Sim(launch_bound=256, hang_bound_s=HANG_BOUND_S) as sim:
        owner_map = flat_map(DEEP, 2)
        runtimes = cupy_runtimes(sim, owner_map, algo="reduce", bucket=32, timeout_s=DEADLINE_S)
        activations = sim.run_ranks(lambda rank: torch.ones(64, device="cuda"), 2)

        def layer(rank, pid):  # a layer's backward: four kernels on the compute stream
            act = activations[rank]
            act.mul_(0.5).add_(1.0).mul_(2.0).sub_(1.0)

        train_step(sim, runtimes, DEEP, 0, 1, between=layer)  # learning: healthy
        sim.nccl.stall(sim.nccl.comms(1)[0])
        outcomes = _backward_outcomes(sim, runtimes, 1, between=layer, numels=DEEP)
        _assert_bounded_failures(sim, outcomes, (0, 1))
        assert all("flush #" in str(error) for error, _ in outcomes), outcomes
        # Rank 1's host issued every flush (its GPU hung): both ranks marked the stalled flush, and each says so.
        assert all(re.search(r"; every rank reached flush #\d+ \(reduce on the data-parallel communicator\); the "
                             r"stall is on the device or the network$", str(error)) for error, _ in outcomes), outcomes


# ---- finding 2 -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_stalled_rail_fails_within_the_deadline_although_the_node_step_waits_behind_it(monkeypatch):
    """Two nodes of two; in the second backward rank 2's rail kernels stop completing. Rank 0's rail kernels spin,
    its later node steps wait behind them (the node stream waits for the compute stream, which waits for the
    buckets' free events on the rail stream). At the deadline ``abort_all`` aborts the data-parallel, then the node
    communicator: ``ncclCommAbort(node)`` waits for the node's last kernel, queued behind the rail's spinning one,
    and never returns (``SimHang`` on ranks 0 and 2). Aborting every communicator concurrently returns (the
    mechanism: ``test_sim_cuda.py::test_aborting_both_communicators_concurrently_returns``)."""
    from owner_reduce.planning import two_level

    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        group_ranks_as_nodes(monkeypatch, sim, 2)
        monkeypatch.setattr(two_level, "RAIL_STEPS", (two_level.RAIL_REDUCE,))
        monkeypatch.setattr(two_level, "RAIL_LAYOUTS", (two_level.BY_OWNER,))
        runtimes = cupy_runtimes(sim, flat_map(NUMELS, 4), algo="two_level", bucket=64, timeout_s=DEADLINE_S)
        train_step(sim, runtimes, NUMELS, 0, 1)
        rail = sim.nccl.comms(2)[2]  # rank 2's communicators: data-parallel, node, rail, node hand-off
        assert rail.group.nranks == 2 and runtimes[2].flusher.levels.rail.members == (0, 2)
        sim.nccl.stall(rail)
        outcomes = _backward_outcomes(sim, runtimes, 1)
        _assert_bounded_failures(sim, outcomes, (0, 1, 2, 3))


# ---- finding 3 -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_after_a_failed_nccl_call_no_communicator_is_left_to_a_destroy_at_exit(monkeypatch):
    """Two nodes of two. Rank 2 dies before the third backward (it issues nothing more), so rank 0's first rail
    Reduce of that backward spins; then rank 0's next node call fails (``ncclRemoteError``, as NCCL's proxy reports a
    dead peer). The product aborts the node communicator only (its last kernel is done, so that
    abort returns) and raises; the data-parallel and rail ones stay open, and at the process's exit cupy's
    ``__dealloc__`` destroys them: ``ncclCommDestroy(rail)`` waits for the spinning kernel forever (``SimHang`` in
    ``process_exit``)."""
    from owner_reduce.planning import two_level

    with Sim(hang_bound_s=3.0) as sim:
        group_ranks_as_nodes(monkeypatch, sim, 2)
        monkeypatch.setattr(two_level, "RAIL_STEPS", (two_level.RAIL_REDUCE,))
        monkeypatch.setattr(two_level, "RAIL_LAYOUTS", (two_level.BY_OWNER,))
        runtimes = cupy_runtimes(sim, flat_map(NUMELS, 4), algo="two_level", bucket=64, timeout_s=DEADLINE_S)
        train_step(sim, runtimes, NUMELS, 0, 1)
        logged = len(runtimes[0].collective_log)
        train_step(sim, runtimes, NUMELS, 1, 1)  # the schedule, followed: the next backward issues the same calls
        names = [name for name, *_ in runtimes[0].collective_log[logged:]]
        first_rail = names.index("rail_reduce")  # rank 0's first rail Reduce: it will spin for the dead rank 2
        node_calls = sum(name.startswith("node_") for name in names[:first_rail])
        assert 0 < first_rail < len(names) - 1 and names[first_rail + 1].startswith("node_"), names
        sim.nccl.inject("*", 6, rank=0, comm=1, nth=node_calls + 1)  # the node call after it
        outcomes = _backward_outcomes(sim, runtimes, 2, skip=(2,))
        error, _ = outcomes[0]
        assert isinstance(error, RuntimeError) and "on the node communicator failed on rank 0" in str(error), error
        assert "NCCL_ERROR_REMOTE_ERROR" in str(error)
        sim.nccl.process_exit(0)  # what cupy's __dealloc__ does for every communicator left open
        assert all(member.aborted and not member.destroyed for member in sim.nccl.comms(0))


# ---- finding 5 -------------------------------------------------------------------------------------------------


class _ThreadGather:
    """``comm_select``'s gather among the sim's in-process ranks (one process group's all_gather_object)."""

    def __init__(self, ws):
        self.ws, self.rows, self.barrier = ws, {}, threading.Barrier(ws)

    def __call__(self, group, reason):
        rank = torch.cuda.current_device()
        self.barrier.wait()
        self.rows = {} if len(self.rows) == self.ws else self.rows
        self.barrier.wait()
        self.rows[rank] = reason
        self.barrier.wait()
        return [self.rows[r] for r in range(self.ws)]


@pytest.mark.timeout(120)
def test_nccl_comm_blocking_0_is_refused_at_init_by_every_rank_naming_the_variable(monkeypatch):
    """``NCCL_COMM_BLOCKING=0`` makes NCCL calls return ``ncclInProgress`` (7), which cupy 14's ``NcclError`` cannot
    represent (``KeyError: 7``). The runtime is built as ``activation.build_runtime`` builds it (its settings from the
    environment) and chooses its communicator through ``comm_select.select_comm``, the product's own readiness check
    on the sim's cupy; before the fix the communicator's creation fails with ``KeyError: 7`` and every rank falls
    back to torch.distributed with a warning: nothing refuses the variable."""
    from owner_reduce.planning.flags import OwnerReduceFlags
    from owner_reduce.planning.settings import OwnerReduceSettings
    from owner_reduce.runtime.comm_select import SelectSteps, local_readiness, select_comm
    from owner_reduce.runtime.handle import OwnerReduceRuntime
    from owner_reduce.wiring.activation import rank_inputs

    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    ws = 2
    owner_map = flat_map(NUMELS, ws)
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        uid = new_unique_id()
        gather = _ThreadGather(ws)

        def init(rank):
            flags = OwnerReduceFlags(True, False)
            settings = OwnerReduceSettings(flags)
            inputs = rank_inputs(settings, rank)
            steps = SelectSteps(readiness=lambda: local_readiness("cuda"),
                                create=lambda group: CupyNcclComm(uid, rank, ws), gather=gather,
                                fallback=lambda group: MirrorComm(rank, ws))
            rt = OwnerReduceRuntime(settings, owner_map, lambda group: select_comm(group, steps), inputs=inputs)
            try:
                rt.init(None, types.SimpleNamespace(double_buffer=True), 64)
            except Exception as error:  # noqa: BLE001 - the outcome under test
                return error
            return type(rt.comm).__name__

        outcomes = sim.run_ranks(init, ws)
        for rank, outcome in enumerate(outcomes):
            # With the traceback: an unexpected error here (a KeyError(0) twice under load in 2026-12, never alone)
            # must say where it came from.
            assert isinstance(outcome, Exception) and "NCCL_COMM_BLOCKING" in str(outcome), (
                rank, outcome, "".join(traceback.format_exception(outcome)) if isinstance(outcome, BaseException)
                else None)


# ---- finding 6 -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_all_gather_ints_fails_within_the_deadline_behind_a_stalled_collective():
    """Rank 0's all_reduce spins (rank 1 never joins it); then rank 0's ``all_gather_ints`` (the init-time agreement,
    the split) builds its input with ``torch.tensor(values, device=cuda)``: a blocking host-to-device copy, which
    synchronizes the current stream outside the deadline and waits behind the spinning kernel forever (``SimHang``).
    With a non-blocking copy its allGather queues behind it and the bounded wait fails at the deadline."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        uid = new_unique_id()
        comms = sim.run_ranks(lambda rank: CupyNcclComm(uid, rank, 2), 2)
        connect_comms(sim, comms)  # as the runtime's init (``comm`` Note (lazy connections))
        comm = comms[0]
        comm.set_deadline(deadlines.resolve(DEADLINE_S, None))
        buf = torch.ones(8, device="cuda")
        comm.all_reduce(buf)  # rank 1 never calls it
        start = time.monotonic()
        with pytest.raises(OwnerReduceCommError, match=r"all_gather\(count=2, dtype=int64\)"):
            try:
                comm.all_gather_ints([1, 2])
            except SimHang as hang:
                raise AssertionError(f"all_gather_ints hung: {hang}") from None
        assert time.monotonic() - start < DEADLINE_S + 10
        assert sim.counters["blocking copy"] == 0, sim.counters

