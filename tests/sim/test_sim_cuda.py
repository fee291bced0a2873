"""The simulated device itself (``sim_cuda``, ``sim_nccl``): CUDA's asynchrony, events, waits, the launch bound and
the virtual clock; NCCL's matching, mismatch reports, per-communicator order across streams, abort and destroy
semantics, faults. Each mechanism with the behaviour that tells it from a fake that answers at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support.sim.cuda import Sim, SimError, SimHang, sim_fixture  # noqa: F401 - sim_fixture: the `sim` fixture
from tests.support.sim.nccl import NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_INT64, NCCL_SUM, NcclError, SimMismatch


def _nccl():
    from cupy.cuda import nccl

    return nccl


# ---- streams, events, the clock ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_stream_runs_its_ops_in_order_after_the_host_returned(sim):
    x = torch.zeros(4, device="cuda")
    stream = torch.cuda.current_stream()
    stream.synchronize()  # the fill has run: the queue below holds exactly what follows (its worker races the host)
    release = sim.stall()
    x.add_(1)
    x.mul_(3)
    assert not stream.query() and len(stream.queue) == 3  # the host returned; nothing ran yet
    release.set()
    assert x.cpu().tolist() == [3.0] * 4  # (0 + 1) * 3: in order
    assert stream.query()


@pytest.mark.timeout(60)
def test_events_and_cross_stream_waits_order_work_as_cuda_does(sim):
    side = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    x = torch.zeros(4, device="cuda")
    release = sim.stall(compute)
    x.add_(1)  # behind the stall on compute
    event = torch.cuda.Event()
    assert event.query()  # never recorded: complete
    event.record(compute)
    side.wait_event(event)
    event.record(side)  # a wait took the record it saw when enqueued, not this one
    with torch.cuda.stream(side):
        y = x * 2
    assert not side.query() and not event.query()
    release.set()
    side.synchronize()
    with torch.cuda.stream(side):
        assert y.cpu().tolist() == [2.0] * 4
    free = torch.cuda.Stream()
    blocked = sim.stall(compute)
    with torch.cuda.stream(free):  # a stream that waits for nothing runs past a stalled one
        z = torch.ones(2, device="cuda") + 1
        assert z.cpu().tolist() == [2.0, 2.0]
    blocked.set()


@pytest.mark.timeout(60)
def test_the_virtual_clock_times_kernels_and_waits_exactly():
    with Sim(max_ranks=1) as sim:
        compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        sim.kernel(0.002, name="layer 1")
        sim.kernel(0.003, name="layer 2")
        mid = compute.record_event(torch.cuda.Event(enable_timing=True))
        side.wait_event(mid)
        with torch.cuda.stream(side):
            sim.kernel(0.004, name="reduction")
        end = torch.cuda.Event(enable_timing=True)
        end.record(side)
        end.synchronize()
        assert start.elapsed_time(mid) == pytest.approx(5.0) and mid.elapsed_time(end) == pytest.approx(4.0)
        untimed = torch.cuda.Event()
        untimed.record()
        untimed.synchronize()
        with pytest.raises(RuntimeError, match="without enable_timing"):
            start.elapsed_time(untimed)
        assert sim.process(0).host_time == pytest.approx(0.009)  # the host waited for the side stream's end
        late = torch.cuda.Stream()
        sim.kernel(0.001, name="more compute")
        done = compute.record_event(torch.cuda.Event(enable_timing=True))
        while not done.last.done:  # it has run (seen inside the sim): the wait below still starts after its time
            time.sleep(0.001)
        late.wait_event(done)
        with torch.cuda.stream(late):
            after = late.record_event(torch.cuda.Event(enable_timing=True))
        after.synchronize()
        assert after.time == pytest.approx(0.010)


@pytest.mark.timeout(60)
def test_a_full_launch_queue_blocks_the_host_until_the_hang_bound():
    with Sim(launch_bound=8, hang_bound_s=0.5) as sim:
        release = sim.stall()
        x = torch.zeros(1, device="cuda")
        for _ in range(6):  # the stall, the fill of zeros and six adds: eight pending
            x.add_(1)
        with pytest.raises(SimHang, match=r"a launch onto r0/default, whose launch queue is full \(8 pending"):
            x.add_(1)
        assert "head a stalled kernel" in sim.hangs[-1]
        release.set()
        x.add_(1)  # room again
        assert x.item() == 7.0


@pytest.mark.timeout(60)
def test_host_values_and_copies_synchronize_the_stream_and_non_blocking_ones_do_not():
    with Sim(hang_bound_s=0.5) as sim:
        x = torch.ones(4, device="cuda")
        release = sim.stall()
        y = torch.arange(4.0).to("cuda", non_blocking=True)  # enqueued: returns at once
        assert sim.counters["blocking copy"] == 0
        with pytest.raises(SimHang, match="a blocking host-to-device copy of 3 elements"):
            torch.tensor([1, 2, 3], device="cuda")
        with pytest.raises(SimHang, match="a device-to-host copy"):
            x.cpu()
        with pytest.raises(SimHang, match="a value for the host"):
            x.sum().item()
        release.set()
        assert y.cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and sim.counters["blocking copy"] == 1
        assert torch.equal(x, x) and float(x[0]) == 1.0


def test_an_op_without_metadata_runs_at_once_and_is_counted(sim):
    x = torch.tensor([0.0, 2.0, 0.0, 3.0], device="cuda")
    assert sim.fallbacks == {}
    assert x.nonzero().cpu().flatten().tolist() == [1, 3]
    assert sim.fallbacks["nonzero"] == 1


def test_device_tensors_look_like_cuda_tensors_and_refuse_what_cuda_would(sim):
    x = torch.zeros(6, device="cuda")
    assert x.is_cuda and x.device == torch.device("cuda", 0) and x.__class__ is torch.Tensor
    assert torch.cuda.is_available() and torch.cuda.device_count() == 8
    v = x.narrow(0, 2, 3)
    assert v._base is x and v.data_ptr() == x.data_ptr() + 8
    with pytest.raises(RuntimeError, match="same device"):
        x.add_(torch.ones(6))
    with pytest.raises(SimError, match="lie in no live allocation"):
        sim.resolve(x.data_ptr() + 100, 4, 0)  # inside the 512-byte block, past the tensor's 24 bytes


# ---- NCCL --------------------------------------------------------------------------------------------------------


def _comms(sim, ws, uid=None):
    """A communicator per rank (built on the ranks' threads, as ncclCommInitRank blocks until all joined)."""
    nccl = _nccl()
    uid = uid or nccl.get_unique_id()
    return sim.run_ranks(lambda rank: nccl.NcclCommunicator(ws, uid, rank), ws)


def _ptr(t):
    return t.data_ptr()


@pytest.mark.timeout(60)
def test_collectives_and_send_recv_move_real_data_deterministically(sim):
    nccl = _nccl()
    ws = 3
    comms = _comms(sim, ws)

    def step(rank):
        comm, s = comms[rank], torch.cuda.current_stream().cuda_stream
        buf = torch.arange(12, dtype=torch.float32, device="cuda") * (rank + 1)
        out = torch.zeros(3 * 4, dtype=torch.int64, device="cuda")
        mine = torch.full((4,), rank, dtype=torch.int64, device="cuda")
        nccl.groupStart()
        comm.allReduce(_ptr(buf), _ptr(buf), 3, NCCL_FLOAT32, NCCL_SUM, s)
        comm.reduce(_ptr(buf) + 12, _ptr(buf) + 12, 3, NCCL_FLOAT32, NCCL_SUM, 2, s)
        comm.reduceScatter(_ptr(buf[6:]), _ptr(buf[6:]) + 8 * rank, 2, NCCL_FLOAT32, NCCL_SUM, s)
        nccl.groupEnd()
        comm.allGather(_ptr(mine), _ptr(out), 4, NCCL_INT64, s)
        ring = torch.full((2,), float(rank), device="cuda")
        got = torch.zeros(2, device="cuda")
        nccl.groupStart()  # each rank sends to the next and receives from the previous: one grouped round
        comm.send(_ptr(ring), 2, NCCL_FLOAT32, (rank + 1) % ws, s)
        comm.recv(_ptr(got), 2, NCCL_FLOAT32, (rank - 1) % ws, s)
        nccl.groupEnd()
        return buf.cpu(), out.cpu().tolist(), got.cpu().tolist()

    results = sim.run_ranks(step, ws)
    base = torch.arange(12, dtype=torch.float32)
    for rank, (buf, gathered, got) in enumerate(results):
        assert torch.equal(buf[:3], base[:3] * 6)  # all ranks: 1 + 2 + 3
        assert torch.equal(buf[3:6], base[3:6] * (6 if rank == 2 else rank + 1))  # the root only
        assert torch.equal(buf[6 + 2 * rank:8 + 2 * rank], base[6 + 2 * rank:8 + 2 * rank] * 6)  # its block
        assert gathered == [0] * 4 + [1] * 4 + [2] * 4
        assert got == [float((rank - 1) % ws)] * 2
    assert sim.counters["nccl kernel"] == 3 * ws


@pytest.mark.timeout(60)
def test_ranks_that_issue_different_calls_are_reported_naming_each_call():
    with Sim(lazy_connect=False) as sim:  # connected at creation: mismatched kinds would wait in different setups
        _ranks_that_issue_different_calls(sim)


def _ranks_that_issue_different_calls(sim):
    comms = _comms(sim, 2)
    barrier = threading.Barrier(2)

    def step(rank):
        buf = torch.zeros(8, dtype=torch.bfloat16, device="cuda")
        if rank == 1:
            barrier.wait()  # rank 0 posts first: rank 1's call completes the set
        comms[rank].reduce(_ptr(buf), _ptr(buf), 8, NCCL_BFLOAT16, NCCL_SUM, rank, 0)
        if rank == 0:
            barrier.wait()
            torch.cuda.synchronize()
            comms[0].check_async_error()

    errors = sim.run_ranks(step, 2, raise_first=False)
    assert isinstance(errors[1], SimMismatch), errors
    (text,) = sim.nccl.mismatches
    assert "call #1 on communicator" in text
    assert ("differs across ranks: rank 0: reduce(root=0, count=8, dtype=bfloat16); rank 1: reduce(root=1, count=8, "
            "dtype=bfloat16)") in text
    assert isinstance(errors[0], NcclError) and "INVALID_USAGE" in str(errors[0])  # its kernel failed


@pytest.mark.timeout(60)
def test_a_communicators_kernels_run_in_launch_order_across_streams(sim):
    """NCCL serializes a communicator's work: a kernel on a free stream waits for the same communicator's earlier
    kernel queued behind a stall on another stream."""
    comms = _comms(sim, 2)

    def step(rank):
        a, b = torch.cuda.current_stream(), torch.cuda.Stream()
        x, y = torch.ones(2, device="cuda"), torch.ones(2, device="cuda")
        release = sim.stall(a) if rank == 0 else None
        comms[rank].allReduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, a.cuda_stream)
        comms[rank].allReduce(_ptr(y), _ptr(y), 2, NCCL_FLOAT32, NCCL_SUM, b.cuda_stream)
        if rank == 0:
            assert not b.query()  # behind the first kernel, which is behind the stall
            release.set()
        b.synchronize()
        return y.cpu().tolist()

    assert sim.run_ranks(step, 2) == [[2.0, 2.0]] * 2


@pytest.mark.timeout(60)
def test_the_work_fifo_bound_blocks_the_host_in_the_nccl_call():
    with Sim(hang_bound_s=0.5, fifo_bound=4) as sim:
        nccl = _nccl()
        (comm,) = _comms(sim, 1)
        release = sim.stall()
        x = torch.ones(1, device="cuda")
        for _ in range(4):
            comm.allReduce(_ptr(x), _ptr(x), 1, NCCL_FLOAT32, NCCL_SUM, 0)
        with pytest.raises(SimHang, match=r"whose work FIFO is full \(4 kernels pending"):
            comm.allReduce(_ptr(x), _ptr(x), 1, NCCL_FLOAT32, NCCL_SUM, 0)
        release.set()
        torch.cuda.synchronize()
        assert nccl is not None


def _two_comms_one_spinning(sim):
    """Rank 0 of two: communicator Y's kernel spins on its stream (rank 1 never calls it); communicator X's kernel is
    queued behind it on the same stream, and rank 1's X kernel spins waiting for it."""
    nccl = _nccl()
    ux, uy = nccl.get_unique_id(), nccl.get_unique_id()
    pairs = sim.run_ranks(lambda rank: (nccl.NcclCommunicator(2, ux, rank), nccl.NcclCommunicator(2, uy, rank)), 2)

    def issue(rank):
        x, y = pairs[rank]
        buf = torch.ones(4, device="cuda")
        if rank == 0:
            y.allReduce(_ptr(buf), _ptr(buf), 4, NCCL_FLOAT32, NCCL_SUM, 0)
        x.allReduce(_ptr(buf), _ptr(buf), 4, NCCL_FLOAT32, NCCL_SUM, 0)

    sim.run_ranks(issue, 2)
    return pairs


@pytest.mark.timeout(60)
def test_aborting_a_communicator_whose_last_kernel_waits_behind_another_ones_spinning_kernel_hangs():
    """Issue 37 finding 2 at the mechanism level: ncclCommAbort(X) waits for X's last kernel, queued behind Y's
    spinning kernel: it never returns."""
    with Sim(lazy_connect=False, hang_bound_s=0.5) as sim:
        pairs = _two_comms_one_spinning(sim)
        x, _ = pairs[0]
        with pytest.raises(SimHang, match=r"ncclCommAbort on rank 0 of communicator #\d+ \(2 ranks\).*waiting for its "
                                          r"last kernel"):
            x.abort()
        assert "spins in allReduce(count=4, dtype=float32)" in sim.hangs[-1]


@pytest.mark.timeout(60)
def test_aborting_both_communicators_concurrently_returns():
    with Sim(lazy_connect=False, hang_bound_s=2.0) as sim:
        pairs = _two_comms_one_spinning(sim)
        x, y = pairs[0]
        done = []

        def abort(comm):
            with sim.bind(0):
                comm.abort()
                done.append(comm)

        threads = [threading.Thread(target=abort, args=(c,)) for c in (x, y)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert len(done) == 2 and sim.hangs == []
        assert x.member.aborted and y.member.aborted
        stream = torch.cuda.current_stream()
        stream.synchronize()  # both kernels exited


@pytest.mark.timeout(60)
def test_destroy_waits_for_the_kernels_to_finish_and_abort_does_not_wait_for_peers():
    with Sim(lazy_connect=False, hang_bound_s=0.5) as sim:
        nccl = _nccl()
        comms = _comms(sim, 2)
        x = torch.ones(2, device="cuda")
        comms[0].allReduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, 0)  # rank 1 never joins
        with pytest.raises(SimHang, match="ncclCommDestroy on rank 0"):
            comms[0].destroy()
        comms[0].abort()  # its spinning kernel exits: returns
        assert comms[0].member.freed and not comms[1].member.aborted
        with pytest.raises(NcclError, match="INVALID_ARGUMENT"):
            comms[0].allReduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, 0)
        comms[1].check_async_error()  # NVLink by default: the peer hears nothing
        assert nccl is not None


@pytest.mark.timeout(60)
def test_an_abort_reaches_the_peers_on_a_network_and_an_injected_error_is_asynchronous():
    with Sim(hang_bound_s=0.5, abort_reaches_peers=True) as sim:
        comms = _comms(sim, 2)
        comms[0].abort()
        with pytest.raises(NcclError, match="NCCL_ERROR_REMOTE_ERROR"):
            comms[1].check_async_error()
        (other,) = _comms(sim, 1)
        sim.nccl.async_error(other.member, 3)
        with pytest.raises(NcclError, match="INTERNAL_ERROR"):
            other.check_async_error()


def test_injected_call_failures_and_non_blocking_communicators_fail_as_cupy_does(sim, monkeypatch):
    nccl = _nccl()
    (comm,) = _comms(sim, 1)
    x = torch.ones(2, device="cuda")
    sim.nccl.inject("allReduce", 6, nth=2)
    comm.allReduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, 0)
    with pytest.raises(NcclError, match="NCCL_ERROR_REMOTE_ERROR"):
        comm.allReduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, 0)
    sim.nccl.inject("reduce", 2)
    nccl.groupStart()
    with pytest.raises(NcclError, match="SYSTEM_ERROR"):
        comm.reduce(_ptr(x), _ptr(x), 2, NCCL_FLOAT32, NCCL_SUM, 0, 0)
    with pytest.raises(NcclError, match="SYSTEM_ERROR"):  # NCCL reports the failed enqueue again, launches nothing
        nccl.groupEnd()
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    with pytest.raises(KeyError, match="7"):  # ncclInProgress: cupy 14's NcclError has no name for it
        nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)


def test_misaligned_pointers_are_counted(sim):
    (comm,) = _comms(sim, 1)
    x = torch.ones(16, dtype=torch.bfloat16, device="cuda")
    comm.allReduce(_ptr(x), _ptr(x), 8, NCCL_BFLOAT16, NCCL_SUM, 0)  # 16-byte aligned
    comm.allReduce(_ptr(x[3:]), _ptr(x[3:]), 8, NCCL_BFLOAT16, NCCL_SUM, 0)  # 6 bytes past it
    assert sim.counters["nccl misaligned"] == 1 and "allReduce(count=8)" in sim.nccl.misaligned[0]


@pytest.mark.timeout(60)
def test_nccl_kernels_take_their_modelled_time_and_a_communicators_delay():
    """An AllReduce of 4096 bytes at 10 us + bytes / 1 GB/s, on a communicator slowed by 1 ms per kernel, after a
    2 ms compute kernel on one rank: both ranks' kernels start when the later rank arrives (2 ms) and end 1.0141 ms
    later on both, as the events around them say."""
    with Sim(latency_s=10e-6, bandwidth=1e9) as sim:
        comms = _comms(sim, 2)
        comms[0].member.group.delay_s = 1e-3

        def step(rank):
            x = torch.ones(1024, device="cuda")
            if rank == 1:
                sim.kernel(0.002, name="layer")
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            comms[rank].allReduce(_ptr(x), _ptr(x), 1024, NCCL_FLOAT32, NCCL_SUM, 0)
            end.record()
            end.synchronize()
            return start.time, end.time

        (s0, e0), (s1, e1) = sim.run_ranks(step, 2)
        assert (s0, s1) == (0.0, pytest.approx(0.002))
        assert e0 == e1 == pytest.approx(0.002 + 10e-6 + 4096 / 1e9 + 1e-3)


# ---- happens-before ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_missing_wait_is_a_race_even_when_the_scheduling_hid_it():
    with Sim(hb=True, max_ranks=1) as sim:
        side = torch.cuda.Stream()
        sim.name_stream(side, "side")
        x = torch.zeros(8, device="cuda")
        sim.name(x, "x")
        while torch.cuda.current_stream().queue:  # the zeros have run (seen inside the sim, no CUDA call): the
            time.sleep(0.001)  # scheduling leaves nothing to race, but nothing orders the side stream after them
        with torch.cuda.stream(side):
            x.add_(1)
        assert any("race on x" in r and "on default" in r and "on side" in r for r in sim.races), sim.hb_report()
        sim.races.clear()
        side.wait_stream(torch.cuda.current_stream())
        event = torch.cuda.Event()
        event.record(side)
        torch.cuda.current_stream().wait_event(event)
        x.mul_(2)  # after the side stream's add: ordered by the event
        assert not sim.races, sim.hb_report()
