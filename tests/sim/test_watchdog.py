"""The flush watchdog and the concurrent abort (issue 37, findings 1-3) on the simulated device's NCCL
(``support/sim/nccl.py``): the product's ``CupyNcclComm`` family (data-parallel, node, rail, node hand-off, made through
the product's ``split``) over the sim's cupy, where a collective whose peer never joins spins until its communicator
is aborted, an abort waits for its communicator's last kernel (``commDestroySync``), which can sit on the stream
behind another communicator's spinning kernel, a CUDA launch blocks the host while the stream's launch queue is full
(``launch_bound``), and ``ncclGroupEnd`` blocks while the communicator's work FIFO is (``fifo_bound``). Rank 0's
communicators run on the test's thread, rank 0's process; the other ranks joined at creation and issue only where a
test says so, so rank 0's collectives spin: a stalled peer.

Wall-clock bounds here are the claim (a failure within the deadline plus the watchdog's bounds), never a verdict by
sleeping: every wait is on an event the code under test sets, bounded so that a regression fails instead of hanging.

torch's ProcessGroupNCCL and its works (under ``TorchDistComm``) are the suite's stand-in for that layer
(``tests.support.tdist``): the simulated device models cupy's NCCL, not torch's process group.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import nccl_binding, nccl_comm
from owner_reduce.runtime import watchdog as watchdogs
from owner_reduce.runtime.deadline import BLOCKED_EXIT_CODE, Deadline
from owner_reduce.runtime.torch_comm import TorchDistComm
from tests.support.sim import nccl as sim_nccl
from tests.support.sim.cuda import Sim, SimHang
from tests.support.sim.runtime import connect_comms
from tests.support.tdist import DeviceBuf, FakeTdist

DEADLINE = Deadline(0.4, "test")
HANG_S = 20.0  # what a test waits at most for the code under test (so a regression fails instead of hanging)
HANG_BOUND_S = 8.0  # the sim's: a host wait past this is a hang (``SimHang``), well past every bound tested here
ROLES = ("data-parallel", "node", "rail", "node hand-off")


def _comms(sim, ws, connect=True):
    """The product's communicator on every rank of one unique id (made on the ranks' threads: init blocks until all
    joined), each with the test's deadline and its watchdog's fake end of the process (``fast``): no watchdog here ends
    the test's process."""
    uid = nccl_binding.new_unique_id()
    comms = sim.run_ranks(lambda rank: nccl_comm.CupyNcclComm(uid, rank, ws), ws)
    if connect:
        connect_comms(sim, comms)  # as the runtime's init: the peers stall flushes, not a connection setup
    for comm in comms:
        comm.set_deadline(DEADLINE)
        fast(comm.watchdog)
    return comms


def family(sim, connect: bool = True, **bounds: float):
    """Data-parallel rank 0's four communicators: a data-parallel one over four ranks, and the node, rail and node
    hand-off ones the product's ``split`` makes (each over two ranks: groups [[0, 1], [2, 3]] and [[0, 2], [1, 3]]),
    one flush watchdog for all, with short bounds and a fake end of the process (``fast``). Every one of rank 0's
    communicators runs on rank 0's current stream, so their kernels queue there in issue order."""
    ranks = {"data-parallel": _comms(sim, 4, connect)}
    for role in ROLES[1:]:
        ranks[role] = _comms(sim, 2, connect)
    dp = ranks["data-parallel"][0]
    made = iter(ranks[role][0] for role in ROLES[1:])
    dp._split = lambda groups: next(made)
    node = dp.split([[0, 1], [2, 3]], "node")
    rail = dp.split([[0, 2], [1, 3]], "rail")
    handoff = dp.split([[0, 1], [2, 3]], "node hand-off")
    said = fast(dp.watchdog, **bounds)
    members = {role: ranks[role][0]._comm.member for role in ROLES}
    return types.SimpleNamespace(dp=dp, node=node, rail=rail, handoff=handoff, comms=(dp, node, rail, handoff),
                                 members=members, ranks=ranks, said=said)


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
    """Run ``fn`` in a thread (rank 0's process: the sim binds threads to their starter's), joined within
    ``timeout``: (returned, its value or exception)."""
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
    """A flush's group of two calls; on rank 0 alone (its peers never join) it spins until aborted."""
    buf = torch.zeros(8, device="cuda")
    with comm.group(flush=flush):
        comm.reduce(buf[:4], 1)
        comm.all_reduce(buf[4:])


def _peers_flush(sim, ranks, flush: int) -> None:
    """The same flush on every rank of ``ranks`` (a communicator's, by rank) but rank 0: rank 0's completes."""
    sim.run_ranks(lambda rank: None if rank == 0 else _flush(ranks[rank], flush), len(ranks))


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {HANG_S} s"
        time.sleep(0.02)


def _aborts(sim) -> int:
    return sim.nccl.calls_of(0).count("abort")


# ---- every error path aborts every communicator, all at once (findings 2 and 3) ------------------------------------


@pytest.mark.timeout(60)
def test_a_failed_wait_aborts_every_communicator_at_once_where_any_order_would_hang():
    """The rail's group spins at the head of rank 0's stream; the data-parallel, node and hand-off groups issued after
    it are queued behind it, so each of their aborts returns only after the rail's (the next test shows it hang):
    sequential aborts in the code's order (the data-parallel one first) hang; concurrent ones return. The wait's error
    is raised, every communicator aborted once, none destroyed."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)
        f.dp.watchdog.stop()  # the main thread's own wait and abort, alone
        _flush(f.rail, 3)
        for flush, comm in ((4, f.dp), (5, f.node), (6, f.handoff)):
            _flush(comm, flush)
        returned, result = in_thread(lambda: f.dp.wait_until(lambda: True, "end_backward"))
        assert returned, "the aborts hung: they ran one after another"
        kind, error = result
        assert kind == "raised" and isinstance(error, OwnerReduceCommError), error
        assert "(and aborting" not in str(error), error
        assert str(error).startswith("owner_reduce: rank 0, flush #3: end_backward, waiting for reduce(root=1 = "
                                     "data-parallel rank 2, count=4, dtype=float32) (call 1 of 2) on the rail "
                                     "communicator timed out"), error
        assert all(m.aborted and m.freed and not m.destroyed for m in f.members.values()), f.members
        assert _aborts(sim) == 4 and "destroy" not in sim.nccl.calls_of(0)
        assert all(c.aborted and c._comm is None for c in f.comms)
        torch.cuda.synchronize()  # every aborted kernel exited: the stream drained
        assert sim.hangs == []


@pytest.mark.timeout(60)
def test_negative_control_an_abort_before_the_rails_hangs_behind_its_spinning_kernel():
    """What the test above guards against, on the same device: the data-parallel abort alone, first (as a loop over
    the family would), waits for its last kernel behind the rail's spinning one and never returns."""
    with Sim(hang_bound_s=2.0) as sim:
        f = family(sim)
        f.dp.watchdog.stop()
        _flush(f.rail, 3)
        _flush(f.dp, 4)
        with pytest.raises(SimHang, match=r"ncclCommAbort on .* waiting for its last kernel"):
            f.dp._comm.abort()
        f.rail._abort()  # the rail's kernel exits; the data-parallel one (aborted) follows
        torch.cuda.synchronize()


@pytest.mark.timeout(60)
def test_a_failed_call_on_one_level_aborts_every_level():
    """Finding 3: a failed NCCL call used to abort only its own communicator; the others' kernels kept spinning and
    cupy's ``__dealloc__`` later destroyed them (``ncclCommDestroy`` waits for them)."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)
        sim.nccl.inject("reduce", sim_nccl.REMOTE_ERROR, rank=0, comm=f.members["node"].index)
        with pytest.raises(RuntimeError, match=r"owner_reduce NCCL reduce\(root=1 = data-parallel rank 1, count=4, "
                                               r"dtype=float32\) on the node communicator failed on rank 0, flush #4"):
            _flush(f.node, 4)
        log = sim.nccl.calls_of(0)
        assert log.index("groupEnd failed") < log.index("abort"), log  # the group was ended first
        assert all(m.aborted and not m.destroyed for m in f.members.values()) and _aborts(sim) == 4
        with pytest.raises(RuntimeError, match="was aborted after an earlier failure"):
            _flush(f.dp, 5)  # every communicator refuses from now on, without a call to NCCL
        assert [c for c in sim.nccl.calls_of(0)[len(log):] if c in sim_nccl.CALL_KINDS] == []


@pytest.mark.timeout(60)
def test_an_abort_that_does_not_return_is_bounded_and_named():
    """The rail's last kernel is queued behind a spinning kernel of a communicator outside the family, which nobody
    aborts: the rail's abort waits for it; the others return."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim, abort_bound_s=0.3)
        f.dp.watchdog.stop()
        outsider, _ = _comms(sim, 2)
        outsider.watchdog.stop()  # nobody aborts it
        _flush(outsider, 1)
        _flush(f.rail, 2)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the abort of the rail communicator did not return within 0\.3 s"):
            f.dp.watchdog.abort_all()
        assert time.monotonic() - started < 0.3 + 2.0
        assert all(f.members[n].freed for n in ("data-parallel", "node", "node hand-off"))
        assert not f.members["rail"].freed  # its abort still waits
        outsider._abort()  # the outsider's kernel exits: the rail's abort returns
        _wait_for(lambda: f.members["rail"].freed, "the rail's abort returned once the stream moved")


@pytest.mark.timeout(60)
def test_communicators_left_open_are_aborted_at_exit_never_destroyed(monkeypatch):
    monkeypatch.setattr(nccl_binding, "_LEFT_OPEN", {})
    registered = []
    monkeypatch.setattr(nccl_binding, "_EXIT_HANDLER", False)
    monkeypatch.setattr(nccl_binding.atexit, "register", registered.append)
    # Both simulated ranks share this Python process's exit handler, which aborts rank 1's communicators from rank 0's
    # thread on rank 1's device: a context no real process (one GPU each) makes, so contexts are not checked here.
    with Sim(hang_bound_s=HANG_BOUND_S, strict_contexts=False) as sim:
        left, closing, aborting = (_comms(sim, 2) for _ in range(3))
        members = {name: [c._comm.member for c in comms]
                   for name, comms in (("left", left), ("closed", closing), ("aborted", aborting))}
        sim.run_ranks(lambda rank: closing[rank].close(), 2)  # drained: destroyed, and no longer left open
        aborting[0]._abort()
        assert registered == [nccl_binding._abort_left_open]  # once
        before = _aborts(sim)
        nccl_binding._abort_left_open()
        assert all(m.aborted and not m.destroyed for m in members["left"]), members["left"]
        assert all(m.destroyed and not m.aborted for m in members["closed"]), members["closed"]
        assert members["aborted"][0].aborted and members["aborted"][1].aborted  # rank 1's was still open
        assert _aborts(sim) == before + 1  # rank 0: the one left open; the one aborted already, not again
        assert nccl_binding._LEFT_OPEN == {}


# ---- the flush watchdog (finding 1) --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_stalled_flush_is_aborted_at_its_deadline_and_the_main_threads_next_call_raises_it():
    """The main thread is blocked in a CUDA launch behind the stalled stream (the launch queue, 16 deep here, is full
    behind the rail's spinning kernel) and never reaches a bounded wait. The watchdog, at the deadline counted from
    the group's issue, records the error, aborts every communicator at once, the stream drains, and the main thread's
    next flush raises that error without calling NCCL."""
    with Sim(hang_bound_s=HANG_BOUND_S, launch_bound=16) as sim:
        f = family(sim)
        x = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        started_groups = sim.nccl.calls_of(0).count("groupStart")  # the connection warm-up's
        issued = time.monotonic()
        _flush(f.rail, 7)
        launched_after: list[bool] = []

        def backward() -> None:
            for _ in range(24):
                x.add_(1)  # the backward's kernels: a launch blocks while the queue is full
            launched_after.append(f.members["rail"].aborted)
            _flush(f.dp, 8)  # the next flush

        returned, (kind, error) = in_thread(backward)
        elapsed = time.monotonic() - issued
        assert launched_after == [True]  # the launches returned only after the abort drained the stream
        assert returned and kind == "raised" and isinstance(error, OwnerReduceCommError), (kind, error, f.said)
        assert error is f.dp.watchdog.error
        assert str(error).startswith("owner_reduce: rank 0, flush #7: flush watchdog: reduce(root=1 = data-parallel "
                                     "rank 2, count=4, dtype=float32) (call 1 of 2) on the rail communicator timed "
                                     "out after waiting 0.4 s (the deadline, from test; measured "), error
        assert DEADLINE.seconds <= elapsed < DEADLINE.seconds + 3.0
        f.dp.watchdog._thread.join(HANG_S)  # its aborts all returned (the main thread may come back after the rail's)
        assert all(m.aborted and not m.destroyed for m in f.members.values())
        assert sim.nccl.calls_of(0).count("groupStart") == started_groups + 1  # the next flush never reached NCCL
        assert f.said == []  # nothing had to end the process
        with pytest.raises(OwnerReduceCommError) as again:  # the end of backward's wait raises it too
            f.dp.wait_until(lambda: True, "end_backward")
        assert again.value is error


@pytest.mark.timeout(60)
def test_the_watchdog_names_the_oldest_stalled_group_not_one_queued_behind_it():
    """A data-parallel flush queued on the stream behind a stalled rail flush is past its deadline too when the
    watchdog looks late (a loaded host): the error names the rail's flush, the one that stalled, not the first
    communicator of the family past its deadline. The poll is driven by hand, at a time past both deadlines."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)
        f.dp.watchdog.stop()  # no poll of its own: the one below sees both groups overdue
        _flush(f.rail, 7)
        _flush(f.dp, 8)  # the data-parallel communicator comes first in the family
        assert f.dp.watchdog._check(time.monotonic() + 10 * DEADLINE.seconds)
        error = f.dp.watchdog.error
        assert "flush #7: flush watchdog: reduce(" in str(error) and " on the rail communicator timed out" in \
            str(error), error


@pytest.mark.timeout(60)
def test_the_end_of_backwards_wait_raises_the_watchdogs_error_when_it_fired_first():
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)
        f.dp.deadline = Deadline(30.0, "test")  # the main thread's own wait would wait much longer
        _flush(f.node, 2)
        returned, (kind, error) = in_thread(lambda: f.dp.wait_until(lambda: True, "end_backward"))
        assert returned and kind == "raised" and error is f.dp.watchdog.error, (kind, error)
        assert "flush #2: flush watchdog (the main thread in end_backward): reduce(root=1 = data-parallel rank 1, " \
               "count=4, dtype=float32) (call 1 of 2) on the node communicator timed out after waiting" in str(error)


@pytest.mark.timeout(60)
def test_an_asynchronous_error_fires_before_the_deadline():
    with Sim(hang_bound_s=HANG_BOUND_S, launch_bound=2) as sim:
        f = family(sim)
        f.dp.deadline = f.rail.deadline = Deadline(30.0, "test")
        x = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        _flush(f.rail, 5)
        sim.nccl.async_error(f.members["rail"], sim_nccl.REMOTE_ERROR)
        started = time.monotonic()

        def backward() -> None:  # blocked in a launch until the stream drains, then the next flush
            for _ in range(3):
                x.add_(1)
            _flush(f.dp, 6)

        returned, (kind, error) = in_thread(backward)
        assert returned and kind == "raised" and time.monotonic() - started < 30.0, (kind, error)  # before the deadline
        assert error is f.dp.watchdog.error
        assert "flush #5: flush watchdog: reduce(root=1 = data-parallel rank 2, count=4, dtype=float32) (call 1 of " \
               "2) on the rail communicator failed: NcclError: NCCL_ERROR_REMOTE_ERROR" in str(error), error


@pytest.mark.timeout(60)
def test_a_main_thread_inside_an_nccl_call_cannot_be_interrupted_so_the_process_ends():
    """The next flush's ncclGroupEnd blocks behind a full work FIFO (one slot, taken by the stalled flush): the
    watchdog must not abort under it (it holds the group), so it writes the error and ends the process. Then the
    peers join the stalled flush, the FIFO frees, and the blocked call returns."""
    with Sim(hang_bound_s=HANG_BOUND_S, fifo_bound=1) as sim:
        f = family(sim)
        _flush(f.dp, 1)
        returned: list = []
        blocked = threading.Thread(target=lambda: returned.append(in_thread(lambda: _flush(f.dp, 2))), daemon=True)
        blocked.start()
        _wait_for(lambda: f.dp.watchdog.ended is not None, "the watchdog ended the process")
        assert not returned, "ncclGroupEnd returned with its work FIFO full"
        _peers_flush(sim, f.ranks["data-parallel"], 1)
        blocked.join(HANG_S)
        assert returned and returned[0][0], "the blocked ncclGroupEnd never returned"
        assert f.dp.watchdog.ended == ("the main thread is inside ncclGroupEnd on the data-parallel communicator, "
                                       "which cannot be interrupted")
        message, code = f.said
        assert code == f"exit {BLOCKED_EXIT_CODE}"
        assert message.startswith("owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 0, flush #1: "
                                  "flush watchdog: reduce(root=1, count=4, dtype=float32) (call 1 of 2) on the "
                                  "data-parallel communicator timed out after waiting"), message
        assert "owner_reduce ends this process (exit status 1)" in message
        assert not any(m.aborted for m in f.members.values())  # never aborted under an open group


@pytest.mark.timeout(60)
def test_a_main_thread_stuck_in_an_nccl_call_with_nothing_in_flight_ends_the_process():
    """The first flush's group end blocks on the host with nothing in flight: a lazy connection to a dead peer (the
    communicators were not connected at init here: the sim's lazy connection waits in ``ncclGroupEnd`` for a peer
    that never comes). What the watchdog sees: the main thread inside ``ncclGroupEnd`` past the deadline."""
    with Sim(hang_bound_s=3.0) as sim:
        f = family(sim, connect=False)
        returned: list = []
        blocked = threading.Thread(target=lambda: returned.append(in_thread(lambda: _flush(f.node, 1))), daemon=True)
        blocked.start()
        _wait_for(lambda: f.dp.watchdog.ended is not None, "the watchdog ended the process")
        assert f.said[0].startswith("owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 0, flush "
                                    "#1: flush watchdog: ncclGroupEnd on the node communicator has not returned after "
                                    "waiting"), f.said
        assert f.said[1] == f"exit {BLOCKED_EXIT_CODE}"
        assert not returned  # still inside ncclGroupEnd (on a GPU for ever; the sim gives up at its hang bound)


@pytest.mark.timeout(60)
def test_a_group_slow_in_python_past_the_deadline_is_waited_for_then_aborted_after_it():
    """The main thread holds its group open in Python (not inside NCCL) when a deadline passes: the watchdog waits for
    the group to close (never aborting under it), then aborts; the next flush raises. Held past ``group_wait_s``,
    the process ends instead."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim, group_wait_s=5.0)
        _flush(f.rail, 1)
        closed = threading.Event()

        def slow_group() -> None:
            buf = torch.zeros(4, device="cuda")
            with f.dp.group(flush=2):
                f.dp.reduce(buf, 1)
                deadline = time.monotonic() + HANG_S
                while f.dp.watchdog.error is None and time.monotonic() < deadline:
                    time.sleep(0.01)  # Python inside the open group, past the rail group's deadline
                time.sleep(0.2)  # the watchdog has recorded the error, and waits for this group to close
                assert not any(m.aborted for m in f.members.values()), "aborted under an open group"
            closed.set()
            _flush(f.dp, 3)

        returned, result = in_thread(slow_group)
        assert returned and result[0] == "raised" and result[1] is f.dp.watchdog.error, result
        assert closed.is_set() and f.said == []
        f.dp.watchdog._thread.join(HANG_S)
        assert all(m.aborted for m in f.members.values())
        log = sim.nccl.calls_of(0)
        assert log.index("groupEnd", log.index("groupEnd") + 1) < log.index("abort"), log  # flush 2's group ended first

    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        g = family(sim, group_wait_s=0.3)
        _flush(g.rail, 1)
        release = threading.Event()

        def stuck_group() -> None:
            buf = torch.zeros(4, device="cuda")
            with g.dp.group(flush=2):
                g.dp.reduce(buf, 1)
                release.wait(HANG_S)

        thread = threading.Thread(target=lambda: in_thread(stuck_group), daemon=True)
        thread.start()
        _wait_for(lambda: g.dp.watchdog.ended is not None, "the watchdog ended the process")
        release.set()
        thread.join(HANG_S)
        assert g.dp.watchdog.ended == ("the main thread kept an NCCL group open on the data-parallel communicator for "
                                       "0.3 s after the deadline, and no communicator may be aborted under an open "
                                       "group")
        assert g.said[-1] == f"exit {BLOCKED_EXIT_CODE}" and not any(m.aborted for m in g.members.values())


@pytest.mark.timeout(60)
def test_an_abort_that_does_not_return_ends_the_process():
    """The rail's abort waits behind an outsider's spinning kernel (as above), past the watchdog's abort bound."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim, abort_bound_s=0.3)
        outsider, _ = _comms(sim, 2)
        outsider.watchdog.stop()  # nobody aborts it
        _flush(outsider, 1)
        _flush(f.rail, 2)
        _wait_for(lambda: f.dp.watchdog.ended is not None, "the watchdog ended the process")
        assert f.dp.watchdog.ended == "the abort of the rail communicator did not return within 0.3 s"
        assert f.said[-1] == f"exit {BLOCKED_EXIT_CODE}"
        outsider._abort()
        _wait_for(lambda: f.members["rail"].freed, "the rail's abort returned once the stream moved")


@pytest.mark.timeout(60)
def test_a_main_thread_that_does_not_come_back_within_the_grace_ends_the_process():
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim, grace_s=0.3)
        _flush(f.rail, 2)  # and the main thread never calls the runtime again
        _wait_for(lambda: f.dp.watchdog.ended is not None, "the watchdog ended the process")
        assert f.dp.watchdog.ended == ("every communicator was aborted, but the main thread did not come back to "
                                       "owner_reduce within 0.3 s to raise it")
        assert all(m.aborted for m in f.members.values()) and f.said[-1] == f"exit {BLOCKED_EXIT_CODE}"


@pytest.mark.timeout(60)
def test_healthy_flushes_never_fire_and_the_watchdog_sleeps_when_nothing_is_in_flight():
    """Every rank issues every flush: each completes; one event record per group on rank 0, nothing more on the hot
    path; the watchdog looks, and goes to sleep; closed, every communicator is destroyed, none aborted."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)

        def flushes(rank: int, numbers) -> None:
            for flush in numbers:
                for role in ROLES:
                    comms = f.ranks[role]
                    if rank < len(comms):
                        _flush(f.comms[ROLES.index(role)] if rank == 0 else comms[rank], flush)

        records = sim.process(0).counters["Event.record"]
        sim.run_ranks(lambda rank: flushes(rank, range(1, 6)), 4)
        assert sim.process(0).counters["Event.record"] - records == 5 * 4  # one per group
        _wait_for(lambda: not f.dp.watchdog.armed, "the watchdog went to sleep")
        assert f.dp.watchdog.error is None and f.said == []
        assert not any(m.aborted for m in f.members.values())
        f.dp.wait_until(lambda: True, "end_backward")  # forgets the completed groups; their events are reused
        sim.run_ranks(lambda rank: _flush(f.dp if rank == 0 else f.ranks["data-parallel"][rank], 6), 4)
        assert f.dp.watchdog.armed  # armed again by the next group
        f.dp.close_subs()
        f.dp.close()
        assert all(m.destroyed and not m.aborted for m in f.members.values()), f.members
        assert sim.nccl.calls_of(0).count("destroy") == 4


@pytest.mark.timeout(60)
def test_the_first_claim_wins_and_the_watchdog_stands_down():
    """The main thread's wait (shorter deadline here) fails first and aborts everything: the watchdog, whose rail group
    is still unfinished, finds the communicators claimed, records nothing and ends nothing."""
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        f = family(sim)
        f.dp.deadline = Deadline(0.1, "test")
        f.rail.deadline = Deadline(0.6, "test")
        _flush(f.rail, 3)
        with pytest.raises(OwnerReduceCommError, match="end_backward, waiting for"):
            f.dp.wait_until(lambda: True, "end_backward")
        f.dp.watchdog._thread.join(HANG_S)  # its next poll sees the claim and ends the thread
        assert not f.dp.watchdog._thread.is_alive() and f.dp.watchdog.error is None and f.said == []
        assert _aborts(sim) == 4


# ---- torch.distributed on NCCL: the same watchdog over its works ---------------------------------------------------


def test_torch_dist_works_are_watched_too(monkeypatch):
    tdist = FakeTdist(complete=False)  # the peer stalled: the work never completes
    group = tdist.world
    comm = TorchDistComm(group, tdist=tdist)
    comm.deadline = DEADLINE
    fast(comm.watchdog)
    with comm.group(flush=4):
        comm.all_reduce(DeviceBuf(4))
    assert group.aborted.wait(HANG_S) and group.aborts == 1  # the watchdog aborted the group at its deadline
    with pytest.raises(OwnerReduceCommError) as caught, comm.group(flush=5):
        raise AssertionError("not reached: the group refuses to open")
    assert caught.value is comm.watchdog.error
    assert str(caught.value).startswith("owner_reduce: rank 0, flush #4: flush watchdog: all_reduce(count=4, "
                                        "dtype=float32) on the data-parallel communicator timed out after waiting")
