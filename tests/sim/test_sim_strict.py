"""What the real stack does that a lenient simulated device would let pass (issue 46, finding 8):

- Pinned host memory and non-blocking device-to-host copies. CUDA runs ``copy_(device_tensor, non_blocking=True)``
  into pinned memory when the stream reaches it, and the host returns at once; into pageable memory the copy is
  synchronous. The sim now does both (torch's CPU build has no pinned memory: the sim's ``pin_memory`` is), and a
  pinned destination holds a poison pattern until its copy ran, so a reader that did not wait reads garbage, is
  counted, and (``hb=True``) is a race. The product's three such copies (``CupyNcclComm.all_gather_ints``,
  ``exchange_unique_id``'s broadcast on the device, ``TorchDistComm.all_gather_ints``) wait for them: shown here, and
  each wait removed in a negative control is caught.
- A group's calls run at once in NCCL: buffers that overlap between them (or between one call's send and receive,
  other than NCCL's in-place forms) give undefined results. The sim refuses them (``SimOverlap``)."""

from __future__ import annotations

import re
import sys
import threading
import types
from typing import Any

import pytest
import torch

from owner_reduce.runtime import deadline as deadlines
from owner_reduce.runtime import nccl_binding, nccl_comm
from owner_reduce.runtime.deadline import Deadline
from owner_reduce.runtime.host_memory import pinned
from owner_reduce.runtime.torch_comm import TorchDistComm
from tests.support.sim.cuda import POISON_BYTE, Sim, SimHang, sim_fixture  # noqa: F401 - sim_fixture: the `sim` fixture
from tests.support.sim.nccl import SimOverlap
from tests.support.tdist import SimTdist

POISON_INT64 = int.from_bytes(bytes([POISON_BYTE]) * 8, "little", signed=True)


@pytest.fixture(autouse=True)
def _no_flush_watchdog(monkeypatch):
    """The copies' waits are the subject; the flush watchdog (tests/sim/test_watchdog*.py) is not armed here."""
    from owner_reduce.runtime.watchdog import FlushWatchdog

    monkeypatch.setattr(FlushWatchdog, "arm", lambda self: None)


# ---- the mechanism ---------------------------------------------------------------------------------------------


def test_pinned_host_memory_is_modelled_and_the_products_pinned_helper_gets_it():
    outside = torch.arange(3)
    assert pinned(outside) is outside  # torch's CPU build: no pinned allocator, the helper falls back
    with Sim():
        host = torch.arange(3)
        pin = host.pin_memory()
        assert pin.is_pinned() and not host.is_pinned() and torch.equal(pin, host)
        assert pin.pin_memory() is pin and pin[1:].is_pinned()  # pinned already; a view of pinned memory is pinned
        assert torch.empty(4, pin_memory=True).is_pinned()
        assert pinned(host).is_pinned()
        with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
            torch.ones(2, device="cuda").pin_memory()
        assert not torch.ones(2, device="cuda").is_pinned()


@pytest.mark.timeout(60)
def test_a_non_blocking_copy_into_pinned_memory_lands_when_its_op_runs_and_a_read_before_is_caught():
    with Sim(hang_bound_s=0.5) as sim:
        x = torch.arange(4, device="cuda")
        host = torch.empty(4, dtype=torch.int64).pin_memory()
        release = sim.stall()
        host.copy_(x, non_blocking=True)  # enqueued behind the stalled kernel: the host returns at once
        assert sim.counters["copy (device to host, non-blocking)"] == 1 and sim.counters["copy (device to host)"] == 0
        assert host.tolist() == [POISON_INT64] * 4  # read before the copy ran: the sim's poison, not the values
        assert sim.counters["host read of a pending copy"] == 1
        assert sim.early_reads[0].startswith("the host read pinned host int64[4], bytes [0, 32), by tolist() at "
                                             "test_sim_strict.py:")
        assert "before aten.copy_ (device to host) (op #" in sim.early_reads[0]
        release.set()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert host.tolist() == [0, 1, 2, 3] and sim.counters["host read of a pending copy"] == 1
        later = x.to("cpu", non_blocking=True)  # torch's _to_copy: into pinned memory, asynchronous
        assert later.is_pinned()
        torch.cuda.current_stream().synchronize()
        assert later.tolist() == [0, 1, 2, 3]
        pageable = torch.empty(4, dtype=torch.int64)  # into pageable memory: synchronous, as CUDA's
        release = sim.stall()
        with pytest.raises(SimHang, match="a device-to-host copy of 4 elements"):
            pageable.copy_(x, non_blocking=True)
        release.set()


@pytest.mark.timeout(60)
def test_a_host_read_of_a_non_blocking_copy_it_did_not_wait_for_is_a_race_even_when_the_copy_ran():
    """The happens-before checker does not depend on timing: the copy may well have run (synchronized here by a
    stream the host never learns about), yet nothing the host waited for orders it before the read."""
    with Sim(hb=True) as sim:
        x = torch.arange(4, device="cuda")
        host = torch.empty(4, dtype=torch.int64).pin_memory()
        host.copy_(x, non_blocking=True)
        while sim._pinned_block(host).pending and not sim._pinned_block(host).pending[0][0].done:
            threading.Event().wait(0.01)  # the copy ran (the host looked, without an ordering wait)
        assert host.tolist() == [0, 1, 2, 3] and sim.counters["host read of a pending copy"] == 0
        (race,) = sim.races
        assert re.fullmatch(r"race on pinned host int64\[4\], bytes \[0, 32\): write by aten\.copy_ \(device to host\) "
                            r"on r0/default \(test_sim_strict\.py:\d+ \w+\) and read by host tolist\(\) on r0/host "
                            r"\(test_sim_strict\.py:\d+ \w+\) are unordered", race), race
        host2 = torch.empty(4, dtype=torch.int64).pin_memory()
        host2.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        while not done.query():  # the host waits for an event after the copy: ordered
            pass
        assert host2.tolist() == [0, 1, 2, 3] and len(sim.races) == 1


# ---- the product's non-blocking copies wait for their op --------------------------------------------------------


def _cupy_comms(sim: Sim, ws: int) -> list[nccl_comm.CupyNcclComm]:
    uid = nccl_binding.new_unique_id()
    comms = sim.run_ranks(lambda rank: nccl_comm.CupyNcclComm(uid, rank, ws), ws)
    for comm in comms:
        comm.set_deadline(Deadline(10, "test"))
    return comms


def _gather_on_the_cupy_path(sim: Sim) -> list[list[list[int]]]:
    comms = _cupy_comms(sim, 2)
    return sim.run_ranks(lambda rank: comms[rank].all_gather_ints([rank, 10 + rank, -rank]), 2)


@pytest.mark.timeout(60)
def test_cupy_all_gather_ints_waits_for_its_copy_to_the_host():
    with Sim(hb=True) as sim:
        rows = _gather_on_the_cupy_path(sim)
        assert rows == [[[0, 10, 0], [1, 11, -1]]] * 2
        assert sim.counters["copy (device to host, non-blocking)"] == 2  # asynchronous (pinned): one per rank
        assert sim.counters["blocking copy"] == 0 and sim.counters["copy (device to host)"] == 0
        assert sim.counters["host read of a pending copy"] == 0 and sim.races == {}, sim.hb_report()


@pytest.mark.timeout(60)
def test_negative_control_cupy_all_gather_ints_without_the_wait_for_its_copy_reads_poison(monkeypatch):
    """The wait for the copy to the host removed, and a kernel still running ahead of that copy: every rank's rows
    are the sim's poison, the early read is counted, and the checker reports the race."""
    with Sim(hb=True) as sim:
        original = nccl_comm.CupyNcclComm._wait_for_event
        releases: list[threading.Event] = []

        def lost_wait(self, stream, what):
            if what.endswith("its copy to the host"):
                return
            original(self, stream, what)
            releases.append(sim.stall(stream))  # the copy issued next sits behind it

        monkeypatch.setattr(nccl_comm.CupyNcclComm, "_wait_for_event", lost_wait)
        rows = _gather_on_the_cupy_path(sim)
        assert rows == [[[POISON_INT64] * 3] * 2] * 2
        assert sim.counters["host read of a pending copy"] == 2
        assert all("by tolist() at runtime/nccl_comm.py:" in text for text in sim.early_reads)
        races = list(sim.races)
        assert len(races) == 2 and all("write by aten.copy_ (device to host)" in r and "read by host tolist()" in r
                                       for r in races), sim.hb_report()
        for release in releases:
            release.set()


def _fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``deepspeed.accelerator.get_accelerator()`` answering CUDA (TorchDistComm's all_gather_ints asks it), without
    importing DeepSpeed."""
    accelerator = types.SimpleNamespace(current_device_name=lambda: f"cuda:{torch.cuda.current_device()}")
    package = types.ModuleType("deepspeed")
    module = types.ModuleType("deepspeed.accelerator")
    module.get_accelerator = lambda: accelerator
    package.accelerator = module
    monkeypatch.setitem(sys.modules, "deepspeed", package)
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", module)


def _gather_on_the_torch_path(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    _fake_accelerator(monkeypatch)
    tdist = SimTdist(sim, 0, [[0, 0, 0], [1, 11, -1]])
    comm = TorchDistComm(tdist.world, tdist=tdist)
    comm.set_deadline(Deadline(10, "test"))
    return comm.all_gather_ints([7, 10, 0])


@pytest.mark.timeout(60)
def test_torch_dist_all_gather_ints_on_nccl_waits_for_its_copy_to_the_host(monkeypatch):
    with Sim(hb=True) as sim:
        assert _gather_on_the_torch_path(sim, monkeypatch) == [[7, 10, 0], [1, 11, -1]]
        assert sim.counters["copy (device to host, non-blocking)"] == 1 and sim.counters["blocking copy"] == 0
        assert sim.counters["host read of a pending copy"] == 0 and sim.races == {}, sim.hb_report()


@pytest.mark.timeout(60)
def test_negative_control_torch_dist_all_gather_ints_without_the_wait_for_its_copy_reads_poison(monkeypatch):
    with Sim(hb=True) as sim:
        original = TorchDistComm.wait_until
        releases: list[threading.Event] = []

        def lost_wait(self, done, call, flush=None):
            if call.endswith("its copy to the host"):
                return
            original(self, done, call, flush)
            releases.append(sim.stall())  # the copy issued next sits behind it

        monkeypatch.setattr(TorchDistComm, "wait_until", lost_wait)
        assert _gather_on_the_torch_path(sim, monkeypatch) == [[POISON_INT64] * 3] * 2
        assert sim.counters["host read of a pending copy"] == 1 and len(sim.races) == 1, sim.hb_report()
        assert "by tolist() at runtime/torch_comm.py:" in sim.early_reads[0]
        for release in releases:
            release.set()


UID = bytes(range(128))


def _exchange_on_device(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Rank 1 of two receives rank 0's unique id over an NCCL process group (``_broadcast_on_device``)."""
    import torch.distributed as dist

    tdist = SimTdist(sim, 1, [[1, *UID], [0] * 129])
    for name in ("get_rank", "get_global_rank", "get_backend", "broadcast"):
        monkeypatch.setattr(dist, name, getattr(tdist, name))
    return nccl_binding.exchange_unique_id(tdist.world)


@pytest.mark.timeout(60)
def test_the_unique_ids_broadcast_on_the_device_waits_for_its_copy_to_the_host(monkeypatch):
    with Sim(hb=True) as sim:
        assert _exchange_on_device(sim, monkeypatch) == UID
        assert sim.counters["copy (device to host, non-blocking)"] == 1 and sim.counters["blocking copy"] == 0
        assert sim.counters["host read of a pending copy"] == 0 and sim.races == {}, sim.hb_report()


@pytest.mark.timeout(60)
def test_negative_control_the_unique_ids_broadcast_without_the_wait_for_its_copy_fails_loudly(monkeypatch):
    """The status byte read before the copy ran is the poison, not 1: the product's own check refuses the id."""
    with Sim(hb=True) as sim:
        original = deadlines.poll_until_done
        releases: list[threading.Event] = []

        def lost_wait(done, *, call, **kwargs):
            if call.endswith("its copy to the host"):
                return
            original(done, call=call, **kwargs)
            releases.append(sim.stall())  # the copy issued next sits behind it

        monkeypatch.setattr(deadlines, "poll_until_done", lost_wait)
        with pytest.raises(RuntimeError, match="group rank 0 could not create an NCCL unique id"):
            _exchange_on_device(sim, monkeypatch)
        assert sim.counters["host read of a pending copy"] == 1 and len(sim.races) == 1, sim.hb_report()
        assert "by __int__() at runtime/nccl_binding.py:" in sim.early_reads[0]
        for release in releases:
            release.set()


# ---- overlapping buffers in one group ------------------------------------------------------------------------


def _raw_comm(sim: Sim, ws: int = 1) -> Any:
    nccl = sys.modules["cupy.cuda.nccl"]  # the sim's, while installed
    uid = nccl.get_unique_id()
    return nccl, sim.run_ranks(lambda rank: nccl.NcclCommunicator(ws, uid, rank), ws)


def test_a_group_whose_calls_overlap_is_refused_naming_both_calls(sim):
    nccl, (comm,) = _raw_comm(sim)
    buf = torch.zeros(16, device="cuda")
    sim.name(buf, "bucket")
    p, f32, add = buf.data_ptr(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM
    nccl.groupStart()
    comm.allReduce(p, p, 8, f32, add, 0)
    with pytest.raises(SimOverlap) as caught:
        comm.reduce(p + 16, p + 16, 8, f32, add, 0, 0)
    assert str(caught.value).startswith(
        "one NCCL group runs allReduce(count=8, dtype=float32) on rank 0 of communicator #"), str(caught.value)
    assert (f"which writes bytes [0, 32) of bucket at {p:#x}, and reduce(root=0, count=8, dtype=float32) on rank 0 "
            f"of communicator #") in str(caught.value)
    assert f"which writes bytes [16, 48) of bucket at {p:#x}, at once: their buffers overlap" in str(caught.value)
    assert sim.nccl.overlaps == [str(caught.value)]
    with pytest.raises(nccl.NcclError, match="INVALID_USAGE"):  # the group failed: it launches nothing
        nccl.groupEnd()


def test_the_products_group_over_overlapping_buffers_is_refused(sim):
    (comm,) = [nccl_comm.CupyNcclComm(nccl_binding.new_unique_id(), 0, 1)]
    buf = torch.zeros(16, device="cuda")
    with pytest.raises(SimOverlap, match=r"runs all_reduce|runs allReduce\(count=8"), comm.group(flush=1):
        comm.all_reduce(buf[:8])
        comm.all_reduce(buf[4:12])
    assert len(sim.nccl.overlaps) == 1


def test_one_call_whose_send_and_receive_overlap_other_than_in_place_is_refused(sim):
    nccl, (comm,) = _raw_comm(sim)
    buf = torch.zeros(16, device="cuda")
    p, f32, add = buf.data_ptr(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM
    with pytest.raises(SimOverlap, match=r"allReduce\(count=8, dtype=float32\) on rank 0 .* reads bytes \[0, 32\) .* "
                                         r"and writes bytes \[16, 48\) .*: its send and receive buffers overlap"):
        comm.allReduce(p, p + 16, 8, f32, add, 0)
    with pytest.raises(SimOverlap, match="reduceScatter"):
        comm.reduceScatter(p, p + 8, 4, f32, add, 0)  # rank 0 of 1: in place only at sendbuf + 0
    with pytest.raises(SimOverlap, match="allGather"):
        comm.allGather(p + 16, p, 8, f32, 0)  # rank 0: in place only at recvbuf + 0
    assert len(sim.nccl.overlaps) == 3


@pytest.mark.timeout(60)
def test_nccls_in_place_forms_and_overlapping_reads_are_accepted(sim):
    """One group per rank with every in-place form on disjoint parts of one buffer; then one buffer sent to two peers
    in one group (two reads of it): all accepted, and the data is right."""
    nccl, comms = _raw_comm(sim, 2)
    f32, add = nccl.NCCL_FLOAT32, nccl.NCCL_SUM

    def flush(rank: int) -> list[float]:
        buf = torch.full((20,), float(rank + 1), device="cuda")
        p, comm = buf.data_ptr(), comms[rank]
        nccl.groupStart()
        comm.allReduce(p, p, 4, f32, add, 0)
        comm.reduce(p + 16, p + 16, 4, f32, add, 0, 0)
        comm.broadcast(p + 32, p + 32, 4, f32, 1, 0)
        comm.reduceScatter(p + 48, p + 48 + rank * 8, 2, f32, add, 0)
        comm.allGather(p + 64 + rank * 8, p + 64, 2, f32, 0)
        nccl.groupEnd()
        return buf.tolist()

    out = sim.run_ranks(flush, 2)
    assert out[0] == [3.0] * 4 + [3.0] * 4 + [2.0] * 4 + [3.0, 3.0, 1.0, 1.0] + [1.0, 1.0, 2.0, 2.0]
    assert out[1] == [3.0] * 4 + [2.0] * 4 + [2.0] * 4 + [2.0, 2.0, 3.0, 3.0] + [1.0, 1.0, 2.0, 2.0]
    nccl, comms = _raw_comm(sim, 3)

    def scatter(rank: int) -> list[float]:
        buf = torch.full((4,), float(rank + 1), device="cuda")
        p, comm = buf.data_ptr(), comms[rank]
        nccl.groupStart()
        if rank == 0:
            comm.send(p, 4, f32, 1, 0)
            comm.send(p, 4, f32, 2, 0)
        else:
            comm.recv(p, 4, f32, 0, 0)
        nccl.groupEnd()
        return buf.tolist()

    assert sim.run_ranks(scatter, 3) == [[1.0] * 4] * 3
    assert sim.nccl.overlaps == [] and sim.nccl.mismatches == []


def test_negative_control_a_send_and_a_receive_over_one_buffer_in_a_group_are_refused(sim):
    """What the accepted sends above would be with a receive into the buffer they read."""
    nccl, comms = _raw_comm(sim, 2)
    buf = torch.zeros(4, device="cuda")
    p, f32 = buf.data_ptr(), nccl.NCCL_FLOAT32
    nccl.groupStart()
    comms[0].send(p, 4, f32, 1, 0)
    with pytest.raises(SimOverlap, match=r"runs send\(peer=1, count=4, dtype=float32\) .* which reads bytes "
                                         r"\[0, 16\) .* and recv\(peer=1, count=4, dtype=float32\) .* which writes "
                                         r"bytes \[0, 16\)"):
        comms[0].recv(p, 4, f32, 1, 0)
    with pytest.raises(nccl.NcclError):
        nccl.groupEnd()
