"""A stall that names who (``runtime.stall_report``): each rank's "arrived at flush N" mark in a store, written once
per stalled flush and never in a healthy step, and the report at the deadline naming the ranks with no mark and their
hosts, bounded in time where the store is dead. On torch's in-process ``HashStore`` and in-process ranks; the gloo
processes (``test_bounded_failure.py``) and the simulated device (``test_watchdog_sim.py``, ``test_sim_findings.py``)
check the same report end to end."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.distributed import HashStore

from owner_reduce import OwnerReduceCommError
from owner_reduce.runtime import agreement, stall_report
from owner_reduce.runtime.deadline import Deadline
from owner_reduce.runtime.stall_report import GRACE_S, MARK_AFTER_S, REPORT_BOUND_S, StallReporter
from tests.support.fakes import ExchangeWorld, exchange_thread_rank, flat_map, mirror_runtime

HOSTS = ["gpu-node-01"] * 4 + ["gpu-node-02"] * 4
GLOBAL = list(range(16, 24))  # a data-parallel group of a larger job: data-parallel rank r is global rank 16 + r


class CountingStore:
    """A store that counts its calls (and can hang, as a store whose server's rank stopped would)."""

    def __init__(self, store=None, hang: bool = False) -> None:
        self.store = store or HashStore()
        self.calls = 0
        self.hang = hang

    def add(self, key: str, value: int) -> int:
        self.calls += 1
        if self.hang:
            threading.Event().wait()
        return self.store.add(key, value)


def _reporters(store, members=None) -> list[StallReporter]:
    return [StallReporter(store, "owner_reduce/stall/16/1", r, GLOBAL, HOSTS, members) for r in range(8)]


def _settle() -> None:
    time.sleep(0.2)  # a mark is written on a daemon thread of its own


def test_the_ranks_that_never_arrived_are_named_with_their_hosts():
    reporters = _reporters(HashStore())
    for r in (0, 1, 3, 4, 7):  # ranks 2, 5, 6 never reached flush 12
        reporters[r].waiting(12, since=0.0, now=MARK_AFTER_S)
    _settle()
    started = time.monotonic()
    text = reporters[0].explain(12, "reduce_scatter(count=64, dtype=bfloat16) on the data-parallel communicator")
    assert text == ("flush #12 (reduce_scatter on the data-parallel communicator): rank 18 on host gpu-node-01, ranks "
                    "21, 22 on host gpu-node-02 never arrived")
    assert GRACE_S <= time.monotonic() - started < REPORT_BOUND_S  # the stragglers' grace, then no more
    # The same text for every later error of that flush, at once (the watchdog's and the main thread's).
    again = time.monotonic()
    assert reporters[0].explain(12, "reduce_scatter(count=64) on the data-parallel communicator") == text
    assert time.monotonic() - again < 0.5


def test_negative_control_every_rank_arrived_is_said_as_such():
    reporters = _reporters(HashStore())
    for r in range(1, 8):
        reporters[r].waiting(13, since=0.0, now=5.0)  # a later flush: they passed 12 too
    _settle()
    started = time.monotonic()
    assert reporters[0].explain(12, "all_reduce(count=8, dtype=float32)") == (
        "every rank reached flush #12 (all_reduce on the data-parallel communicator); the stall is on the device or "
        "the network")
    assert time.monotonic() - started < GRACE_S  # nobody missing: no grace


def test_a_mark_is_written_once_per_stalled_flush_and_only_after_a_second():
    store = CountingStore()
    reporter = _reporters(store)[3]
    reporter.waiting(7, since=10.0, now=10.0 + MARK_AFTER_S / 2)  # a healthy flush: nothing
    assert reporter.marks_written == 0
    for _ in range(5):  # the watchdog polls every 0.1 s
        reporter.waiting(7, since=10.0, now=12.0)
    reporter.waiting(5, since=0.0, now=9.0)  # an older flush: covered by 7's mark
    _settle()
    assert (reporter.marks_written, store.calls) == (1, 1)
    reporter.waiting(9, since=20.0, now=22.0)
    _settle()
    assert store.store.add("owner_reduce/stall/16/1/rank19", 0) == 9  # the key holds the newest flush reached


def test_a_blocking_wait_is_marked_by_the_reporters_thread_after_a_second():
    """gloo's bounded wait blocks in ``Work.wait``: it only tells the reporter (``watch``), whose thread writes the
    mark once the wait has lasted ``MARK_AFTER_S``; a wait that ended first writes nothing."""
    store = CountingStore()
    reporter = _reporters(store)[2]
    try:
        reporter.watch(4, since=time.monotonic())
        time.sleep(0.3)
        reporter.unwatch()  # a healthy wait: over before the second
        time.sleep(MARK_AFTER_S)
        assert (reporter.marks_written, store.calls) == (0, 0)
        reporter.watch(5, since=time.monotonic() - MARK_AFTER_S)  # this one has waited a second already
        time.sleep(0.6)
        assert reporter.marks_written == 1 and store.store.add("owner_reduce/stall/16/1/rank18", 0) == 5
    finally:
        reporter.close()


def test_a_stalled_sub_communicators_members_are_the_expected_ranks():
    rail = {"rail": (0, 4)}  # this rank's rail: data-parallel ranks 0 and 4
    reporters = _reporters(HashStore(), rail)
    text = reporters[0].explain(3, "reduce(root=1 = data-parallel rank 4, count=8, dtype=float32) on the rail "
                                   "communicator")
    assert text == "flush #3 (reduce on the rail communicator): rank 20 on host gpu-node-02 never arrived"


def test_a_dead_store_cannot_hang_the_report():
    reporter = _reporters(CountingStore(hang=True))[0]
    started = time.monotonic()
    text = reporter.explain(4, "all_reduce(count=8, dtype=float32)")
    assert text == ("flush #4 (all_reduce on the data-parallel communicator): which ranks never arrived is unknown: "
                    f"torch's default store did not answer within {REPORT_BOUND_S:g} s")
    assert time.monotonic() - started < REPORT_BOUND_S + 1.0


def test_the_error_of_a_timed_out_flush_carries_the_report_and_a_failure_does_not():
    reporter = _reporters(HashStore())[0]
    deadline = Deadline(2.0, "compile.reduce_to_owner_timeout_s", stall=reporter)
    assert deadline == Deadline(2.0, "compile.reduce_to_owner_timeout_s")  # the reporter is no part of its value
    timed_out = OwnerReduceCommError(rank=16, flush=5, call="all_reduce(count=8, dtype=float32)", waited_s=2.0,
                                     deadline=deadline, reason="timed out")
    assert str(timed_out).endswith("measured 2.0 s); flush #5 (all_reduce on the data-parallel communicator): ranks "
                                   "17-19 on host gpu-node-01, ranks 20-23 on host gpu-node-02 never arrived")
    failed = OwnerReduceCommError(rank=16, flush=5, call="all_reduce(count=8)", waited_s=0.1, deadline=deadline,
                                  reason="failed: ncclRemoteError")
    assert failed.stall_report is None and "never arrived" not in str(failed)


@pytest.mark.timeout(60)
def test_healthy_steps_touch_no_store_and_a_runtime_keys_its_marks_by_rank_0(monkeypatch):
    """Three in-process ranks that really exchange, a store of their own (as torch's default store): init names each
    runtime's keys, and then steps of flushes make no store call at all."""
    store = CountingStore()
    monkeypatch.setattr(stall_report, "default_store", lambda: store)
    monkeypatch.setattr(agreement, "host_name", lambda: f"host-{exchange_thread_rank()}")
    world = ExchangeWorld(3, timeout_s=10.0)
    numels = [24, 40, 16, 56]
    owner_map = flat_map(numels, 3)

    def rank_main(rank):
        rt, comm = mirror_runtime(owner_map, rank=rank, comm=world.comm(rank), bucket=32, timeout_s=30.0)
        grads = {pid: torch.arange(1.0, n + 1) for pid, n in enumerate(numels)}
        for _ in range(4):
            rt.start_backward(True)
            for pid in reversed(range(len(numels))):
                rt.reduce_grad(grads[pid], 11, pid)
            rt.end_backward(11, False)
        return rt, comm

    runtimes = [rt for rt, _ in world.run(rank_main)]
    assert all(rt.stats.flushes >= 8 for rt in runtimes)
    assert store.calls == 0, "a healthy step wrote to the store"
    keys = {rt.stall_reporter._keys[rt.comm.rank] for rt in runtimes}
    assert len(keys) == 3 and len({k.rsplit("/", 1)[0] for k in keys}) == 1  # one runtime's keys, one per rank
    assert runtimes[0].stall_reporter._hosts == ["host-0", "host-1", "host-2"]
