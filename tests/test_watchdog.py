"""The flush watchdog and the concurrent abort (issue 37, findings 1-3), against small fakes of NCCL that behave as it
does where these need it: a collective whose peer stalled never completes (its event never fires) until its
communicator is aborted; an abort waits for its communicator's last kernel, which can be queued behind another
communicator's spinning kernel (so it returns only once that one is aborted too); a host thread blocked in a CUDA launch
behind the stalled stream is released when the stream drains. The product's real ``CupyNcclComm`` and ``TorchDistComm``
run on them; the simulated device (``tests/sim_cuda.py``) runs the whole runtime end to end.

Wall-clock bounds here are the claim (a failure within the deadline plus the watchdog's bounds), never a verdict by
sleeping: every wait is on an event the code under test sets, bounded so that a regression fails instead of hanging.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import nccl_comm
from owner_reduce.runtime import watchdog as watchdogs
from owner_reduce.runtime.comm import ReduceComm, TorchDistComm
from owner_reduce.runtime.deadline import BLOCKED_EXIT_CODE, Deadline

DEADLINE = Deadline(0.4, "test")
HANG_S = 20.0  # what a fake that models a hang waits before giving up (so a regression fails instead of hanging)


class Device:
    """What the fakes share: which communicators have a collective spinning (their peer stalled), and the host's
    view of the device's queue. ``drained`` is set once no communicator spins any more."""

    def __init__(self) -> None:
        self.spinning: set[str] = set()
        self.drained = threading.Event()
        self.drained.set()
        self.log: list[str] = []
        self.lock = threading.Lock()

    def stall(self, name: str) -> None:
        with self.lock:
            self.spinning.add(name)
            self.drained.clear()

    def stop(self, name: str) -> None:
        with self.lock:
            self.spinning.discard(name)
            if not self.spinning:
                self.drained.set()


class Handle:
    """cupy's ``NcclCommunicator`` for communicator ``name``: its collectives spin while ``device`` says it stalls;
    ``abort`` stops them, after waiting for ``after`` (another handle) to be aborted first where its last kernel is
    queued behind that one's spinning kernel (``init.cc`` ``commDestroySync``: finding 2)."""

    def __init__(self, device: Device, name: str, after: Handle | None = None) -> None:
        self.device, self.name, self.after = device, name, after
        self.aborted = threading.Event()
        self.destroys = 0
        self.async_error: str | None = None
        self.fail_calls = False

    def _call(self, what: str) -> None:
        self.device.log.append(f"{self.name}.{what}")
        if self.fail_calls:
            raise RuntimeError(f"NCCL_ERROR_REMOTE_ERROR in {self.name}.{what}")

    def allReduce(self, *args) -> None:  # noqa: N802 - cupy's name
        self._call("allReduce")

    def reduce(self, *args) -> None:
        self._call("reduce")

    def abort(self) -> None:
        self.device.log.append(f"{self.name}.abort")
        if self.after is not None and not self.after.aborted.wait(HANG_S):
            raise RuntimeError(f"{self.name}.abort hung behind {self.after.name}'s spinning kernel")
        self.aborted.set()
        self.device.stop(self.name)

    def destroy(self) -> None:
        self.destroys += 1

    def check_async_error(self) -> None:
        if self.async_error:
            raise RuntimeError(self.async_error)


class Event:
    """A CUDA event recorded after a group: done unless its communicator spins."""

    def __init__(self, device: Device, name: str) -> None:
        self.device, self.name = device, name

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.name not in self.device.spinning


class NcclModule:
    """cupy's ``nccl`` module: group calls, logged; ``ncclGroupEnd`` blocks while ``fifo_full`` (NCCL waiting on the
    host for its oldest kernel: ``enqueue.cc`` ``waitWorkFifoAvailable``)."""

    NCCL_SUM = 0

    def __init__(self, device: Device) -> None:
        self.device = device
        self.fifo_full = threading.Event()
        self.released = threading.Event()

    def groupStart(self) -> None:  # noqa: N802 - cupy's name
        self.device.log.append("groupStart")

    def groupEnd(self) -> None:  # noqa: N802 - cupy's name
        self.device.log.append("groupEnd")
        if self.fifo_full.is_set():
            self.released.wait(HANG_S)


class _Stream:
    cuda_stream = 0

    @staticmethod
    def query() -> bool:
        return True


def cupy_comm(device: Device, handle: Handle, rank: int = 0, world_size: int = 2) -> nccl_comm.CupyNcclComm:
    """The product's CupyNcclComm around ``handle``, on torch's current stream (no stream waits), with one CPU buffer
    known to it (its DLPack view made), so that its real issue, group, wait and abort paths run."""
    comm = nccl_comm.CupyNcclComm.__new__(nccl_comm.CupyNcclComm)
    ReduceComm.__init__(comm, rank, world_size, deadline=DEADLINE)
    comm.stream, comm.device, comm._calls_in_group, comm._comm, comm.aborted = None, 0, 0, handle, False
    comm._views, comm._group_open, comm._abort_pending = {}, False, False
    comm._issued, comm._free_events, comm._first_call, comm._sum = [], [], None, 0
    comm._make_event = lambda: Event(device, handle.name)
    comm._stream = lambda: _Stream
    comm._wait_current = comm._current_waits_for = lambda stream: None
    comm.global_rank = rank
    buf = torch.zeros(8)
    comm._views[id(buf)] = nccl_comm._BufferView(buf, None, 4096, 4, 0, 7)
    comm.buffer = buf
    return comm


def family(monkeypatch, *, order: bool = True):
    """Data-parallel rank 0's four communicators (data-parallel, node, rail, node hand-off), the sub-communicators made
    through ``split``. With ``order``, each abort but the rail's waits for another's (the data-parallel one's last
    kernel behind the rail's spinning one, the node's behind the data-parallel one's, the hand-off's behind the
    node's): no sequence of aborts one after another returns, whichever comes first."""
    device = Device()
    module = NcclModule(device)
    monkeypatch.setattr(nccl_comm, "_nccl", lambda: module)
    rail_h = Handle(device, "rail")
    dp_h = Handle(device, "data-parallel", after=rail_h if order else None)
    node_h = Handle(device, "node", after=dp_h if order else None)
    handoff_h = Handle(device, "node hand-off", after=node_h if order else None)
    dp = cupy_comm(device, dp_h, world_size=4)
    made = iter([cupy_comm(device, h, world_size=2) for h in (node_h, rail_h, handoff_h)])
    dp._split = lambda groups: next(made)
    node = dp.split([[0, 1], [2, 3]], "node")
    rail = dp.split([[0, 2], [1, 3]], "rail")
    handoff = dp.split([[0, 1], [2, 3]], "node hand-off")
    for c in (dp, node, rail, handoff):
        c.deadline = DEADLINE
    handles = {"data-parallel": dp_h, "node": node_h, "rail": rail_h, "node hand-off": handoff_h}
    return types.SimpleNamespace(device=device, module=module, dp=dp, node=node, rail=rail, handoff=handoff,
                                 handles=handles, comms=(dp, node, rail, handoff))


@pytest.fixture(autouse=True)
def _stop_watchdogs():
    yield
    watchdogs.stop_all()


def fast(watchdog: watchdogs.FlushWatchdog, **bounds: float) -> list[str]:
    """The watchdog with short bounds and a fake end of the process: what it would have written, then ended."""
    said: list[str] = []
    watchdog.poll_s, watchdog.lock_wait_s, watchdog.group_wait_s = 0.02, 0.3, 1.0
    watchdog.abort_bound_s, watchdog.grace_s = 2.0, 1.0
    for name, value in bounds.items():
        setattr(watchdog, name, value)
    watchdog.write = said.append
    watchdog.end = lambda code: said.append(f"exit {code}")
    return said


def in_thread(fn, timeout: float = HANG_S):
    """Run ``fn`` in a thread, joined within ``timeout``: (returned, its value or exception)."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            out.append(("raised", error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return (not thread.is_alive()), (out[0] if out else None)


def _flush(comm: nccl_comm.CupyNcclComm, flush: int) -> None:
    with comm.group(flush=flush):
        comm.reduce(comm.buffer[:4], 1)
        comm.all_reduce(comm.buffer[4:])


# ---- every error path aborts every communicator, all at once (findings 2 and 3) ------------------------------------


def test_a_failed_wait_aborts_every_communicator_at_once_where_any_order_would_hang(monkeypatch):
    """The data-parallel abort returns only after the rail's, the node's only after the data-parallel one's, ...:
    sequential aborts (any order starting anywhere but the rail, and the code's order starts with the data-parallel
    one) hang; concurrent ones return. The wait's error is raised, every handle aborted once, none destroyed."""
    f = family(monkeypatch)
    f.dp.watchdog.stop()  # the main thread's own wait and abort, alone
    _flush(f.rail, 3)
    f.device.stall("rail")
    returned, result = in_thread(lambda: f.dp.wait_until(lambda: True, "end_backward"))
    assert returned, "the aborts hung: they ran one after another"
    kind, error = result
    assert kind == "raised" and isinstance(error, OwnerReduceCommError), error
    assert "(and aborting" not in str(error), error
    assert str(error).startswith("owner_reduce: rank 0, flush #3: end_backward, waiting for reduce(root=1 = "
                                 "data-parallel rank 2, count=4, dtype=float32) (call 1 of 2) on the rail "
                                 "communicator timed out")
    assert all(h.aborted.is_set() and h.destroys == 0 for h in f.handles.values())
    assert sorted(e for e in f.device.log if e.endswith(".abort")) == sorted(f"{n}.abort" for n in f.handles)
    assert all(c.aborted and c._comm is None for c in f.comms)


def test_a_failed_call_on_one_level_aborts_every_level(monkeypatch):
    """Finding 3: a failed NCCL call used to abort only its own communicator; the others' kernels kept spinning and
    cupy's ``__dealloc__`` later destroyed them (``ncclCommDestroy`` waits for them)."""
    f = family(monkeypatch, order=False)
    f.handles["node"].fail_calls = True
    with pytest.raises(RuntimeError, match=r"owner_reduce NCCL reduce\(root=1 = data-parallel rank 1, count=4, "
                                           r"dtype=float32\) on the node communicator failed on rank 0, flush #4"):
        _flush(f.node, 4)
    assert f.device.log.index("groupEnd") < min(f.device.log.index(f"{n}.abort") for n in f.handles)  # group ended
    assert all(h.aborted.is_set() and h.destroys == 0 for h in f.handles.values())
    with pytest.raises(RuntimeError, match="was aborted after an earlier failure"):
        _flush(f.dp, 5)  # every communicator refuses from now on, without a call to NCCL
    assert "data-parallel.reduce" not in f.device.log


def test_an_abort_that_does_not_return_is_bounded_and_named(monkeypatch):
    f = family(monkeypatch, order=False)
    f.dp.watchdog.abort_bound_s = 0.3
    f.handles["rail"].after = Handle(f.device, "never aborted")  # its abort never returns (within HANG_S)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the abort of the rail communicator did not return within 0\.3 s"):
        f.dp._abort_all()
    assert time.monotonic() - started < 0.3 + 2.0
    assert all(f.handles[n].aborted.is_set() for n in ("data-parallel", "node", "node hand-off"))


def test_communicators_left_open_are_aborted_at_exit_never_destroyed(monkeypatch):
    device = Device()
    left, closed, aborted = (Handle(device, n) for n in ("left", "closed", "aborted"))
    monkeypatch.setattr(nccl_comm, "_LEFT_OPEN", {})
    registered = []
    monkeypatch.setattr(nccl_comm, "_EXIT_HANDLER", False)
    monkeypatch.setattr(nccl_comm.atexit, "register", registered.append)
    for h in (left, closed, aborted):
        nccl_comm._left_open(h)
    monkeypatch.setattr(nccl_comm, "_nccl", lambda: NcclModule(device))
    closing = cupy_comm(device, closed)
    closing.close()  # drained: destroyed, and no longer left open
    aborting = cupy_comm(device, aborted)
    aborting._abort()
    assert registered == [nccl_comm._abort_left_open]  # once
    nccl_comm._abort_left_open()
    assert left.aborted.is_set() and left.destroys == 0
    assert closed.destroys == 1 and not closed.aborted.is_set()
    assert device.log.count("aborted.abort") == 1 and nccl_comm._LEFT_OPEN == {}


# ---- the flush watchdog (finding 1) --------------------------------------------------------------------------------


def test_a_stalled_flush_is_aborted_at_its_deadline_and_the_main_threads_next_call_raises_it(monkeypatch):
    """The main thread is blocked in a CUDA launch behind the stalled stream (here: waiting for the device to drain) and
    never reaches a bounded wait. The watchdog, at the deadline counted from the group's issue, records the error,
    aborts every communicator at once (in an order that would hang one by one), the stream drains, and the main
    thread's next flush raises that error without calling NCCL."""
    f = family(monkeypatch)
    said = fast(f.dp.watchdog)
    issued = time.monotonic()
    f.device.stall("rail")
    _flush(f.rail, 7)

    def backward() -> None:
        assert f.device.drained.wait(HANG_S), "the stream never drained"  # a launch blocked behind it
        _flush(f.dp, 8)  # the next flush

    returned, (kind, error) = in_thread(backward)
    elapsed = time.monotonic() - issued
    assert returned and kind == "raised" and isinstance(error, OwnerReduceCommError), (kind, error, said)
    assert error is f.dp.watchdog.error
    assert str(error).startswith("owner_reduce: rank 0, flush #7: flush watchdog: reduce(root=1 = data-parallel rank "
                                 "2, count=4, dtype=float32) (call 1 of 2) on the rail communicator timed out after "
                                 "waiting 0.4 s (the deadline, from test; measured "), error
    assert DEADLINE.seconds <= elapsed < DEADLINE.seconds + 3.0
    f.dp.watchdog._thread.join(HANG_S)  # its aborts all returned (the main thread may come back after the rail's)
    assert all(h.aborted.is_set() and h.destroys == 0 for h in f.handles.values())
    assert f.device.log.count("groupStart") == 1  # the next flush never reached NCCL
    assert said == []  # nothing had to end the process
    with pytest.raises(OwnerReduceCommError) as again:  # the end of backward's wait raises it too
        f.dp.wait_until(lambda: True, "end_backward")
    assert again.value is error


def test_the_end_of_backwards_wait_raises_the_watchdogs_error_when_it_fired_first(monkeypatch):
    f = family(monkeypatch, order=False)
    fast(f.dp.watchdog)
    f.dp.deadline = Deadline(30.0, "test")  # the main thread's own wait would wait much longer
    f.device.stall("node")
    _flush(f.node, 2)
    returned, (kind, error) = in_thread(lambda: f.dp.wait_until(lambda: True, "end_backward"))
    assert returned and kind == "raised" and error is f.dp.watchdog.error
    assert "flush #2: flush watchdog (the main thread in end_backward): reduce(root=1 = data-parallel rank 1, " \
           "count=4, dtype=float32) (call 1 of 2) on the node communicator timed out after waiting" in str(error)


def test_an_asynchronous_error_fires_before_the_deadline(monkeypatch):
    f = family(monkeypatch, order=False)
    fast(f.dp.watchdog)
    f.dp.deadline = f.rail.deadline = Deadline(30.0, "test")
    f.device.stall("rail")
    _flush(f.rail, 5)
    f.handles["rail"].async_error = "NCCL_ERROR_REMOTE_ERROR: remote process exited or there was a network error"
    started = time.monotonic()

    def backward() -> None:  # blocked in a launch until the stream drains, then the next flush
        assert f.device.drained.wait(HANG_S), "the stream never drained"
        _flush(f.dp, 6)

    returned, (kind, error) = in_thread(backward)
    assert returned and kind == "raised" and time.monotonic() - started < 30.0, (kind, error)  # before the deadline
    assert error is f.dp.watchdog.error
    assert "flush #5: flush watchdog: reduce(root=1 = data-parallel rank 2, count=4, dtype=float32) (call 1 of 2) on " \
           "the rail communicator failed: RuntimeError: NCCL_ERROR_REMOTE_ERROR" in str(error)


def test_a_main_thread_inside_an_nccl_call_cannot_be_interrupted_so_the_process_ends(monkeypatch):
    """The next flush's ncclGroupEnd blocks behind a full work FIFO: the watchdog must not abort under it (it holds the
    group), so it writes the error and ends the process."""
    f = family(monkeypatch)
    said = fast(f.dp.watchdog)
    f.device.stall("data-parallel")
    _flush(f.dp, 1)
    f.module.fifo_full.set()
    blocked = threading.Thread(target=_flush, args=(f.dp, 2), daemon=True)
    blocked.start()
    deadline = time.monotonic() + HANG_S
    while f.dp.watchdog.ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    f.module.released.set()
    blocked.join(HANG_S)
    assert f.dp.watchdog.ended == ("the main thread is inside ncclGroupEnd on the data-parallel communicator, which "
                                   "cannot be interrupted")
    message, code = said
    assert code == f"exit {BLOCKED_EXIT_CODE}"
    assert message.startswith("owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 0, flush #1: "
                              "flush watchdog: reduce(root=1, count=4, dtype=float32) (call 1 of 2) on the "
                              "data-parallel communicator timed out after waiting")
    assert "owner_reduce ends this process (exit status 1)" in message
    assert not any(h.aborted.is_set() for h in f.handles.values())  # never aborted under an open group


def test_a_main_thread_stuck_in_an_nccl_call_with_nothing_in_flight_ends_the_process(monkeypatch):
    f = family(monkeypatch)
    said = fast(f.dp.watchdog)
    f.module.fifo_full.set()  # the first flush's group end blocks on the host (a lazy connection to a dead peer)
    blocked = threading.Thread(target=_flush, args=(f.node, 1), daemon=True)
    blocked.start()
    deadline = time.monotonic() + HANG_S
    while f.dp.watchdog.ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    f.module.released.set()
    blocked.join(HANG_S)
    assert said[0].startswith("owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 0, flush #1: "
                              "flush watchdog: ncclGroupEnd on the node communicator has not returned after "
                              "waiting"), said
    assert said[1] == f"exit {BLOCKED_EXIT_CODE}"


def test_a_group_slow_in_python_past_the_deadline_is_waited_for_then_aborted_after_it(monkeypatch):
    """The main thread holds its group open in Python (not inside NCCL) when a deadline passes: the watchdog waits for
    the group to close (never aborting under it), then aborts; the next flush raises. Held past ``group_wait_s``,
    the process ends instead."""
    f = family(monkeypatch, order=False)
    said = fast(f.dp.watchdog, group_wait_s=5.0)
    f.device.stall("rail")
    _flush(f.rail, 1)
    closed = threading.Event()

    def slow_group() -> None:
        with f.dp.group(flush=2):
            f.dp.reduce(f.dp.buffer[:4], 1)
            deadline = time.monotonic() + HANG_S
            while f.dp.watchdog.error is None and time.monotonic() < deadline:
                time.sleep(0.01)  # Python inside the open group, past the rail group's deadline
            time.sleep(0.2)  # the watchdog has recorded the error, and waits for this group to close
            assert not any(h.aborted.is_set() for h in f.handles.values()), "aborted under an open group"
        closed.set()
        _flush(f.dp, 3)

    returned, result = in_thread(slow_group)
    assert returned and result[0] == "raised" and result[1] is f.dp.watchdog.error, result
    assert closed.is_set() and said == []
    f.dp.watchdog._thread.join(HANG_S)
    assert all(h.aborted.is_set() for h in f.handles.values())
    assert f.device.log.index("groupEnd", f.device.log.index("data-parallel.reduce")) < min(
        f.device.log.index(f"{n}.abort") for n in f.handles)  # the group was ended before any abort

    g = family(monkeypatch, order=False)
    said = fast(g.dp.watchdog, group_wait_s=0.3)
    g.device.stall("rail")
    _flush(g.rail, 1)
    release = threading.Event()

    def stuck_group() -> None:
        with g.dp.group(flush=2):
            g.dp.reduce(g.dp.buffer[:4], 1)
            release.wait(HANG_S)

    thread = threading.Thread(target=stuck_group, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while g.dp.watchdog.ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    thread.join(HANG_S)
    assert g.dp.watchdog.ended == ("the main thread kept an NCCL group open on the data-parallel communicator for "
                                   "0.3 s after the deadline, and no communicator may be aborted under an open group")
    assert said[-1] == f"exit {BLOCKED_EXIT_CODE}" and not any(h.aborted.is_set() for h in g.handles.values())


def test_an_abort_that_does_not_return_ends_the_process(monkeypatch):
    f = family(monkeypatch, order=False)
    said = fast(f.dp.watchdog, abort_bound_s=0.3)
    f.handles["rail"].after = Handle(f.device, "never aborted")
    f.device.stall("rail")
    _flush(f.rail, 2)
    deadline = time.monotonic() + HANG_S
    while f.dp.watchdog.ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f.dp.watchdog.ended == "the abort of the rail communicator did not return within 0.3 s"
    assert said[-1] == f"exit {BLOCKED_EXIT_CODE}"


def test_a_main_thread_that_does_not_come_back_within_the_grace_ends_the_process(monkeypatch):
    f = family(monkeypatch, order=False)
    said = fast(f.dp.watchdog, grace_s=0.3)
    f.device.stall("rail")
    _flush(f.rail, 2)  # and the main thread never calls the runtime again
    deadline = time.monotonic() + HANG_S
    while f.dp.watchdog.ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f.dp.watchdog.ended == ("every communicator was aborted, but the main thread did not come back to "
                                   "owner_reduce within 0.3 s to raise it")
    assert all(h.aborted.is_set() for h in f.handles.values()) and said[-1] == f"exit {BLOCKED_EXIT_CODE}"


def test_healthy_flushes_never_fire_and_the_watchdog_sleeps_when_nothing_is_in_flight(monkeypatch):
    f = family(monkeypatch, order=False)
    said = fast(f.dp.watchdog)
    records: list[int] = []
    for comm in f.comms:
        comm._make_event = lambda name=comm._comm.name: types.SimpleNamespace(
            record=lambda stream=None: records.append(1), query=lambda: name not in f.device.spinning)
    for flush in range(1, 6):
        for comm in f.comms:
            _flush(comm, flush)
    assert len(records) == 5 * 4  # one event record per group, nothing more on the hot path
    deadline = time.monotonic() + HANG_S
    while f.dp.watchdog.armed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not f.dp.watchdog.armed and f.dp.watchdog.error is None and said == []  # it looked, and went to sleep
    assert not any(h.aborted.is_set() for h in f.handles.values())
    f.dp.wait_until(lambda: True, "end_backward")  # forgets the completed groups; their events are reused
    _flush(f.dp, 6)
    assert f.dp.watchdog.armed  # armed again by the next group
    f.dp.close_subs()
    f.dp.close()
    assert all(h.destroys == 1 and not h.aborted.is_set() for h in f.handles.values())


def test_the_first_claim_wins_and_the_watchdog_stands_down(monkeypatch):
    """The main thread's wait (shorter deadline here) fails first and aborts everything: the watchdog, whose rail group
    is still unfinished, finds the communicators claimed, records nothing and ends nothing."""
    f = family(monkeypatch, order=False)
    said = fast(f.dp.watchdog)
    f.dp.deadline = Deadline(0.1, "test")
    f.rail.deadline = Deadline(0.6, "test")
    f.device.stall("rail")
    _flush(f.rail, 3)
    with pytest.raises(OwnerReduceCommError, match="end_backward, waiting for"):
        f.dp.wait_until(lambda: True, "end_backward")
    f.dp.watchdog._thread.join(HANG_S)  # its next poll sees the claim and ends the thread
    assert not f.dp.watchdog._thread.is_alive() and f.dp.watchdog.error is None and said == []


# ---- torch.distributed on NCCL: the same watchdog over its works ---------------------------------------------------


class _Work:
    def __init__(self, device: Device, name: str) -> None:
        self.device, self.name = device, name

    def is_completed(self) -> bool:
        return self.name not in self.device.spinning

    def exception(self):
        return None

    def block_current_stream(self) -> None:
        pass


class _Group:
    def __init__(self, device: Device, name: str) -> None:
        self.device, self.name = device, name
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        self.device.stop(self.name)


class _Tdist:
    ReduceOp = types.SimpleNamespace(SUM="sum")
    group = types.SimpleNamespace(WORLD=None)

    def __init__(self, device: Device, name: str) -> None:
        self.device, self.name = device, name

    def get_rank(self, group):
        return 0

    def get_world_size(self, group):
        return 2

    def get_global_rank(self, group, rank):
        return rank

    def get_backend(self, group):
        return "nccl"

    def all_reduce(self, buf, op, group, async_op):
        return _Work(self.device, self.name)


class _DeviceBuf:
    is_cuda = True
    dtype = torch.float32

    def numel(self) -> int:
        return 4


def test_torch_dist_works_are_watched_too(monkeypatch):
    device = Device()
    group = _Group(device, "data-parallel")
    comm = TorchDistComm(group, tdist=_Tdist(device, "data-parallel"))
    comm.deadline = DEADLINE
    fast(comm.watchdog)
    device.stall("data-parallel")
    with comm.group(flush=4):
        comm.all_reduce(_DeviceBuf())
    assert device.drained.wait(HANG_S) and group.aborts == 1  # the watchdog aborted the group at its deadline
    with pytest.raises(OwnerReduceCommError) as caught, comm.group(flush=5):
        raise AssertionError("not reached: the group refuses to open")
    assert caught.value is comm.watchdog.error
    assert str(caught.value).startswith("owner_reduce: rank 0, flush #4: flush watchdog: all_reduce(count=4, "
                                        "dtype=float32) on the data-parallel communicator timed out after waiting")
