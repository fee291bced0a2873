"""The cupy communicator's error paths (``CupyNcclComm``: bounded waits, aborts, groups, names) on the simulated
device's NCCL, where ``test_deadline.py`` had a fake communicator (``FakeNccl``, ``FakeNcclModule``) and a
model of NCCL's group rules (``NcclGroupModel``): the product's real communicator over the sim's cupy, its collectives
really waiting on peers, its aborts really stopping kernels, and NCCL's group rules enforced by the sim (a failed
enqueue reported again by ``ncclGroupEnd``; an abort of a communicator an open group holds frees it under the group,
which ``ncclGroupEnd`` then uses: ``SimUseAfterFree``)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import nccl_binding, nccl_comm
from owner_reduce.runtime.deadline import Deadline
from tests.support.sim import nccl as sim_nccl
from tests.support.sim.cuda import Sim, SimHang
from tests.support.sim.nccl import SimUseAfterFree

SHORT = Deadline(0.2, "test")


@pytest.fixture(name="sim")
def connected_sim():
    """A ``Sim()`` whose communicators connect at creation (``lazy_connect=False``): these tests stall a peer inside a
    flush and assert the exact NCCL calls made (``calls_of``), which a connection warm-up would add to; NCCL's lazy
    connection and the runtime's warm-up are tested in ``tests/sim/test_sim_gpu_stack.py``."""
    with Sim(lazy_connect=False) as installed:
        yield installed


@pytest.fixture(autouse=True)
def _no_flush_watchdog(monkeypatch):
    """These tests bound the main thread's own waits and aborts; the flush watchdog, which counts each group's deadline
    from its issue and would race them at the same short deadline, is tested on its own (tests/sim/test_watchdog.py,
    tests/sim/test_watchdog_sim.py, tests/sim/test_sim_findings.py)."""
    from owner_reduce.runtime.watchdog import FlushWatchdog

    monkeypatch.setattr(FlushWatchdog, "arm", lambda self: None)


def _comms(sim, ws, deadline=SHORT):
    """The product's communicator on every rank of one unique id (made on the ranks' threads: init blocks until all
    joined); rank 0's is used from the test's thread, which is rank 0's process."""
    uid = nccl_binding.new_unique_id()
    comms = sim.run_ranks(lambda rank: nccl_comm.CupyNcclComm(uid, rank, ws), ws)
    for comm in comms:
        comm.set_deadline(deadline)
    return comms


def _member(comm):
    return comm._comm.member


def _stalled_group(comm, flush=3):
    """A group of two AllReduces of rank 0 that rank 1 never joins: in flight forever (until aborted)."""
    buf = torch.ones(12, device="cuda")
    with comm.group(flush=flush):
        comm.all_reduce(buf[:8])
        comm.all_reduce(buf[8:])
    return buf


# ---- bounded waits and aborts --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cupy_comm_timeout_aborts_exactly_once_and_never_destroys(sim):
    comm, _ = _comms(sim, 2)
    member = _member(comm)
    _stalled_group(comm, flush=3)
    comm.flush = 4
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #4: end_backward, waiting for all_reduce\(count=8, "
                                                   r"dtype=float32\) \(call 1 of 2\) of flush #3 timed out after "
                                                   r"waiting 0\.2 s \(the deadline, from test; measured "):
        comm.wait_until(lambda: False, "end_backward", flush=4)
    assert sim.nccl.calls_of(0).count("abort") == 1 and "destroy" not in sim.nccl.calls_of(0)
    assert comm.aborted and member.aborted and not member.destroyed
    comm.close()  # after an abort: nothing left to release, nothing waits
    comm.close()
    assert sim.nccl.calls_of(0).count("abort") == 1 and "destroy" not in sim.nccl.calls_of(0)
    with pytest.raises(RuntimeError, match="was aborted after an earlier failure"):
        comm._live("reduce(root=1, count=3, dtype=float32)")
    torch.cuda.synchronize()  # the aborted kernel exited: nothing is left on the stream


@pytest.mark.timeout(60)
def test_cupy_comm_async_error_aborts_and_names_it(sim):
    comm, _ = _comms(sim, 2, deadline=Deadline(30, "test"))
    _stalled_group(comm, flush=3)
    sim.nccl.async_error(_member(comm), sim_nccl.REMOTE_ERROR)
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError, match=r"flush #2: bucket growth, waiting for all_reduce\(count=8, "
                                                   r"dtype=float32\) \(call 1 of 2\) of flush #3 failed: "
                                                   r"NcclError: NCCL_ERROR_REMOTE_ERROR"):
        comm.wait_until(lambda: False, "bucket growth", flush=2)
    assert time.monotonic() - start < 30 and sim.nccl.calls_of(0).count("abort") == 1  # before the 30 s deadline
    assert "destroy" not in sim.nccl.calls_of(0)


@pytest.mark.timeout(60)
def test_cupy_comm_close_drains_then_destroys_or_aborts_when_the_stream_is_stuck(sim):
    comms = _comms(sim, 2)

    def flush(rank):
        buf = torch.ones(4, device="cuda")
        with comms[rank].group(flush=1):
            comms[rank].all_reduce(buf)

    sim.run_ranks(flush, 2)
    comms[0].close()  # its work completes: waited for, then destroyed
    assert sim.nccl.calls_of(0)[-1] == "destroy" and "abort" not in sim.nccl.calls_of(0)
    stuck, _ = _comms(sim, 2, deadline=Deadline(0.05, "test"))
    _stalled_group(stuck)
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError, match=r"close \(work still in flight"):
        stuck.close()
    assert sim.nccl.calls_of(0)[-1] == "abort" and sim.nccl.calls_of(0).count("destroy") == 1
    assert time.monotonic() - start < 2.0
    stuck.close()
    assert sim.nccl.calls_of(0).count("abort") == 1


def test_a_failure_inside_a_group_aborts_the_communicator(sim):
    (comm,) = _comms(sim, 1)
    with pytest.raises(ValueError, match="injected"), comm.group(flush=9):
        raise ValueError("injected")
    assert sim.nccl.calls_of(0) == ["groupStart", "groupEnd", "abort"]
    assert comm.flush == 9 and not comm.in_group
    (healthy,) = _comms(sim, 1)  # and a group without error does not abort
    with healthy.group(flush=1):
        pass
    assert sim.nccl.calls_of(0)[-2:] == ["groupStart", "groupEnd"]


def test_a_failed_nccl_call_aborts_the_communicator(sim):
    (comm,) = _comms(sim, 1)
    sim.nccl.inject("allReduce", sim_nccl.INVALID_USAGE)
    with pytest.raises(RuntimeError, match=r"owner_reduce NCCL all_reduce\(count=4, dtype=float32\) failed on rank 0, "
                                           r"outside a flush: NcclError: NCCL_ERROR_INVALID_USAGE"):
        comm.all_reduce(torch.ones(4, device="cuda"))
    assert sim.nccl.calls_of(0) == ["allReduce failed", "abort"]


# ---- NCCL's group rules: the group is ended first, then the abort, and the first error is raised ---------------


def _grouped(sim):
    (comm,) = _comms(sim, 1)
    return comm, torch.zeros(8, device="cuda")


def test_a_failed_call_inside_a_group_ends_the_group_then_aborts_and_raises_that_call(sim):
    """A dead peer fails the second call of a flush: the group is ended before the abort (no use of a freed
    communicator), the abort runs once, and the error raised names the failed call, not NCCL's group end."""
    comm, buf = _grouped(sim)
    sim.nccl.inject("reduce", sim_nccl.REMOTE_ERROR, nth=2)
    with pytest.raises(RuntimeError) as caught, comm.group(flush=5):
        comm.reduce(buf[:4], 0)
        comm.reduce(buf[4:], 0)
        raise AssertionError("not reached: the second reduce raises")
    assert sim.nccl.calls_of(0) == ["groupStart", "reduce", "reduce failed", "groupEnd failed", "abort"]
    assert comm.aborted and not comm.in_group
    assert str(caught.value).startswith("owner_reduce NCCL reduce(root=0, count=4, dtype=float32) failed on rank 0, "
                                        "flush #5: NcclError: NCCL_ERROR_REMOTE_ERROR")
    # NCCL's group end reported the failed enqueue again: kept as a note, never the error raised
    assert any("closing the collective group afterwards failed too" in n for n in caught.value.__notes__)
    with pytest.raises(RuntimeError, match="was aborted after an earlier failure"), comm.group(flush=6):
        comm.reduce(buf[:4], 0)
    assert sim.nccl.calls_of(0).count("abort") == 1 and sim.nccl.use_after_free == []


def test_any_error_inside_a_group_ends_it_before_the_abort(sim):
    comm, buf = _grouped(sim)
    with pytest.raises(ValueError, match="not a collective"), comm.group(flush=2):
        comm.reduce(buf[:4], 0)
        raise ValueError("not a collective")
    assert sim.nccl.calls_of(0) == ["groupStart", "reduce", "groupEnd", "abort"]
    assert sim.nccl.use_after_free == []


def test_a_failing_group_end_aborts_after_it_once(sim):
    comm, buf = _grouped(sim)
    sim.nccl.inject("groupEnd", sim_nccl.REMOTE_ERROR)
    with pytest.raises(RuntimeError, match=r"owner_reduce NCCL groupEnd \(2 calls\) failed on rank 0"):
        with comm.group(flush=3):
            comm.reduce(buf[:4], 0)
            comm.reduce(buf[4:], 0)
    assert sim.nccl.calls_of(0) == ["groupStart", "reduce", "reduce", "groupEnd failed", "abort"]
    assert not comm.in_group and sim.nccl.use_after_free == []


def test_a_failing_group_start_opens_nothing_and_aborts_at_once(sim):
    comm, _ = _grouped(sim)
    sim.nccl.inject("groupStart", sim_nccl.REMOTE_ERROR)
    with pytest.raises(RuntimeError, match=r"owner_reduce NCCL groupStart failed on rank 0"), comm.group(flush=1):
        raise AssertionError("not reached: the group never opened")
    assert sim.nccl.calls_of(0) == ["groupStart failed", "abort"] and not comm.in_group


@pytest.mark.timeout(60)
def test_an_abort_that_does_not_return_after_a_failed_call_is_a_note_on_the_first_error(sim):
    """cupy's ``abort()`` never raises (``nccl.pyx`` declares ``ncclCommAbort`` void), so what can go wrong with it is
    that it does not return: the communicator's last kernel sits behind a kernel that never finishes. The failed
    call's error is still the one raised, within the abort bound, and the abort's timeout is a note on it. (Until
    issue 46 the sim could make an abort raise, which the real stack cannot.)"""
    comm, buf = _grouped(sim)
    comm.watchdog.abort_bound_s = 0.3
    release = sim.stall()  # a kernel outside the communicator that never finishes (until released)
    comm.all_reduce(buf[4:])  # the communicator's last kernel: queued behind it
    sim.nccl.inject("reduce", sim_nccl.REMOTE_ERROR)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reduce\(root=0, count=4, dtype=float32\) failed") as caught:
        with comm.group(flush=1):
            comm.reduce(buf[:4], 0)
    assert time.monotonic() - started < 0.3 + 2.0
    assert sim.nccl.calls_of(0) == ["allReduce", "groupStart", "reduce failed", "groupEnd failed", "abort"]
    assert any(re.search(r"aborting the NCCL communicator failed too: TimeoutError: owner_reduce: the abort of the "
                        r"[a-z -]+ communicator did not return within 0\.3 s", n) for n in caught.value.__notes__)
    member = sim.nccl.comms(rank=0)[0]
    assert not member.freed  # its abort still waits
    release.set()
    deadline = time.monotonic() + 10
    while not member.freed:
        assert time.monotonic() < deadline, "the abort returned once the stalled kernel finished"
        time.sleep(0.02)


def test_negative_control_an_abort_inside_the_open_group_is_a_use_after_free(sim):
    """What the product avoids (``nccl_comm`` Note (abort inside a group)): aborting a communicator the thread's open
    group holds frees it under the group, and NCCL's group end walks the freed memory (a crash on a GPU)."""
    comm, buf = _grouped(sim)
    nccl = sim_nccl
    nccl.groupStart()
    comm._comm.reduce(buf.data_ptr(), buf.data_ptr(), 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0, 0)
    comm._comm.abort()
    with pytest.raises(SimUseAfterFree, match="which abort\\(\\) freed while this group held it"):
        nccl.groupEnd()
    assert len(sim.nccl.use_after_free) == 1


# ---- names: the global rank, the data-parallel root, the communicator, the flush (issue 31) ---------------------


def test_a_failed_cupy_rail_call_names_the_global_rank_the_data_parallel_root_and_the_rail(sim):
    comm, buf = _grouped(sim)
    comm.role, comm.members, comm.global_rank = "rail", (1, 3), 3
    comm.rank = 1
    sim.nccl.inject("reduce", sim_nccl.REMOTE_ERROR)
    with pytest.raises(RuntimeError) as caught, comm.group(flush=5):
        comm.reduce(buf[:4], 0)
    assert str(caught.value).startswith(
        "owner_reduce NCCL reduce(root=0 = data-parallel rank 1, count=4, dtype=float32) on the rail communicator "
        "failed on rank 3, flush #5: NcclError: NCCL_ERROR_REMOTE_ERROR")


@pytest.mark.timeout(60)
def test_a_stalled_cupy_rail_fails_the_data_parallel_wait_naming_its_call_and_flush(sim):
    """Before: the data-parallel communicator's stale flush number and no call (cupy keeps no works)."""
    (dp,) = _comms(sim, 1)
    dp.flush = 2  # the last flush issued on the data-parallel communicator itself
    rails = _comms(sim, 2)
    rail = rails[0]
    rail.role, rail.members = "rail", (0, 2)
    dp.subs.append(rail)

    def flush_3(rank):  # both rail ranks: completes
        buf = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        with rails[rank].group(flush=3):
            rails[rank].reduce(buf, 0)

    sim.run_ranks(flush_3, 2)
    buf = torch.ones(8, dtype=torch.bfloat16, device="cuda")
    with rail.group(flush=4):  # rank 1 of the rail never joins
        rail.reduce(buf[:4], 1)
        rail.reduce(buf[4:], 1)
    with pytest.raises(OwnerReduceCommError) as caught:
        dp.wait_until(lambda: True, "end_backward")
    assert str(caught.value).startswith(
        "owner_reduce: rank 0, flush #4: end_backward, waiting for reduce(root=1 = data-parallel rank 2, count=4, "
        "dtype=bfloat16) (call 1 of 2) on the rail communicator timed out")
    assert dp._comm is None and rail._comm is None  # every level aborted


def test_a_group_leader_that_cannot_create_a_unique_id_fails_every_rank_of_the_split(sim, monkeypatch):
    (comm,) = _comms(sim, 1)
    comm.world_size = 2
    monkeypatch.setattr(nccl_binding, "new_unique_id", lambda: (_ for _ in ()).throw(RuntimeError("no socket")))
    sent = []

    def gather(values):
        sent.append(values)
        return [list(values), [1] + [7] * nccl_binding.UNIQUE_ID_BYTES]  # rank 1 (not a leader) is fine

    comm.all_gather_ints = gather
    with pytest.raises(RuntimeError, match=r"data-parallel rank 0 could not create an NCCL unique id for a node or "
                                           r"rail communicator: RuntimeError: no socket"):
        comm._split([[0, 1]])
    assert sent[0][0] == 0 and len(sent[0]) == 1 + nccl_binding.UNIQUE_ID_BYTES  # the status went out with the gather


def test_a_peer_that_never_joins_the_communicator_blocks_its_creation(sim):
    """ncclCommInitRank waits for every rank (deadline Note (a blocking init)): a rank alone never returns; the
    product bounds it by ending the process at the deadline, the sim by its hang bound."""
    sim.hang_bound_s = 0.3
    with pytest.raises(SimHang, match=r"ncclCommInitRank \(rank 0 of 2\).*waiting for ranks \[1\] to join"):
        nccl_comm.CupyNcclComm(nccl_binding.new_unique_id(), 0, 2)
