"""Bounded waits: the deadline's source, the polling core with a fake event and a fake NCCL communicator, the
torch.distributed wait with fake and real (gloo) works, and the error's message."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from fakes import MirrorComm, two_gpu_ranks_env

from owner_reduce import OwnerReduceCommError
from owner_reduce.harness.launch import run_ranks
from owner_reduce.runtime import deadline as deadlines
from owner_reduce.runtime import nccl_comm
from owner_reduce.runtime.comm import ReduceComm
from owner_reduce.runtime.deadline import ENV_VAR, Deadline, poll_until_done, resolve, wait_work

SHORT = Deadline(0.2, "test")


# ---- where the deadline comes from ---------------------------------------------------------------------------


def test_resolve_prefers_the_environment_then_the_group_then_torch():
    assert resolve("7.5", 20.0) == Deadline(7.5, ENV_VAR)
    assert resolve(None, 20.0) == Deadline(20.0, "the default process group (init_distributed timeout)")
    assert resolve("  ", 20.0).seconds == 20.0
    assert resolve(None, None).seconds == deadlines.TORCH_DEFAULT_S == 1800.0
    assert "torch's default" in resolve(None, None).source


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_resolve_refuses_a_bad_override_naming_it(value):
    with pytest.raises(ValueError, match=rf"{ENV_VAR} must be a positive number of seconds, got '{value}'"):
        resolve(value, 20.0)


def test_no_process_group_means_no_group_timeout():
    assert deadlines.default_group_timeout_s() is None
    assert deadlines.from_environment({ENV_VAR: "3"}) == Deadline(3.0, ENV_VAR)


# ---- the polling core, with a fake event ---------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeEvent:
    """``query()`` is true from the ``done_after``-th call on (never, for None)."""

    def __init__(self, done_after: int | None, clock: FakeClock | None = None, tick: float = 0.0) -> None:
        self.done_after = done_after
        self.queries = 0
        self.clock, self.tick = clock, tick

    def query(self) -> bool:
        self.queries += 1
        if self.clock is not None:
            self.clock.now += self.tick
        return self.done_after is not None and self.queries >= self.done_after


def _poll(event, clock, errors=(), aborts=None, flush=3):
    errors = list(errors)
    aborts = [] if aborts is None else aborts
    return poll_until_done(event.query, deadline=SHORT, rank=1, flush=flush, call="end_backward",
                           check_error=lambda: errors.pop(0) if errors else None,
                           abort=lambda: aborts.append(1), clock=clock, sleep=clock.sleep)


def test_done_at_once_costs_one_query_and_no_error_check():
    clock = FakeClock()
    event = FakeEvent(done_after=1)
    assert _poll(event, clock, errors=["must not be read"]) == 0.0
    assert event.queries == 1 and clock.sleeps == []


def test_done_after_some_polls_returns_the_seconds_waited():
    clock, aborts = FakeClock(), []
    event = FakeEvent(done_after=40)
    waited = _poll(event, clock, aborts=aborts)
    assert event.queries == 40 and aborts == []
    assert 0 < waited < SHORT.seconds and waited == pytest.approx(sum(clock.sleeps))
    assert max(clock.sleeps) <= deadlines._MAX_SLEEP_S  # backs off, but never sleeps long


def test_timeout_aborts_once_and_names_rank_flush_call_and_seconds():
    clock, aborts = FakeClock(), []
    with pytest.raises(OwnerReduceCommError) as caught:
        _poll(FakeEvent(done_after=None), clock, aborts=aborts)
    error = caught.value
    assert aborts == [1]
    assert (error.rank, error.flush, error.call, error.reason) == (1, 3, "end_backward", "timed out")
    assert SHORT.seconds <= error.waited_s < SHORT.seconds + 2 * deadlines._MAX_SLEEP_S
    assert str(error) == (f"owner_reduce: rank 1, flush #3: end_backward timed out after waiting "
                          f"{error.waited_s:.1f} s (deadline 0.2 s from test)")


def test_async_error_aborts_once_without_waiting_for_the_deadline():
    clock, aborts = FakeClock(), []
    with pytest.raises(OwnerReduceCommError, match=r"rank 1, flush #3: end_backward failed: NcclError: remote"):
        _poll(FakeEvent(done_after=None), clock, errors=[None, None, "NcclError: remote process exited"],
              aborts=aborts)
    assert aborts == [1] and clock.now - 100.0 < SHORT.seconds


def test_a_failing_abort_is_named_but_the_wait_error_wins():
    def abort():
        raise RuntimeError("abort broke")

    with pytest.raises(OwnerReduceCommError, match=r"outside a flush: .* timed out \(and aborting the "
                                                   r"communicator failed: RuntimeError: abort broke\)"):
        clock = FakeClock()
        poll_until_done(FakeEvent(None).query, deadline=SHORT, rank=0, flush=None, call="all_gather",
                        abort=abort, clock=clock, sleep=clock.sleep)


def test_real_clock_timeout_is_close_to_the_deadline():
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError):
        poll_until_done(lambda: False, deadline=Deadline(0.05, "test"), rank=0, flush=1, call="x")
    assert 0.05 <= time.monotonic() - start < 1.0


# ---- the cupy communicator's failure handling, with a fake NCCL communicator -----------------------------------


class FakeNccl:
    """Stands for cupy's NcclCommunicator: counts abort/destroy; ``check_async_error`` raises when told."""

    def __init__(self, async_error: str | None = None) -> None:
        self.aborts = 0
        self.destroys = 0
        self.async_error = async_error

    def abort(self) -> None:
        self.aborts += 1

    def destroy(self) -> None:
        self.destroys += 1

    def check_async_error(self) -> None:
        if self.async_error:
            raise RuntimeError(self.async_error)

    def allReduce(self, *args) -> None:  # noqa: N802 - cupy's name
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE")


class FakeNcclModule:
    def __init__(self) -> None:
        self.starts = self.ends = 0

    def groupStart(self) -> None:  # noqa: N802 - cupy's name
        self.starts += 1

    def groupEnd(self) -> None:  # noqa: N802 - cupy's name
        self.ends += 1


def _cupy_comm(fake: FakeNccl, stream: FakeEvent, deadline: Deadline = SHORT) -> nccl_comm.CupyNcclComm:
    """A CupyNcclComm around a fake NCCL communicator and stream: its real wait/abort/close logic, no GPU."""
    comm = nccl_comm.CupyNcclComm.__new__(nccl_comm.CupyNcclComm)
    ReduceComm.__init__(comm, 0, 2, deadline=deadline)
    comm.stream, comm.device, comm._calls_in_group, comm._comm, comm.aborted = stream, 0, 0, fake, False
    comm._views = {}
    comm._wait_current = comm._current_waits_for = lambda stream: None
    return comm


def test_cupy_comm_timeout_aborts_exactly_once_and_never_destroys():
    fake = FakeNccl()
    comm = _cupy_comm(fake, FakeEvent(done_after=None))
    comm.flush = 4
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #4: end_backward timed out after waiting 0\.2 s"):
        comm.wait_until(FakeEvent(None).query, "end_backward")
    assert (fake.aborts, fake.destroys, comm.aborted) == (1, 0, True)
    comm.close()  # after an abort: nothing left to release, nothing waits
    comm.close()
    assert (fake.aborts, fake.destroys) == (1, 0)
    with pytest.raises(RuntimeError, match="was aborted after an earlier failure"):
        comm._live("reduce(root=1, count=3, dtype=float32)")


def test_cupy_comm_async_error_aborts_and_names_it():
    fake = FakeNccl(async_error="NCCL_ERROR_REMOTE_ERROR: remote process exited")
    comm = _cupy_comm(fake, FakeEvent(None))
    with pytest.raises(OwnerReduceCommError, match=r"flush #2: bucket growth failed: RuntimeError: NCCL_ERROR_REMOTE"):
        comm.wait_until(FakeEvent(None).query, "bucket growth", flush=2)
    assert (fake.aborts, fake.destroys) == (1, 0)


def test_cupy_comm_close_drains_then_destroys_or_aborts_when_the_stream_is_stuck():
    done = FakeNccl()
    comm = _cupy_comm(done, FakeEvent(done_after=3))
    comm.close()
    assert (done.aborts, done.destroys) == (0, 1)
    stuck = FakeNccl()
    comm = _cupy_comm(stuck, FakeEvent(None), deadline=Deadline(0.05, "test"))
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError, match=r"close \(work still in flight"):
        comm.close()
    assert (stuck.aborts, stuck.destroys) == (1, 0) and time.monotonic() - start < 2.0
    comm.close()
    assert (stuck.aborts, stuck.destroys) == (1, 0)


def test_a_failure_inside_a_group_aborts_the_communicator(monkeypatch):
    module = FakeNcclModule()
    monkeypatch.setattr(nccl_comm, "_nccl", lambda: module)
    fake = FakeNccl()
    comm = _cupy_comm(fake, FakeEvent(1))
    with pytest.raises(ValueError, match="injected"), comm.group(flush=9):
        raise ValueError("injected")
    assert (module.starts, module.ends) == (1, 1) and (fake.aborts, fake.destroys) == (1, 0)
    assert comm.flush == 9 and not comm._in_group
    # and a group without error does not abort
    healthy = FakeNccl()
    comm = _cupy_comm(healthy, FakeEvent(1))
    with comm.group(flush=1):
        pass
    assert healthy.aborts == 0


def test_a_failed_nccl_call_aborts_the_communicator():
    fake = FakeNccl()
    comm = _cupy_comm(fake, FakeEvent(1))
    with pytest.raises(RuntimeError, match="owner_reduce NCCL x failed on rank 0: RuntimeError: NCCL_ERROR_INVALID"):
        comm._call("x", lambda: fake.allReduce())
    assert fake.aborts == 1


# ---- the handle hands its flush number and the call to the wait ------------------------------------------------


class StuckStreams:
    """Streams whose reduce stream never drains: ``synchronize(wait)`` must use ``wait``, never block."""

    def synchronize(self, wait=None):
        assert wait is not None, "the handle waited without a deadline"
        wait(lambda: False)


def test_handle_waits_name_the_flush_and_the_call():
    import types

    from owner_reduce.planning.flags import OwnerReduceFlags
    from owner_reduce.planning.owner_map import OwnerMap
    from owner_reduce.runtime.handle import OwnerReduceRuntime, RuntimeSettings

    empty_map = OwnerMap.from_group_tables([], 2)
    comm = MirrorComm(rank=1, world_size=2)
    runtime = OwnerReduceRuntime(RuntimeSettings(OwnerReduceFlags(True, False), empty_map),
                                 comm_factory=lambda group: comm)
    runtime.init(None, types.SimpleNamespace(double_buffer=True), 64)
    comm.deadline = Deadline(0.05, "test")
    runtime.placer.streams = StuckStreams()
    runtime.stats.flushes = 6
    with comm.group(flush=runtime.stats.flushes + 1):  # as _flush opens it
        pass
    with pytest.raises(OwnerReduceCommError, match=r"rank 1, flush #7: end_backward timed out"):
        runtime.end_backward(graph_id=0, release_reduce_buckets=False)
    with pytest.raises(OwnerReduceCommError, match=r"rank 1, flush #7: cleanup timed out"):
        runtime.cleanup()
    assert runtime.comm is None  # cleanup still released everything after the failed wait


# ---- torch.distributed works ---------------------------------------------------------------------------------


class FakeWork:
    def __init__(self, raises: str | None = None, completed: bool = True) -> None:
        self.raises, self.completed = raises, completed
        self.timeouts: list[datetime.timedelta] = []

    def wait(self, timeout):
        self.timeouts.append(timeout)
        if self.raises:
            raise RuntimeError(self.raises)
        return True

    def is_completed(self):
        return self.completed


def test_wait_work_passes_the_remaining_time_and_names_failures():
    clock = FakeClock()
    work = FakeWork()
    wait_work(work, deadline=Deadline(20, "t"), started=clock.now - 5, rank=0, flush=1, call="reduce", clock=clock)
    assert work.timeouts == [datetime.timedelta(seconds=15)]
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #2: reduce\(root=1\) timed out after waiting 20\.0"):
        wait_work(FakeWork(raises="Operation timed out!"), deadline=Deadline(20, "t"), started=clock.now - 20,
                  rank=0, flush=2, call="reduce(root=1)", clock=clock)
    with pytest.raises(OwnerReduceCommError, match=r"all_reduce failed: RuntimeError: \[gloo\] Connection closed"):
        wait_work(FakeWork(raises="[gloo] Connection closed by peer\ndetails"), deadline=Deadline(20, "t"),
                  started=clock.now, rank=0, flush=2, call="all_reduce", clock=clock)
    late = FakeWork(completed=False)
    with pytest.raises(OwnerReduceCommError, match="timed out"):
        wait_work(late, deadline=Deadline(20, "t"), started=clock.now - 21, rank=0, flush=2, call="x", clock=clock)
    assert late.timeouts == []


def _gloo_stall(rank: int, world_size: int) -> dict:
    """Rank 1 never joins the flush: rank 0's group must fail at OWNER_REDUCE_TIMEOUT_S (2 s), naming it."""
    import os

    import deepspeed.comm as dist
    from deepspeed.utils import groups

    from owner_reduce.runtime.comm import TorchDistComm

    data_parallel = groups._get_data_parallel_group()
    out = {"group_timeout_s": deadlines.default_group_timeout_s(),
           "dp_group_timeout_s": data_parallel._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
    if rank == 1:
        os.environ.pop(ENV_VAR, None)
    comm = TorchDistComm(data_parallel)
    out["deadline"] = comm.deadline
    out["gathered"] = comm.all_gather_ints([rank])  # both ranks: completes
    if rank == 0:
        buf = torch.ones(8)
        start = time.monotonic()
        try:
            with comm.group(flush=5):
                comm.reduce(buf[:4], 0)
                comm.all_reduce(buf[4:])
        except OwnerReduceCommError as error:
            out["error"] = str(error)
        out["elapsed"] = time.monotonic() - start
        start = time.monotonic()
        try:  # an owner-ordered flush: its ReduceScatter must be bounded too (gloo's own one is not)
            with comm.group(flush=6):
                comm.reduce_scatter(buf, 4)
        except OwnerReduceCommError as error:
            out["scatter_error"] = str(error)
        out["scatter_elapsed"] = time.monotonic() - start
        start = time.monotonic()
        try:  # a hand-off round: gloo's send/recv works honour wait(timeout)
            with comm.group(flush=7):
                comm.send(buf[:4], 1)
                comm.recv(buf[4:], 1)
        except OwnerReduceCommError as error:
            out["handoff_error"] = str(error)
        out["handoff_elapsed"] = time.monotonic() - start
    dist.barrier()  # the default group: rank 0 comes here after its error; rank 1 waited here all along
    return out


@pytest.mark.timeout(120)
def test_torch_dist_flush_fails_at_the_deadline_when_a_peer_stalls():
    r0, r1 = run_ranks(_gloo_stall, 2, timeout=90, rank_env=[{ENV_VAR: "2"}, {}])
    assert r0["deadline"] == Deadline(2.0, ENV_VAR)
    # Without the override: init_distributed's timeout (DeepSpeed's default, 10 min), read from the default
    # group; DeepSpeed's data-parallel group itself carries torch's 30 minutes.
    assert r1["deadline"] == Deadline(600.0, "the default process group (init_distributed timeout)")
    assert r0["group_timeout_s"] == 600.0 and r0["dp_group_timeout_s"] == 1800.0
    assert r0["gathered"] == r1["gathered"] == [[0], [1]]
    assert r0["error"].startswith("owner_reduce: rank 0, flush #5: reduce(root=0, count=4, dtype=float32) "
                                  "(call 1 of 2) timed out after waiting 2.0 s "
                                  "(deadline 2 s from OWNER_REDUCE_TIMEOUT_S)"), r0
    assert 1.9 <= r0["elapsed"] < 10.0  # gloo's timed wait may wake a few µs early
    assert r0["scatter_error"].startswith("owner_reduce: rank 0, flush #6: reduce(root=0, count=4, dtype=float32) "
                                          "(call 1 of 2) timed out after waiting 2.0 s"), r0
    assert 1.9 <= r0["scatter_elapsed"] < 10.0
    # gloo's send waits for the stalled peer too (or gloo refuses the round at once, the pair to rank 1 having
    # been closed by the timeouts above): bounded and named either way.
    assert r0["handoff_error"].startswith("owner_reduce: rank 0, flush #7: "), r0
    assert any(what in r0["handoff_error"] for what in ("send(peer=1, count=4, dtype=float32) (call 1 of 2) timed out",
                                                        "recv(peer=1, count=4, dtype=float32) (call 2 of 2) timed out",
                                                        "send/recv round (2 operations")), r0
    assert r0["handoff_elapsed"] < 10.0


# ---- real NCCL (GPU only): abort on a real communicator, and a peer that never joins -------------------------

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(120)
def test_real_communicator_aborts_once_on_timeout():
    comm = nccl_comm.CupyNcclComm(nccl_comm.new_unique_id(), 0, 1)
    comm.deadline = Deadline(0.1, "test")
    assert comm.all_gather_ints([5]) == [[5]]  # the polled wait of a completed collective
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #1: end_backward timed out"):
        comm.wait_until(lambda: False, "end_backward", flush=1)
    assert comm.aborted and comm._comm is None
    comm.close()  # nothing left: returns at once
    with pytest.raises(RuntimeError, match="was aborted after an earlier failure"):
        comm.all_reduce(torch.ones(4, device="cuda"))


def _gpu_peer_never_joins(rank: int, world_size: int) -> dict:
    """Rank 1 builds the communicator, then sleeps through rank 0's flush: rank 0 must fail at the deadline
    (3 s) by polling, abort, and come back; rank 1's own flush afterwards finds an aborted peer."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = nccl_comm.CupyNcclComm.from_process_group(dist.group.WORLD)
    out: dict = {"deadline": comm.deadline}
    buf = torch.ones(1 << 16, device="cuda")
    # Warm-up flush on both ranks: NCCL connects its transports lazily, on the host inside ncclGroupEnd, which
    # no polling can bound; after this the flush below only enqueues and its wait is the polled one.
    with comm.group(flush=0):
        comm.all_reduce(buf)
    comm.wait_until(torch.cuda.current_stream().query, "warm-up")
    if rank == 1:
        time.sleep(8)
    start = time.monotonic()
    try:
        with comm.group(flush=1):
            comm.all_reduce(buf)
        comm.wait_until(torch.cuda.current_stream().query, "end_backward")
        out["error"] = None
    except OwnerReduceCommError as error:
        out["error"] = str(error)
    out["elapsed"] = time.monotonic() - start
    out["aborted"] = comm.aborted
    comm.close()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
def test_real_nccl_flush_fails_at_the_deadline_when_a_peer_never_joins():
    env = {ENV_VAR: "3", **two_gpu_ranks_env()}
    r0, r1 = run_ranks(_gpu_peer_never_joins, 2, timeout=150, env=env)
    assert r0["deadline"] == Deadline(3.0, ENV_VAR)
    assert r0["error"] and "rank 0, flush #1: end_backward " in r0["error"] and r0["aborted"], r0
    assert 3.0 <= r0["elapsed"] < 15.0, r0
    assert r1["error"] and r1["aborted"] and r1["elapsed"] < 15.0, r1  # its peer aborted: it cannot finish either
