"""Issue 46: what only a real GPU would show, on a simulated device made as strict as the real stack there.

Each test shows one finding as the product's behaviour on the simulated device (``tests.support.sim``), and a
negative control puts the old behaviour back in the product's own path to show that the
test fails on it:

- finding 1, a thread's device: CUDA's current device is per host thread and a new thread's is 0; the sim counts the
  context each CUDA call makes on the thread's device (or the device a torch guard sets) and every ``with Sim()``
  fails at its end where a rank made one off its own device;
- finding 2, where events are destroyed: the sim records the thread each CUDA event dies on and every abort's start
  and return;
- finding 3, aborts that wait for the whole device: with ``device_wide_free`` an abort's or destroy's frees wait for
  every stream of the process on its device, so a kernel outside owner_reduce that never finishes holds them;
- finding 4, a bounded close: the same, at ``close``;
- finding 5, NCCL's lazy connections: a communicator's first call of each kind (or to each peer) sets its connection
  up inside ``ncclGroupEnd``, on the host, with a rendezvous of the members, and takes device memory;
- finding 7, a query that raises: a sticky CUDA error (``sim.fail_device``) makes every query of the process raise.

Rank 1 is the rank watched (rank 0's own device is GPU 0, where a context made by mistake would not show). Rank 0
never joins rank 1's calls: a stalled peer. Wall-clock bounds are the claim (the deadline plus the watchdog's bounds);
every wait is on something the code under test sets, bounded so that a regression fails instead of hanging.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import nccl_binding, nccl_comm, threads
from owner_reduce.runtime import watchdog as watchdogs
from owner_reduce.runtime.deadline import Deadline
from tests.sim.test_watchdog import fast
from tests.support.fakes import flat_map
from tests.support.sim.cuda import Sim
from tests.support.sim.runtime import check_buffers, connect_comms, cupy_runtimes, train_step

DEADLINE = Deadline(0.5, "test")
HANG_BOUND_S = 8.0  # the sim's: a host wait past this would never return on a GPU (``SimHang``)
WAIT_S = 20.0  # what a test waits at most for the code under test


@pytest.fixture(autouse=True)
def _stop_watchdogs():
    yield
    watchdogs.stop_all()


def _pair(sim: Sim) -> list[nccl_comm.CupyNcclComm]:
    """The product's communicator on ranks 0 and 1 of one unique id, each with the test's deadline and a watchdog with
    short bounds and a fake end of the process (``test_watchdog.fast``)."""
    uid = nccl_binding.new_unique_id()
    comms = sim.run_ranks(lambda rank: nccl_comm.CupyNcclComm(uid, rank, 2), 2)
    connect_comms(sim, comms)  # as the runtime's init: rank 0 stalls flushes, not a connection setup
    for comm in comms:
        comm.set_deadline(DEADLINE)
        fast(comm.watchdog)
    return comms


def _flush(comm: nccl_comm.CupyNcclComm, flush: int) -> None:
    """A flush's group of one AllReduce; issued by one rank alone (its peer never joins), it spins until aborted."""
    buf = torch.zeros(8, device="cuda")
    with comm.group(flush=flush):
        comm.all_reduce(buf)


def _wait_for(condition, what: str, timeout: float = WAIT_S) -> float:
    """Poll ``condition`` until true; the seconds it took. AssertionError naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"not within {timeout:g} s: {what}"
        time.sleep(0.005)
    return time.monotonic() - start


def _stall_rank1(sim: Sim, comms: list[nccl_comm.CupyNcclComm], groups: int = 3) -> OwnerReduceCommError:
    """Rank 1 issues ``groups`` flushes rank 0 never joins; its flush watchdog fires at the deadline, aborts from its
    own threads, and rank 1's next flush raises the watchdog's error, which is returned once the abort has returned."""
    def rank_main(rank: int) -> OwnerReduceCommError | None:
        if rank == 0:
            return None
        comm = comms[1]
        for flush in range(1, groups + 1):
            _flush(comm, flush)
        _wait_for(lambda: comm.watchdog.error is not None, "the watchdog's error")
        with pytest.raises(OwnerReduceCommError) as raised:
            _flush(comm, groups + 1)
        _wait_for(lambda: comm.aborted and not any(t.startswith("owner_reduce abort") for t in _live_threads()),
                  "the abort returned")
        return raised.value

    return sim.run_ranks(rank_main, 2)[1]


def _live_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate()]


# ---- finding 1: every thread on its rank's device ------------------------------------------------------------------


def _contexts_of_a_stall() -> tuple[dict[str, str], list[str], OwnerReduceCommError]:
    with Sim(hang_bound_s=HANG_BOUND_S, strict_contexts=False) as sim:
        comms = _pair(sim)
        error = _stall_rank1(sim, comms)
        return dict(sim.process(1).contexts.get(1, {})), sim.foreign_contexts, error


@pytest.mark.timeout(60)
def test_a_ranks_watchdog_and_abort_threads_make_no_cuda_context_off_its_device():
    """Rank 1's flush watchdog polls its groups' events (``cudaEventQuery``: no device guard) and its abort threads
    call ``ncclCommAbort``: both on rank 1's device, so its process makes no context on GPU 0."""
    on_own_device, foreign, error = _contexts_of_a_stall()
    assert foreign == []
    assert "owner_reduce flush watchdog" in on_own_device, on_own_device  # it did make CUDA calls, on its device
    assert "owner_reduce abort: data-parallel communicator" in on_own_device, on_own_device
    assert re.search(r"rank 1, flush #1: flush watchdog: all_reduce\(count=8, dtype=float32\) on the data-parallel "
                     r"communicator timed out after waiting 0.5 s", str(error)), error


@pytest.mark.timeout(60)
def test_negative_control_threads_that_never_set_their_device_make_contexts_on_gpu_0(monkeypatch):
    """The product's threads started without setting the rank's device (as before the fix): the sim names each
    thread's context on GPU 0."""
    monkeypatch.setattr(threads.DeviceThread, "run", lambda self: self._target_fn(*self._target_args))
    _, foreign, _ = _contexts_of_a_stall()
    assert any(f.startswith("rank 1 (own device cuda:1): a context on cuda:0 made by thread 'owner_reduce flush "
                            "watchdog' in ") for f in foreign), foreign
    aborts = "thread 'owner_reduce abort: data-parallel communicator' in ncclCommAbort"
    assert any(aborts in f for f in foreign), foreign
    with Sim(strict_contexts=True) as sim:  # and a ``with Sim()`` fails at its end on such a context
        sim.run_ranks(lambda rank: torch.zeros(1, device="cuda:0") if rank == 1 else None, 2)
        with pytest.raises(AssertionError, match=r"rank 1 \(own device cuda:1\): a context on cuda:0 made by thread "
                                                 r"'sim-rank-1'"):
            sim.check_contexts()
        sim.process(1).contexts.pop(0)


# ---- finding 2: no CUDA object dies on the watchdog before its aborts -----------------------------------------------


def _event_deaths_of_a_stall() -> tuple[list[str], list[str], int]:
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        comms = _pair(sim)
        _stall_rank1(sim, comms, groups=3)
        early = sim.destroyed_before_aborts("owner_reduce flush watchdog")
        kept = len(comms[1]._retired)
        sim.run_ranks(lambda rank: comms[rank].close() if rank == 1 else None, 2)  # on rank 1's main thread
        deaths = [thread for _, what, thread, rank in sim.lifecycle if what.startswith("destroyed") and rank == 1]
        return early, deaths, kept


@pytest.mark.timeout(60)
def test_the_events_of_an_aborted_communicator_die_on_the_main_thread_after_the_aborts():
    """The watchdog claims the communicator (``take_for_abort``) with three groups in flight: their events are kept
    (``_retired``) and die at ``close`` on rank 1's main thread, none on the watchdog's before its abort returned."""
    early, deaths, kept = _event_deaths_of_a_stall()
    assert early == [] and kept == 3
    assert deaths.count("sim-rank-1") >= 3 and "owner_reduce flush watchdog" not in deaths, deaths


@pytest.mark.timeout(60)
def test_negative_control_events_dropped_by_the_claim_die_on_the_watchdog_before_its_aborts(monkeypatch):
    original = nccl_comm.CupyNcclComm.take_for_abort

    def dropping(self):  # the claim as it was: the groups in flight forgotten on the claiming thread
        abort = original(self)
        self._retired.clear()
        return abort

    monkeypatch.setattr(nccl_comm.CupyNcclComm, "take_for_abort", dropping)
    early, _, _ = _event_deaths_of_a_stall()
    assert early, "no event died on the watchdog's thread"
    assert all("on thread 'owner_reduce flush watchdog' before its aborts returned" in e for e in early), early


# ---- finding 7: a watchdog whose poll raises ---------------------------------------------------------------------


def _poll_raises() -> tuple[OwnerReduceCommError | None, bool, list[str]]:
    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        comms = _pair(sim)

        def rank_main(rank: int):
            if rank == 0:
                return None
            comm = comms[1]
            comm.set_deadline(Deadline(60.0, "test"))  # only the raising poll can fire within this test
            _flush(comm, 4)
            sim.fail_device(1)  # a sticky CUDA error: every query of rank 1's process raises from now on
            thread = comm.watchdog._thread
            _wait_for(lambda: comm.watchdog.error is not None or not thread.is_alive(), "the watchdog fired or died",
                      timeout=5.0)
            error = comm.watchdog.error
            if error is not None:
                with pytest.raises(OwnerReduceCommError):
                    _flush(comm, 5)  # the main thread's next call raises it
            return error, thread.is_alive()

        error, _ = sim.run_ranks(rank_main, 2)[1]
        _wait_for(lambda: not any(t.startswith("owner_reduce abort") for t in _live_threads()), "the abort returned")
        return error, comms[1].aborted, comms[1].watchdog.said if hasattr(comms[1].watchdog, "said") else []


@pytest.mark.timeout(60)
def test_a_watchdog_whose_poll_raises_reports_it_as_the_ranks_failure():
    """``cudaEventQuery`` raises once the context has a sticky error. The watchdog does not end silently (no flush
    watched any more): it fires, naming the rank, the flush and the call, aborts the communicators, and the main
    thread's next call raises its error."""
    error, aborted, _ = _poll_raises()
    assert error is not None, "the watchdog's thread ended without reporting anything"
    assert re.search(r"owner_reduce: rank 1, flush #4: flush watchdog: all_reduce\(count=8, dtype=float32\) on the "
                     r"data-parallel communicator failed: the watchdog's poll of its completion raised SimError: a "
                     r"kernel failed earlier on rank 1 \(CUDA errors are sticky\): RuntimeError: CUDA error: an "
                     r"illegal memory access was encountered", str(error)), error
    assert aborted


@pytest.mark.timeout(60)
def test_negative_control_a_watchdog_without_its_guard_dies_silently(monkeypatch):
    def run(self):  # ``_run`` as it was: a poll that raises ends the thread
        while not self._stopped.is_set():
            self._wake.wait()
            while not self._stopped.wait(self.poll_s):
                if self._check(time.monotonic()):
                    return

    monkeypatch.setattr(watchdogs.FlushWatchdog, "_run", run)
    monkeypatch.setattr("threading.excepthook", lambda args: None)  # the thread's traceback is expected here
    error, aborted, _ = _poll_raises()
    assert error is None and not aborted


# ---- finding 3: aborts whose frees wait for the whole device -------------------------------------------------------

# The watchdog's bounds once the deadline passed (``test_watchdog.fast``): poll, the main thread's group, the aborts,
# the main thread's return; and a margin for a loaded machine.
FIRE_BOUND_S = 0.02 + 1.0 + 2.0 + 1.0 + 2.0


@pytest.mark.timeout(60)
def test_a_stalled_peer_with_a_kernel_stuck_outside_the_family_ends_the_process_naming_rank_flush_and_call():
    """Rank 0 never joins; on rank 1 a kernel of another library (a torch collective on the dead peer) never finishes
    on a stream of its own. The watchdog fires at the deadline; every abort's frees wait for that kernel, so none
    returns within the abort bound, and the watchdog ends the process (exit status 1) with one line on stderr that
    names the rank, the flush and the call, within the deadline plus its bounds: the guide's documented outcome."""
    with Sim(hang_bound_s=HANG_BOUND_S, device_wide_free=True) as sim:
        comms = _pair(sim)
        said = fast(comms[1].watchdog)

        def rank_main(rank: int):
            if rank == 0:
                return None
            release = sim.stall(torch.cuda.Stream(), name="a torch NCCL all_gather on the dead peer")
            started = time.monotonic()
            try:
                _flush(comms[1], 7)
                took = _wait_for(lambda: "exit 1" in said, "the process end") + 0.0
                return time.monotonic() - started, took
            finally:
                release.set()  # the process would be gone: let the stuck abort finish for the next test

        elapsed, _ = sim.run_ranks(rank_main, 2)[1]
        _wait_for(lambda: not any(t.startswith("owner_reduce abort") for t in _live_threads()), "the abort returned")
    assert elapsed <= DEADLINE.seconds + FIRE_BOUND_S, elapsed
    assert said[-1] == "exit 1", said
    assert re.search(r"owner_reduce flush watchdog: OwnerReduceCommError: owner_reduce: rank 1, flush #7: flush "
                     r"watchdog: all_reduce\(count=8, dtype=float32\) on the data-parallel communicator timed out "
                     r"after waiting 0.5 s .*\nowner_reduce: the abort of the data-parallel communicator did not "
                     r"return within 2 s; owner_reduce ends this process \(exit status 1\)", said[0]), said


@pytest.mark.timeout(60)
def test_a_wait_that_times_out_with_a_kernel_stuck_outside_the_family_raises_the_named_error_within_its_bound():
    """The same stall met by the main thread's bounded wait (the end of the backward), the watchdog asleep: the wait
    times out at the deadline, its abort cannot return, and the named error says so within the deadline plus the
    abort bound."""
    with Sim(hang_bound_s=HANG_BOUND_S, device_wide_free=True) as sim:
        comms = _pair(sim)
        comms[1].watchdog.poll_s = 600.0  # asleep: the main thread's wait is the one that fails

        def rank_main(rank: int):
            if rank == 0:
                return None
            release = sim.stall(torch.cuda.Stream(), name="a torch NCCL all_gather on the dead peer")
            _flush(comms[1], 3)
            started = time.monotonic()
            try:
                comms[1].wait_until(lambda: True, "end_backward")
            except OwnerReduceCommError as error:
                return time.monotonic() - started, error
            finally:
                release.set()
            return time.monotonic() - started, None

        waited, error = sim.run_ranks(rank_main, 2)[1]
        _wait_for(lambda: not any(t.startswith("owner_reduce abort") for t in _live_threads()), "the abort returned")
    assert error is not None and waited <= DEADLINE.seconds + 2.0 + 2.0, (waited, error)
    assert re.search(r"rank 1, flush #3: end_backward, waiting for all_reduce\(count=8, dtype=float32\) timed out "
                     r"\(and aborting the communicator failed: TimeoutError: owner_reduce: the abort of the "
                     r"data-parallel communicator did not return within 2 s", str(error)), error


# ---- finding 4: a bounded close ------------------------------------------------------------------------------------


def _close_beside_a_stuck_kernel() -> tuple[float, BaseException | None]:
    with Sim(hang_bound_s=HANG_BOUND_S, device_wide_free=True) as sim:
        comms = _pair(sim)

        def healthy(rank: int) -> None:
            buf = torch.ones(8, device="cuda")
            comms[rank].all_reduce(buf)
            comms[rank].wait_until(lambda: True, "the test's wait")

        sim.run_ranks(healthy, 2)

        def rank_main(rank: int):
            if rank == 0:
                comms[0].close()
                return None
            release = sim.stall(torch.cuda.Stream(), name="a torch NCCL all_gather on the dead peer")
            started = time.monotonic()
            try:
                comms[1].close()
            except BaseException as error:  # noqa: BLE001 - the outcome under test (SimHang included)
                return time.monotonic() - started, error
            finally:
                release.set()
            return time.monotonic() - started, None

        outcome = sim.run_ranks(rank_main, 2)[1]
        _wait_for(lambda: not any(t.startswith("owner_reduce close") for t in _live_threads()), "the destroy returned")
        return outcome


@pytest.mark.timeout(60)
def test_close_beside_a_kernel_that_never_finishes_fails_within_the_deadline():
    """``ncclCommDestroy``'s frees wait for the stuck kernel: ``close`` raises the named error at the deadline instead
    of waiting for ever (the sim's hang bound, 8 s, is what "for ever" is here)."""
    took, error = _close_beside_a_stuck_kernel()
    assert isinstance(error, OwnerReduceCommError), error
    assert took <= DEADLINE.seconds + 2.0, took
    assert re.search(r"rank 1, outside a flush: close: ncclCommDestroy has not returned \(its frees wait for every "
                     r"kernel on the GPU, and a kernel outside owner_reduce never finished\) after waiting 0.5 s",
                     str(error)), error


@pytest.mark.timeout(60)
def test_negative_control_a_destroy_on_the_main_thread_waits_for_the_stuck_kernel(monkeypatch):
    monkeypatch.setattr(nccl_comm.CupyNcclComm, "_destroy_bounded", lambda self, comm: comm.destroy())
    took, error = _close_beside_a_stuck_kernel()
    assert type(error).__name__ == "SimHang" and took >= HANG_BOUND_S, (took, error)


# ---- finding 5: NCCL's lazy connections paid at init ----------------------------------------------------------------

NUMELS = [3 + (5 * i) % 13 for i in range(30)]


def _connections_by_phase(monkeypatch, two_level: bool) -> tuple[list[list], Any]:
    """The sim's connection setups of a run of the real runtime, by phase: its init (every rank's ``init``), the
    learning step (arrival-order flushes, then the schedule learned), then two scheduled steps. Two nodes of two ranks
    with a balanced two-level flush (node, rail and node hand-off communicators), or four ranks with the one-level
    ReduceScatter and hand-off."""
    from tests.sim.test_sim_e2e import _two_level

    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        if two_level:
            _two_level(monkeypatch, sim, 2, "scatter", "balanced")
        runtimes = cupy_runtimes(sim, flat_map(NUMELS, 4), algo="two_level" if two_level else "handoff", bucket=64)
        phases = [list(sim.nccl.connections)]
        for step in range(3):
            seen = len(sim.nccl.connections)
            train_step(sim, runtimes, NUMELS, step, 1)
            check_buffers(sim, runtimes, flat_map(NUMELS, 4), NUMELS, step, 1)
            phases.append(sim.nccl.connections[seen:])
        stats = [rt.stats for rt in runtimes]
        sim.run_ranks(lambda rank: runtimes[rank].cleanup(), 4)
        return phases, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("two_level", [False, True], ids=["one-level-handoff", "two-level-balanced"])
def test_no_flush_pays_a_connection_setup(monkeypatch, two_level):
    """Every collective kind of every communicator is connected in init, each hand-off's peers when its schedule is
    learned (after the learning step's flushes): the learning step's flushes and the scheduled ones set nothing up."""
    phases, stats = _connections_by_phase(monkeypatch, two_level)
    init, learning, scheduled = phases[0], phases[1], phases[2] + phases[3]
    kinds = {key for _, _, key, _ in init}
    assert {("coll", "reduce"), ("coll", "allReduce"), ("coll", "reduceScatter")} <= kinds, kinds
    assert all(key[0] == "coll" for _, _, key, _ in init), init
    assert learning and all(key[0] == "p2p" and call.endswith("count=1, dtype=float32)")
                            for _, _, key, call in learning), learning  # connect_peers' one element
    assert scheduled == [], scheduled
    assert all(s.scheduled_flushes > 0 for s in stats)
    assert all((s.node_handoff_sends + s.sends) > 0 for s in stats), stats  # hand-offs ran, on connected peers


@pytest.mark.timeout(120)
def test_negative_control_without_the_warm_up_the_flushes_set_up_connections(monkeypatch):
    from owner_reduce.runtime.comm import ReduceComm

    monkeypatch.setattr(ReduceComm, "warm_up", lambda self, kinds, max_count: None)
    monkeypatch.setattr(ReduceComm, "connect_peers", lambda self, sends, recvs: None)
    phases, _ = _connections_by_phase(monkeypatch, two_level=True)
    assert {key for _, _, key, _ in phases[0]} == {("coll", "allGather")}  # init's agreement alone
    assert any(key[0] == "coll" for _, _, key, _ in phases[1]), phases[1]  # the learning step's flushes connect
    assert any(key[0] == "p2p" for _, _, key, _ in phases[2]), phases[2]  # the first scheduled step's hand-offs


@pytest.mark.timeout(120)
def test_the_two_level_lines_device_memory_holds_the_levels_connections(monkeypatch):
    """The "two-level flush ready" line's MiB of device memory is what the node and rail communicators took, their
    connections included (made in its window), not torch's tensors (the warm-up's buffer)."""
    from tests.sim.test_sim_e2e import _two_level
    from tests.support.sim.nccl import CONNECT_BYTES

    with Sim(hang_bound_s=HANG_BOUND_S) as sim:
        _two_level(monkeypatch, sim, 2, "scatter", "balanced")
        runtimes = cupy_runtimes(sim, flat_map(NUMELS, 4), algo="two_level", bucket=64)
        line = runtimes[0].stats.two_level_line
        levels = {m.label for m in sim.nccl.comms(0)[1:3]}  # rank 0's node and rail communicators
        taken = sum(CONNECT_BYTES[key[0]] for rank, label, key, _ in sim.nccl.connections
                    if rank == 0 and label in levels)
        assert taken == 4 * CONNECT_BYTES["coll"]  # two kinds on each
        assert f", {taken / 2**20:.0f} MiB of device memory;" in line, line
        sim.run_ranks(lambda rank: runtimes[rank].cleanup(), 4)
