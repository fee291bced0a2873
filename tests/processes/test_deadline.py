"""Bounded waits: the deadline's source, the polling core with a fake event and a fake clock, the torch.distributed
wait with fake and real (gloo) works, and the error's message. The cupy communicator's waits, aborts and group rules
run on the simulated device's NCCL (``tests/sim/test_sim_nccl_comm.py``).

torch.distributed and its works are the suite's stand-in for that layer (``tests.support.tdist``: the simulated device
models cupy's NCCL, not torch's process group). ``FakeClock``/``FakeEvent`` stay here: they time the polling core itself
(``poll_until_done`` takes its clock and completion as arguments)."""

from __future__ import annotations

import datetime
import re
import threading
import time
import types

import pytest
import torch

from harness.launch import run_ranks
from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import deadline as deadlines
from owner_reduce.runtime import nccl_binding, nccl_comm
from owner_reduce.runtime.deadline import CONFIG_SOURCE, Deadline, poll_until_done, resolve, wait_work
from tests.support.fakes import MirrorComm, two_gpu_ranks_env
from tests.support.tdist import DeviceBuf, FakeGroup, FakeTdist, HostWork

SHORT = Deadline(0.2, "test")
# A stall fails within its deadline plus this. The bound is the claim; the slack is this loaded 2-core host's
# scheduling (the polls themselves sleep at most 0.2 ms), not the product's.
SLACK_S = 2.0


@pytest.fixture(autouse=True)
def _no_flush_watchdog(monkeypatch):
    """These tests bound the main thread's own waits and aborts; the flush watchdog, which counts each group's deadline
    from its issue and would race them at the same short deadline, is tested on its own (tests/sim/test_watchdog.py)."""
    from owner_reduce.runtime.watchdog import FlushWatchdog

    monkeypatch.setattr(FlushWatchdog, "arm", lambda self: None)


# ---- where the deadline comes from ---------------------------------------------------------------------------


def test_resolve_prefers_the_config_key_then_the_group_then_torch():
    assert resolve(7.5, 20.0) == Deadline(7.5, "compile.reduce_to_owner_timeout_s")
    assert resolve(7.5, 20.0).short_source == CONFIG_SOURCE
    assert resolve(None, 20.0) == Deadline(20.0, "the default process group (init_distributed timeout)")
    assert resolve(None, 20.0).short_source == "init_distributed"
    assert resolve(None, None).seconds == deadlines.TORCH_DEFAULT_S == 1800.0
    assert "torch's default" in resolve(None, None).source


def test_no_process_group_means_no_group_timeout(monkeypatch):
    monkeypatch.setenv("OWNER_REDUCE_TIMEOUT_S", "3")  # no longer read: the key replaced it
    assert deadlines.default_group_timeout_s() is None
    assert deadlines.from_environment() == resolve(None, None)


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
    assert SHORT.seconds <= error.waited_s < SHORT.seconds + 2 * deadlines._MAX_SLEEP_S  # the fake clock's seconds
    # The message says the deadline as configured; the measured seconds are a separate fact, matched as a number only.
    assert re.fullmatch(r"owner_reduce: rank 1, flush #3: end_backward timed out after waiting 0\.2 s \(the deadline, "
                        r"from test; measured \d+\.\d s\)", str(error)), str(error)


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
    with pytest.raises(OwnerReduceCommError, match=r"x timed out after waiting 0\.05 s \(the deadline, from test;"):
        poll_until_done(lambda: False, deadline=Deadline(0.05, "test"), rank=0, flush=1, call="x")
    assert 0.05 <= time.monotonic() - start < 0.05 + SLACK_S


# ---- the cupy communicator's failure handling: on the simulated device's NCCL, tests/sim/test_sim_nccl_comm.py -----


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
    from owner_reduce.planning.settings import OwnerReduceSettings
    from owner_reduce.runtime.handle import OwnerReduceRuntime

    empty_map = OwnerMap.from_group_tables([], 2)
    comm = MirrorComm(rank=1, world_size=2)
    runtime = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False)), empty_map, lambda group: comm)
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


def test_wait_work_passes_the_remaining_time_and_names_failures():
    clock = FakeClock()
    work = HostWork()
    wait_work(work, deadline=Deadline(20, "t"), started=clock.now - 5, rank=0, flush=1, call="reduce", clock=clock)
    assert work.timeouts == [datetime.timedelta(seconds=15)]
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #2: reduce\(root=1\) timed out after waiting 20 s "
                                                   r"\(the deadline, from t; measured "):
        wait_work(HostWork(raises="Operation timed out!"), deadline=Deadline(20, "t"), started=clock.now - 20,
                  rank=0, flush=2, call="reduce(root=1)", clock=clock)
    with pytest.raises(OwnerReduceCommError, match=r"all_reduce failed: RuntimeError: \[gloo\] Connection closed"):
        wait_work(HostWork(raises="[gloo] Connection closed by peer\ndetails"), deadline=Deadline(20, "t"),
                  started=clock.now, rank=0, flush=2, call="all_reduce", clock=clock)
    late = HostWork(completed=False)
    with pytest.raises(OwnerReduceCommError, match="timed out"):
        wait_work(late, deadline=Deadline(20, "t"), started=clock.now - 21, rank=0, flush=2, call="x", clock=clock)
    assert late.timeouts == []


# ---- torch.distributed on NCCL (CUDA tensors): ordered on the stream, bounded at the next sync point ------------


def _device_flush(comm, flush: int) -> None:
    """A hand-off flush as the runtime issues it: ReduceScatter + AllReduce, then the send/recv round."""
    with comm.group(flush=flush):
        comm.reduce_scatter(DeviceBuf(8), 4)
        comm.all_reduce(DeviceBuf(4))
    with comm.group(flush=flush):
        comm.send(DeviceBuf(2), 1)
        comm.recv(DeviceBuf(2), 1)


def test_torch_dist_on_nccl_never_blocks_the_host_per_flush():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdist = FakeTdist(complete=False)  # a peer stalls: nothing ever completes
    comm = TorchDistComm(FakeGroup(), tdist=tdist)
    comm.deadline = SHORT
    _device_flush(comm, 3)
    comm.reduce(DeviceBuf(4), 1)  # outside a group, too: the flushes returned (the works never complete)
    assert len(tdist.works) == 5
    assert [w.host_waits for w in tdist.works] == [[]] * 5  # no Work.wait: the host never blocked
    assert [w.stream_waits for w in tdist.works] == [1] * 5  # each ordered on the (reduce) stream instead


def test_torch_dist_on_nccl_stall_fails_at_the_next_sync_point_within_the_deadline():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    group = FakeGroup()
    comm = TorchDistComm(group, tdist=FakeTdist(complete=False))
    comm.deadline = SHORT
    _device_flush(comm, 3)
    _device_flush(comm, 4)
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError) as caught:
        comm.wait_until(lambda: True, "end_backward")  # the reduce stream itself reports done: the works do not
    elapsed = time.monotonic() - start
    assert SHORT.seconds <= elapsed < SHORT.seconds + SLACK_S
    error = caught.value
    assert (error.rank, error.flush, error.reason) == (0, 3, "timed out")
    assert str(error).startswith("owner_reduce: rank 0, flush #3: end_backward, waiting for reduce_scatter(count=8, "
                                 "dtype=float32) (call 1 of 2) timed out after waiting 0.2 s (the deadline, from "
                                 "test; measured ")
    assert group.aborts == 1  # the process group is aborted (once), so no NCCL kernel keeps spinning
    comm.wait_until(lambda: True, "cleanup")  # nothing in flight any more: returns
    comm.close()
    assert group.aborts == 1


def test_torch_dist_on_nccl_sync_point_returns_when_the_works_complete_and_names_a_failed_one():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdist = FakeTdist(complete=False)
    group = FakeGroup()
    comm = TorchDistComm(group, tdist=tdist)
    comm.deadline = SHORT
    _device_flush(comm, 1)
    for work in tdist.works:
        work.completed = True
    comm.wait_until(lambda: True, "end_backward")
    assert comm._in_flight == [] and group.aborts == 0
    _device_flush(comm, 2)
    tdist.works[-3].error = RuntimeError("NCCL error: remote process exited or there was a network error\nmore")
    comm.deadline = Deadline(60.0, "test")  # a failed work ends the wait at once, long before this deadline
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #2: end_backward, waiting for reduce_scatter.* "
                                                   r"failed: all_reduce\(count=4, dtype=float32\) \(call 2 of 2\) "
                                                   r"of flush #2: RuntimeError: NCCL error: remote process exited"):
        comm.wait_until(lambda: True, "end_backward")
    assert time.monotonic() - start < 60.0 and group.aborts == 1


def _levels(dp, node_complete: bool, rail_complete: bool):
    """Data-parallel rank 0's node and rail communicators of two nodes of two ranks, made through ``split`` (so it keeps
    them): its node holds data-parallel ranks 0 and 1, its rail 0 and 2. Each group's warm-up at the split completes;
    its flushes' works complete as ``node_complete`` and ``rail_complete`` say."""
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdists = [FakeTdist(), FakeTdist()]
    made = iter([TorchDistComm(FakeGroup(), tdist=tdist) for tdist in tdists])
    dp._split = lambda groups: next(made)
    node, rail = dp.split([[0, 1], [2, 3]], "node"), dp.split([[0, 2], [1, 3]], "rail")
    for sub, tdist, complete in zip((node, rail), tdists, (node_complete, rail_complete), strict=True):
        sub.deadline = dp.deadline
        tdist.complete = complete
    return node, rail


def _two_level_flush(node, rail, flush: int) -> None:
    with node.group(flush=flush):
        node.reduce_scatter(DeviceBuf(8), 4)
    with rail.group(flush=flush):
        rail.reduce(DeviceBuf(4), 1)


def test_a_stalled_rail_fails_the_data_parallel_wait_naming_it_and_aborts_every_level():
    """The runtime waits on the data-parallel communicator only; a two-level flush's rail Reduce that never ends must
    still fail that wait within the deadline, name the rail's call and flush, and abort all three communicators (a
    kernel left on the node or rail communicator would keep the GPU after the error)."""
    from owner_reduce.runtime.torch_comm import TorchDistComm

    dp = TorchDistComm(FakeGroup(), tdist=FakeTdist(complete=True))
    dp.deadline = SHORT
    node, rail = _levels(dp, node_complete=True, rail_complete=False)
    _two_level_flush(node, rail, 5)
    start = time.monotonic()
    with pytest.raises(OwnerReduceCommError) as caught:
        dp.wait_until(lambda: True, "end_backward")  # the reduce stream reports done; the rail's work does not
    assert SHORT.seconds <= time.monotonic() - start < SHORT.seconds + SLACK_S
    assert str(caught.value).startswith("owner_reduce: rank 0, flush #5: end_backward, waiting for reduce(root=1 = "
                                        "data-parallel rank 2, count=4, dtype=float32) on the rail communicator timed "
                                        "out after waiting 0.2 s (the deadline, from test; measured ")
    assert [c._group.aborts for c in (dp, node, rail)] == [1, 1, 1]
    assert node._in_flight == [] and rail._in_flight == []
    dp.close_subs()
    assert dp.subs == []


def test_a_failed_node_call_is_reported_as_the_node_communicators_and_a_finished_flush_leaves_nothing_in_flight():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    dp = TorchDistComm(FakeGroup(), tdist=FakeTdist(complete=True))
    dp.deadline = SHORT
    node, rail = _levels(dp, node_complete=True, rail_complete=True)
    for flush in (1, 2, 3):
        _two_level_flush(node, rail, flush)
    dp.wait_until(lambda: True, "end_backward")  # every sub-communicator's works are forgotten at the sync point
    assert node._in_flight == [] and rail._in_flight == []
    assert [c._group.aborts for c in (dp, node, rail)] == [0, 0, 0]
    _two_level_flush(node, rail, 4)
    node._in_flight[0].work.error = RuntimeError("NCCL error: unhandled system error\nmore")
    with pytest.raises(OwnerReduceCommError, match=r"flush #4: end_backward.* failed: node communicator: "
                                                   r"reduce_scatter\(count=8, dtype=float32\).*: RuntimeError: NCCL "
                                                   r"error: unhandled system error"):
        dp.wait_until(lambda: True, "end_backward")
    assert [c._group.aborts for c in (dp, node, rail)] == [1, 1, 1]


def test_torch_dist_on_nccl_names_a_coalesced_send_recv_round():
    """NCCL's batch_isend_irecv returns one work for the whole round (torch coalesces it): still one call, named."""
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdist = FakeTdist(complete=False, coalesce=True)
    comm = TorchDistComm(FakeGroup(), tdist=tdist)
    comm.deadline = SHORT
    with comm.group(flush=2):
        comm.send(DeviceBuf(2), 1)
        comm.recv(DeviceBuf(3), 1)
    assert len(tdist.works) == 1 and tdist.works[0].stream_waits == 1 and tdist.works[0].host_waits == []
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, flush #2: end_backward, waiting for send/recv\(count=5, "
                                                   r"dtype=float32\) timed out"):
        comm.wait_until(lambda: True, "end_backward")


def test_torch_dist_on_gloo_still_waits_on_the_host_within_the_deadline():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdist = FakeTdist(complete=True)
    comm = TorchDistComm(FakeGroup(), tdist=tdist)
    comm.deadline = Deadline(20, "t")
    with comm.group(flush=1):
        comm.all_reduce(torch.ones(4))
        comm.reduce(torch.ones(4), 1)
    assert [len(w.timeouts) for w in tdist.works] == [1, 1] and comm._in_flight == []
    assert all(0 < w.timeouts[0].total_seconds() <= 20 for w in tdist.works)


def _gloo_stall(rank: int, world_size: int) -> dict:
    """Rank 1 never joins the flush: rank 0's group must fail at its deadline (2 s, as compile.reduce_to_owner_timeout_s
    gives it), naming it."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    from owner_reduce.runtime.torch_comm import TorchDistComm

    data_parallel = groups._get_data_parallel_group()
    out = {"group_timeout_s": deadlines.default_group_timeout_s(),
           "dp_group_timeout_s": data_parallel._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
    comm = TorchDistComm(data_parallel)
    if rank == 0:
        comm.set_deadline(resolve(2.0, deadlines.default_group_timeout_s()))  # what the runtime does after init
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
    r0, r1 = run_ranks(_gloo_stall, 2, timeout=90)
    assert r0["deadline"] == Deadline(2.0, CONFIG_SOURCE)
    # Without the key: init_distributed's timeout (DeepSpeed's default, 10 min), read from the default
    # group; DeepSpeed's data-parallel group itself carries torch's 30 minutes.
    assert r1["deadline"] == Deadline(600.0, "the default process group (init_distributed timeout)")
    assert r0["group_timeout_s"] == 600.0 and r0["dp_group_timeout_s"] == 1800.0
    assert r0["gathered"] == r1["gathered"] == [[0], [1]]
    waited = ("(call 1 of 2) timed out after waiting 2 s (the deadline, from compile.reduce_to_owner_timeout_s; "
              "measured ")
    assert r0["error"].startswith(f"owner_reduce: rank 0, flush #5: reduce(root=0, count=4, dtype=float32) "
                                  f"{waited}"), r0
    # It waited the deadline (less gloo's timed wait waking a few ms early) and failed within the deadline plus 8 s
    # (two gloo ranks and the process group on this loaded 2-core host): the bound is the claim.
    assert 1.9 <= r0["elapsed"] < 10.0
    assert r0["scatter_error"].startswith(f"owner_reduce: rank 0, flush #6: reduce(root=0, count=4, dtype=float32) "
                                          f"{waited}"), r0
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
    comm = nccl_comm.CupyNcclComm(nccl_binding.new_unique_id(), 0, 1)
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
    comm.set_deadline(deadlines.resolve(3.0, None))  # compile.reduce_to_owner_timeout_s 3, as the runtime sets it
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
    r0, r1 = run_ranks(_gpu_peer_never_joins, 2, timeout=150, env=two_gpu_ranks_env())
    assert r0["deadline"] == Deadline(3.0, CONFIG_SOURCE)
    assert r0["error"] and "rank 0, flush #1: end_backward " in r0["error"] and r0["aborted"], r0
    assert 3.0 <= r0["elapsed"] < 15.0, r0
    assert r1["error"] and r1["aborted"] and r1["elapsed"] < 15.0, r1  # its peer aborted: it cannot finish either


def _torch_nccl_stream_ordered(rank: int, world_size: int) -> dict:
    """One rank on torch's NCCL process group: a flush's works are ordered on a side stream, the host never waits
    for them, and the sync point's bounded wait sees them complete."""
    import torch.distributed as dist

    from owner_reduce.runtime.torch_comm import TorchDistComm

    comm = TorchDistComm(dist.group.WORLD)
    buf = torch.arange(8, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), comm.group(flush=1):
        comm.all_reduce(buf[:4])
        comm.reduce(buf[4:], 0)
    out = {"in_flight": len(comm._in_flight)}
    comm.wait_until(side.query, "end_backward")
    out["after_wait"] = len(comm._in_flight)
    torch.cuda.current_stream().wait_stream(side)
    out["values"] = buf.cpu().tolist()
    out["gathered"] = comm.all_gather_ints([3, 4])
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.timeout(120)
def test_torch_nccl_flush_is_stream_ordered_and_waited_at_the_sync_point():
    (out,) = run_ranks(_torch_nccl_stream_ordered, 1, timeout=100, dist_backend="nccl")
    assert out["in_flight"] == 2 and out["after_wait"] == 0
    assert out["values"] == [float(i) for i in range(8)] and out["gathered"] == [[3, 4]]


# ---- a communicator's creation: Note (a blocking init) ----------------------------------------------------------


def test_a_creation_that_returns_or_raises_in_time_stops_the_watchdog():
    ends: list[int] = []
    said: list[str] = []
    kw = {"deadline": Deadline(0.3, "test"), "rank": 2, "what": "ncclCommInitRank (world_size=2, rank=1)",
          "write": said.append, "end": ends.append}
    assert deadlines.end_process_if_still_blocked(lambda: "comm", **kw) == "comm"
    with pytest.raises(RuntimeError, match="no GPU"):
        deadlines.end_process_if_still_blocked(lambda: (_ for _ in ()).throw(RuntimeError("no GPU")), **kw)
    time.sleep(0.5)  # past the deadline: a watchdog left running would end the process now
    assert (ends, said) == ([], [])


def test_a_creation_still_blocked_at_the_deadline_says_why_and_ends_the_process():
    ends: list[int] = []
    said: list[str] = []
    released = threading.Event()

    def end(code: int) -> None:  # a real end never returns; this one lets the blocked call go
        ends.append(code)
        released.set()

    started = time.monotonic()
    deadlines.end_process_if_still_blocked(lambda: released.wait(10), deadline=Deadline(0.3, CONFIG_SOURCE), rank=5,
                                           what="ncclCommInitRank (world_size=8, rank=5, device=cuda:5)",
                                           write=said.append, end=end)
    assert 0.3 <= time.monotonic() - started < 5
    assert ends == [deadlines.BLOCKED_EXIT_CODE]
    (message,) = said
    assert message.startswith("owner_reduce: rank 5: ncclCommInitRank (world_size=8, rank=5, device=cuda:5) has not "
                              f"returned after 0.3 s (deadline 0.3 s from {CONFIG_SOURCE}): a peer never joined it")
    assert "ends this process (exit status 1)" in message


_BLOCKED_CREATION = """
import contextlib, threading, sys, time, types
import cupy
from owner_reduce.runtime import deadline, nccl_binding, nccl_comm

class Blocked:  # ncclCommInitRank waiting for a peer that never joins
    def __init__(self, world_size, unique_id, rank):
        threading.Event().wait()

nccl_binding.nccl_module = lambda: types.SimpleNamespace(NcclCommunicator=Blocked, NCCL_SUM=0)
cupy.cuda.Device = lambda device: contextlib.nullcontext()
flushes = deadline.resolve(1.5, None)  # compile.reduce_to_owner_timeout_s 1.5, no process group
with deadline.init_window(deadline.for_init(flushes, 1.5, time.monotonic())):  # as the runtime's init makes it
    nccl_comm.CupyNcclComm(bytes(128), 1, 2, device=0)
print("returned", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_cupy_communicator_whose_peer_never_joins_ends_its_process_at_the_deadline():
    """A real process, the product's CupyNcclComm, a fake ncclCommInitRank that blocks (without the GIL, as cupy 14's
    does): the process ends with status 1 at the deadline and says which call on which rank."""
    pytest.importorskip("cupy.cuda.nccl")  # the base install (no cu12/cu13 extra) has no cupy
    import os
    import subprocess
    import sys

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _BLOCKED_CREATION], env=dict(os.environ), capture_output=True,
                            text=True, timeout=50)
    took = time.monotonic() - started
    assert result.returncode == deadlines.BLOCKED_EXIT_CODE, (result.stdout, result.stderr[-2000:])
    assert "returned" not in result.stdout and took < 45
    assert ("owner_reduce: rank 1: ncclCommInitRank (world_size=2, rank=1, device=cuda:0) has not returned by init's "
            f"deadline (1.5 s from {CONFIG_SOURCE}, counted from the start of init") in result.stderr


# ---- issue 31: node and rail failures name the global rank, the data-parallel root, the communicator, the flush -----


class _TimingOutTdist(FakeTdist):
    """gloo: every work's ``wait(timeout)`` raises gloo's timeout, after the group's warm-up at its creation."""

    def _work(self, buf, group, name, count=None):
        self.complete = not self.works  # the warm-up (the first work) completes, nothing after it
        return super()._work(buf, group, name, count)


def test_a_gloo_rail_that_times_out_names_the_global_rank_the_data_parallel_root_and_the_rail():
    from owner_reduce.runtime.torch_comm import TorchDistComm

    dp = TorchDistComm(FakeGroup(), tdist=FakeTdist())
    dp.deadline = SHORT
    dp._split = lambda groups: TorchDistComm(FakeGroup(), tdist=_TimingOutTdist())
    dp.global_rank = 5  # this process's rank in the job: a data-parallel group of a larger job
    rail = dp.split([[0, 2], [1, 3]], "rail")
    with pytest.raises(OwnerReduceCommError) as caught, rail.group(flush=7):
        rail.reduce(torch.ones(4), 1)
    assert str(caught.value).startswith(
        "owner_reduce: rank 5 (data-parallel rank 0), flush #7: reduce(root=1 = data-parallel rank 2, count=4, "
        "dtype=float32) on the rail communicator timed out after waiting")


def test_torch_sub_groups_are_made_by_their_members_only_and_named_by_their_ranks():
    """A data-parallel group smaller than the job: only this group's ranks split, so every group must be created with
    local synchronization (hashed name) by its members, never by counting groups per process."""
    from owner_reduce.runtime.torch_comm import TorchDistComm

    tdist = FakeTdist(ranks=(4, 6, 8, 10))  # data-parallel ranks 0, 1, 2, 3 are global ranks 4, 6, 8, 10
    dp = TorchDistComm(tdist.world, tdist=tdist)
    node = dp.split([[0, 1], [2, 3]], "node")
    rail = dp.split([[0, 2], [1, 3]], "rail")
    made = [(g.ranks, g.local) for g in tdist.made]
    assert made == [([4, 6], True), ([4, 8], True)]  # this rank's two groups, nothing else
    assert (node.members, rail.members, node.global_rank) == ((0, 1), (0, 2), 4)


def test_inits_waits_share_one_deadline_no_shorter_than_the_default_groups(monkeypatch):
    flush = Deadline(2.0, CONFIG_SOURCE)
    init = deadlines.for_init(flush, 600.0, now=100.0)
    assert (init.seconds, init.until) == (600.0, 700.0) and "counted from the start of init" in init.describe()
    assert init.allowed_s(650.0) == 50.0 and init.allowed_s(800.0) == 0.0  # what is left, never more
    longer = deadlines.for_init(Deadline(900.0, CONFIG_SOURCE), 600.0, now=0.0)
    assert longer.seconds == 900.0 and longer.source.startswith(CONFIG_SOURCE)
    assert deadlines.for_init(flush, None, now=0.0).seconds == deadlines.TORCH_DEFAULT_S
    with deadlines.init_window(init):
        assert deadlines.from_environment() is init  # every communicator made here takes it
    assert deadlines.from_environment() == resolve(None, None)


def test_the_runtime_inits_under_one_deadline_then_gives_its_communicators_the_flushes(monkeypatch):
    from owner_reduce.planning.flags import OwnerReduceFlags
    from owner_reduce.planning.settings import MODEL, OwnerReduceSettings
    from owner_reduce.runtime.handle import OwnerReduceRuntime
    from tests.support.fakes import MirrorComm, flat_map

    made = []

    def factory(group):
        made.append(MirrorComm(0, 2))  # made inside init: from_environment gives init's deadline
        return made[-1]

    rt = OwnerReduceRuntime(OwnerReduceSettings(OwnerReduceFlags(True, False), algo=MODEL, timeout_s=2.0),
                            flat_map([8, 8], 2), factory)
    seen = []
    original = MirrorComm.all_gather_ints
    monkeypatch.setattr(MirrorComm, "all_gather_ints", lambda self, values: (seen.append(self.deadline),
                                                                               original(self, values))[1])
    rt.init(None, types.SimpleNamespace(double_buffer=True), 64)
    (agreement,) = seen
    assert agreement.until is not None and agreement.seconds == deadlines.TORCH_DEFAULT_S  # init's, not 2 s
    assert made[0].deadline == Deadline(2.0, CONFIG_SOURCE)  # the flushes' from then on


def test_a_creation_gets_only_what_is_left_of_inits_deadline():
    """Init's deadline is 30 s with 0.2 s of it left: the creation is ended then, not 30 s later. The creation blocks
    until the (fake) end comes, or 10 s: no sleep decides the verdict."""
    said: list[str] = []
    ends: list[int] = []
    released = threading.Event()

    def end(code: int) -> None:  # a real end never returns; this one lets the blocked call go
        ends.append(code)
        released.set()

    init = Deadline(30.0, "test", until=time.monotonic() + 0.2)
    got = deadlines.end_process_if_still_blocked(lambda: released.wait(10) and "made", deadline=init, rank=0,
                                                 what="ncclCommInitRank (test)", write=said.append, end=end)
    assert got == "made" and ends == [deadlines.BLOCKED_EXIT_CODE], (got, ends)
    (message,) = said
    assert message.startswith("owner_reduce: rank 0: ncclCommInitRank (test) has not returned by init's deadline (30 s "
                              "from test, shared by all of init; "), message
