"""A stall that names who: at the deadline, the ranks that never reached the stalled flush, and their hosts.

Why: a stalled flush's error names the rank that reports it; at 512 ranks "the rank that did not print this error"
is a diff of 512 logs. torch's NCCL watchdog and flight recorder name the last collective each rank reached; this does
the same for owner_reduce's flushes, through a channel that does not depend on the stalled communicator: torch's
default store (``distributed_c10d._get_default_store()``, the rendezvous' TCPStore), which every rank of the job
already holds.

Note (zero store traffic in healthy steps): nothing is written while flushes complete. A rank whose oldest pending
flush has waited ``MARK_AFTER_S`` (healthy flushes take milliseconds) writes one mark, "arrived at flush N", once per
stalled flush, from where its waits are polled: on a GPU, the flush watchdog's thread (``watchdog``), which polls
every flush in flight whether or not the main thread reaches a wait; on gloo, whose bounded wait blocks in
``Work.wait`` and cannot be cut short (a timed-out wait closes a send/recv pair), this reporter's own thread, told of
each wait by ``deadline.wait_work`` (``watch``: two attribute writes), which looks every ``WATCH_POLL_S``. A mark is
one ``store.add`` on this rank's own key: the key holds the newest flush the rank reached, so a rank stuck at a later
flush counts as having passed an earlier one.

Note (the report): where a wait times out, ``OwnerReduceCommError`` asks the deadline's reporter (``Deadline.stall``)
to explain the flush: it reads every expected rank's key (``store.add(key, 0)``: a read that never blocks on a missing
key), waits up to ``GRACE_S`` for ranks that arrived within the last second (their mark comes ``MARK_AFTER_S`` after
their arrival), and names the ranks with none, with their hosts (exchanged once at init: ``planning.nodes``), e.g.
``flush #12 (reduce_scatter on the rail communicator): ranks 17, 18 on host gpu-node-03 never arrived``; where every
rank arrived, ``every rank reached flush #12; the stall is on the device or the network``. The expected ranks are the
stalled communicator's members (a node or rail communicator's, from its name in the call). A rank that passed the
flush and then stopped outside owner_reduce's waits has no mark for it and is named too.

Note (bounded): every store call runs on a daemon thread of its own; a mark is never waited for, a report's reads are
waited for at most ``STORE_BOUND_S`` in all, so a dead store (its server's rank stopped) cannot hang the caller: the
report then says the store did not answer. A failing report never replaces the error: it becomes its text. So a
stalled flush's error comes at most ``REPORT_BOUND_S`` later than before.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..planning.wording import GROUPS_SHOWN, count_noun, ranks_phrase
from . import threads

MARK_AFTER_S = 1.0  # a flush waiting this long on a rank writes its arrival (Note (zero store traffic ...))
WATCH_POLL_S = 0.25  # how often the reporter's thread looks at a blocking wait (``watch``)
GRACE_S = 1.5  # the report's wait for the marks of ranks that arrived in the last second (MARK_AFTER_S + polls)
STORE_BOUND_S = 2.0  # the report's store reads, all together, before it says the store did not answer
REPORT_BOUND_S = GRACE_S + STORE_BOUND_S  # how much later a stalled flush's error comes
KEY_PREFIX = "owner_reduce/stall"
_KINDS = re.compile(r"\b(reduce_scatter|all_reduce|all_gather|reduce|send/recv|send|recv)\(")
_ROLE = re.compile(r" on the ([\w -]+?) communicator")
_SEQUENCE = [0]  # runtimes made in this process: with the data-parallel group's first rank, each runtime's keys


def default_store() -> Any:
    """torch's default store (the rendezvous' store every rank holds), or None without a process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: no report, never a failure
        return None


def next_sequence() -> int:
    """This process's next runtime number (1, 2, ...): rank 0's names the keys of a runtime (``handle``)."""
    _SEQUENCE[0] += 1
    return _SEQUENCE[0]


def _detached(fn: Callable[[], Any], name: str) -> tuple[threads.DeviceThread, list[Any]]:
    """Run ``fn`` on a daemon thread: (the thread, a list that gets its result or its exception)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            out.append(error)

    # On the rank's device, as every thread of the runtime (``threads``), although it makes no CUDA call.
    thread = threads.start(run, name=f"owner_reduce stall report: {name}", device=threads.current_cuda_device())
    return thread, out


class StallReporter:
    """One runtime's marks and reports (module notes). ``keys[r]``, ``hosts[r]``, ``global_ranks[r]``: data-parallel
    rank r's; ``me``: this rank's; ``members``: this rank's sub-communicators' ranks as data-parallel ranks, by role
    (``node``, ``rail``, ``node hand-off``)."""

    def __init__(self, store: Any, prefix: str, me: int, global_ranks: Sequence[int], hosts: Sequence[str],
                 members: dict[str, Sequence[int]] | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._store = store
        self._keys = [f"{prefix}/rank{g}" for g in global_ranks]
        self._me = me
        self._global_ranks = list(global_ranks)
        self._hosts = list(hosts)
        self.members = dict(members or {})
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._marked = 0  # the newest flush this rank's key holds
        self._reports: dict[tuple[int, str], str] = {}
        self.marks_written = 0  # tests: marks this rank wrote (each one store call)
        self._watched: tuple[int, float] | None = None  # (flush, since): the main thread's blocking wait (``watch``)
        self._watcher: threads.DeviceThread | None = None
        self._closed = threading.Event()

    # ---- marks -------------------------------------------------------------------------------------------------

    def waiting(self, flush: int | None, since: float, now: float | None = None) -> None:
        """A poller's hook: this rank's oldest pending flush ``flush`` has waited since ``since``
        (``time.monotonic()``). Writes the mark once it waited ``MARK_AFTER_S``, once per flush, never waited for."""
        if flush is None or flush <= self._marked:
            return
        if (self._clock() if now is None else now) - since < MARK_AFTER_S:
            return
        self.arrived(flush)

    def watch(self, flush: int, since: float) -> None:
        """The main thread starts a blocking wait on ``flush`` (gloo's ``Work.wait``, which cannot be cut short: a
        timed-out wait closes a send/recv pair): this reporter's thread marks the arrival if it lasts ``MARK_AFTER_S``.
        Two attribute writes on the hot path; the thread is started at the first watch and polls every
        ``WATCH_POLL_S``."""
        self._watched = (flush, since)
        if self._watcher is None:
            self._start_watcher()

    def unwatch(self) -> None:
        self._watched = None

    def _start_watcher(self) -> None:
        def run() -> None:
            while not self._closed.wait(WATCH_POLL_S):
                watched = self._watched
                if watched is not None:
                    self.waiting(watched[0], watched[1])

        self._watcher = threads.start(run, name="owner_reduce stall report: watch",
                                      device=threads.current_cuda_device())

    def close(self) -> None:
        """Stop the watching thread (the runtime's cleanup)."""
        self._closed.set()

    def arrived(self, flush: int) -> None:
        """This rank reached ``flush`` and it has waited ``MARK_AFTER_S`` (the caller's own timed wait said so): the
        mark, once per flush, on a daemon thread, never waited for."""
        self._mark(flush)

    def _mark(self, flush: int) -> None:
        with self._lock:
            step = flush - self._marked
            if step <= 0:
                return
            self._marked = flush
            self.marks_written += 1
        _detached(lambda: self._store.add(self._keys[self._me], step), f"mark flush #{flush}")

    # ---- the report ----------------------------------------------------------------------------------------------

    def explain(self, flush: int, call: str) -> str:
        """The report for a stalled ``flush`` whose wait on ``call`` timed out (module Note (the report)); the same
        text for every later error of this flush and communicator. Never raises."""
        role = match.group(1) if (match := _ROLE.search(call)) else "data-parallel"
        kinds = _KINDS.findall(call)
        what = f"flush #{flush} ({kinds[-1] if kinds else 'its calls'} on the {role} communicator)"
        with self._lock:
            known = self._reports.get((flush, role))
        if known is not None:
            return known
        try:
            self._mark(flush)  # this rank reached it (a wait shorter than MARK_AFTER_S wrote nothing yet)
            text = self._report(flush, role, what)
        except Exception as error:  # noqa: BLE001 - the report never replaces the stall's error
            text = f"{what}: which ranks never arrived is unknown ({type(error).__name__}: {error})"
        with self._lock:
            return self._reports.setdefault((flush, role), text)

    def _report(self, flush: int, role: str, what: str) -> str:
        expected = [r for r in self.members.get(role, range(len(self._keys))) if r != self._me]
        started = self._clock()
        missing = expected
        while True:
            thread, out = _detached(lambda rs=missing: [int(self._store.add(self._keys[r], 0)) for r in rs],
                                    f"read flush #{flush}")
            thread.join(max(0.0, started + STORE_BOUND_S + GRACE_S - self._clock()))
            if not out:
                return (f"{what}: which ranks never arrived is unknown: torch's default store did not answer within "
                        f"{STORE_BOUND_S + GRACE_S:g} s")
            if isinstance(out[0], BaseException):
                raise out[0]
            missing = [r for r, value in zip(missing, out[0], strict=True) if value < flush]
            if not missing or self._clock() - started >= GRACE_S:
                break
            self._sleep(0.1)
        if not missing:
            return f"every rank reached {what}; the stall is on the device or the network"
        return f"{what}: {self._who(missing)} never arrived"

    def _who(self, ranks: Sequence[int]) -> str:
        """``ranks 17, 18 on host gpu-node-03, rank 40 on host gpu-node-05``: global ranks grouped by host (capped)."""
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self._hosts[r] if r < len(self._hosts) else "unknown", []).append(self._global_ranks[r])
        items = list(by_host.items())
        text = ", ".join(f"{ranks_phrase(g)} on host {host}" for host, g in items[:GROUPS_SHOWN])
        rest = [g for _, gs in items[GROUPS_SHOWN:] for g in gs]
        if rest:
            text += f" and {ranks_phrase(rest)} on {count_noun(len(items) - GROUPS_SHOWN, 'other host')}"
        return text


__all__ = ["GRACE_S", "KEY_PREFIX", "MARK_AFTER_S", "REPORT_BOUND_S", "STORE_BOUND_S", "WATCH_POLL_S",
           "StallReporter", "default_store", "next_sequence"]
