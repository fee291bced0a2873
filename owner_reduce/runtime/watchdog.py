"""The flush watchdog: every group a flush issues on a GPU completes within the deadline counted from its issue, or
every communicator is aborted and the error is raised; where that cannot be done, the process ends.

Why a thread: on a GPU nothing waits on the host per flush, so the runtime's bounded waits (end of backward, bucket
growth, cleanup: ``comm.wait_until``) are only reached if the host gets there. When a peer stalls, flush i never
completes, its bucket's free event never fires, flush i + 2's bucket reuse makes the compute stream wait for it on
the device (``streams`` Note (bucket reuse)), and after about a thousand pending launches a CUDA launch inside the
backward blocks the host, before any bounded wait (issue 37, finding 1). The same trap closes inside NCCL when a
communicator's work FIFO fills (``ncclGroupEnd`` waits on the host for its oldest kernel). torch's ProcessGroupNCCL
has the same problem and the same answer, which this follows: a watchdog thread polling each work's completion
event and each communicator's ``ncclCommGetAsyncError``, aborting at the deadline.

One watchdog per data-parallel communicator and the sub-communicators made from it (node, rail, node hand-off: the
"family", ``comms``); the thread starts with the first group issued and sleeps while nothing is in flight. It reads
the communicators through their public protocol alone (``watch_protocol.Watched``), so it never imports ``comm``.

Note (guard): ``lock`` is held by the main thread (the thread that issues flushes) in every NCCL call and from
``ncclGroupStart`` to ``ncclGroupEnd`` (``enter``/``leave``; a cheap uncontended lock, once per group), and the
communicators are claimed for an abort only by a thread holding it. Inside it the main thread marks the calls that
may block on the host (``calling``: ``ncclGroupEnd``, every call outside a group; the calls enqueued inside a group
only enqueue), which is what tells "inside NCCL" from "in Python inside an open group". So no communicator is ever
aborted while the main thread has a group open on it (``nccl_comm`` Note (abort inside a group)) or is inside a call
on it. A claim takes each communicator's NCCL handle away (``watch_protocol.Watched.take_for_abort``): from then on
the main thread's next call on it raises without calling NCCL, the watchdog's error where it recorded one
(``raise_if_failed``).

Note (firing): each poll (``POLL_S``) checks, for every communicator of the family, the oldest group not yet seen
complete (its event, or torch's work) against the deadline from its issue, the communicator's asynchronous error
(only while the guard is free: never concurrently with the main thread's calls), and how long the main thread has
been inside an NCCL call. On the first failure the watchdog records one ``OwnerReduceCommError`` naming the rank, the
flush, the call and the communicator (the main thread's next call raises it from then on), then:
1. it takes the guard. A main thread inside an NCCL call (``ncclGroupEnd``, or a call outside a group: ``calling``)
   for ``LOCK_WAIT_S`` (blocked behind a full work FIFO, or in a lazy connection) cannot be interrupted, and one that
   keeps its group open for ``GROUP_WAIT_S`` must not be aborted under: the process ends;
2. it claims every communicator and aborts them all at once, one thread each (``abort_concurrently``): an abort
   waits for its communicator's last kernel, which may be queued behind a spinning kernel of another communicator
   on the same stream, so no order of aborts one after another is safe (finding 2); an abort that has not returned
   after ``ABORT_BOUND_S`` ends the process;
3. with the NCCL kernels gone the streams drain, and the main thread, wherever it was blocked (a CUDA launch in the
   backward, a wait on the device for a bucket), reaches its next call of a communicator (the next flush's group,
   the end of backward's wait), which raises the recorded error; if it has not within ``GRACE_S``, the process ends.
Ending the process is what init's watchdog does (``deadline.end_process_if_still_blocked``): the error on stderr,
then ``os._exit(BLOCKED_EXIT_CODE)``. So every rank fails within the deadline plus at most
``POLL_S + GROUP_WAIT_S + ABORT_BOUND_S + GRACE_S`` (9.6 s). A main thread inside an NCCL call past the deadline
(``calling``) with nothing else in flight fires the same way (its call cannot return: the process ends).

Note (claims by the main thread): an error path of the main thread (a failed NCCL call, a timed-out wait) claims and
aborts every communicator the same way (``abort_all``), so a failure on one level never leaves the others' kernels
spinning (finding 3); the first claim wins and the watchdog then stands down.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import threads
from .deadline import BLOCKED_EXIT_CODE, OwnerReduceCommError, first_line
from .watch_protocol import Watched

POLL_S = 0.1  # how often an armed watchdog looks (torch's ProcessGroupNCCL watchdog: 100 ms)
LOCK_WAIT_S = 1.0  # how long the main thread may stay inside one NCCL call once a deadline passed
GROUP_WAIT_S = 3.0  # how long the watchdog waits, at most, for the main thread to close its open group
ABORT_BOUND_S = 4.0  # how long the concurrent aborts may take, all together
GRACE_S = 2.5  # how long the main thread has, after the aborts, to reach a call that raises the error

_monotonic = time.monotonic
_LIVE: weakref.WeakSet[FlushWatchdog] = weakref.WeakSet()  # stopped at exit before any communicator is aborted


class FlushWatchdog:
    """The watchdog of one communicator family (see the module's notes). The hot path, once per group on the cupy
    communicator: ``enter``, ``calling`` (one clock read, the group's issue time) and ``leave``; ``arm`` once when
    the first group after an idle spell is issued."""

    poll_s = POLL_S
    lock_wait_s = LOCK_WAIT_S
    group_wait_s = GROUP_WAIT_S
    abort_bound_s = ABORT_BOUND_S
    grace_s = GRACE_S
    end: Callable[[int], Any] = staticmethod(os._exit)  # how the process ends (tests: a fake)

    def __init__(self, owner: Watched) -> None:
        self.comms: list[Watched] = [owner]
        self.lock = threading.Lock()  # Note (guard)
        self._acquire, self._release = self.lock.acquire, self.lock.release
        self.held_by: Watched | None = None  # the communicator whose call or group holds the guard now
        self.in_call: str | None = None  # the NCCL call the main thread is inside now (``calling``)
        self.in_call_since: float | None = None
        self.waiting: str | None = None  # the main thread's bounded wait now (``wait_until``'s call), for the error
        self.armed = False  # the thread looks (something is in flight, or the main thread is inside NCCL)
        self.failed = False  # the communicators were claimed for an abort (by the watchdog or an error path)
        self.error: OwnerReduceCommError | None = None  # the watchdog's error: raised by the main thread's next call
        self.write: Callable[[str], Any] | None = None  # tests: where the last words go (stderr)
        self.ended: str | None = None  # why the process was ended (tests read it when ``end`` returns)
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._delivered = threading.Event()  # the main thread raised ``error``
        self._thread: threading.Thread | None = None
        self._seen_done: dict[int, Any] = {}  # id(comm) -> the newest of its groups seen complete (Note (firing))
        self.device: int | None = None  # the rank's CUDA device, which its threads set first (``threads``)

    # ---- the main thread's hot path ------------------------------------------------------------------------

    def enter(self, comm: Watched) -> None:
        """Hold the guard for an NCCL call or a group on ``comm``. Raises the watchdog's error instead when it has
        claimed the communicators."""
        self._acquire()
        if self.error is not None:
            self._release()
            self.raise_if_failed()
        self.held_by = comm

    def calling(self, what: str) -> float:
        """The main thread, holding the guard, enters an NCCL call that may block (``ncclGroupEnd``, a call outside a
        group): the time, which is also its group's issue time. ``leave`` ends it."""
        self.in_call = what
        now = self.in_call_since = _monotonic()
        if not self.armed:
            self.arm()
        return now

    def leave(self) -> None:
        self.in_call_since = None
        self._release()

    def arm(self) -> None:
        """Something is in flight: the thread looks from now on (started the first time)."""
        self.armed = True
        if self._thread is None and not self._stopped.is_set():
            owner = self.comms[0]
            self.device = owner.cuda_device if owner.cuda_device is not None else threads.current_cuda_device()
            _LIVE.add(self)
            self._thread = threads.start(self._run, name="owner_reduce flush watchdog", device=self.device)
        self._wake.set()

    # ---- the main thread: failures ------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the watchdog's recorded error, if any (the main thread has come back: Note (firing) 3)."""
        error = self.error
        if error is not None:
            self._delivered.set()
            raise error

    def abort_all(self) -> None:
        """An error path of the main thread (no NCCL call or group of its own open): claim every communicator of the
        family still open and abort them all at once, within ``ABORT_BOUND_S`` (Note (claims by the main thread)).
        The first abort that fails is raised; an abort still running at the bound raises ``TimeoutError``."""
        with self.lock:
            self.failed = True
            aborts = self._claim()
        stuck, error = abort_concurrently(aborts, self.abort_bound_s)
        if error is not None:
            raise error
        if stuck:
            raise TimeoutError(f"owner_reduce: the abort of the {' and the '.join(stuck)} "
                               f"{'communicator' if len(stuck) == 1 else 'communicators'} did not return within "
                               f"{self.abort_bound_s:g} s (each waits for its communicator's last kernel)")

    def _claim(self) -> list[tuple[str, Callable[[], Any], int | None]]:
        """Under the guard: every communicator's abort, taken (what is already taken is skipped), with its device."""
        aborts = []
        for comm in self.family():
            abort = comm.take_for_abort()
            if abort is not None:
                aborts.append((f"{comm.role}", abort, comm.cuda_device))
        return aborts

    # ---- the family ---------------------------------------------------------------------------------------

    def family(self) -> list[Watched]:
        """Every communicator watched, with every sub-communicator of theirs (once each)."""
        seen: list[Watched] = []
        for comm in list(self.comms):
            for c in (comm, *comm.subs):
                if all(c is not s for s in seen):
                    seen.append(c)
        return seen

    def add(self, comm: Watched) -> None:
        self.comms.append(comm)

    def forget(self, comm: Watched) -> None:
        """``comm`` was closed; closing the family's first communicator (the data-parallel one) stops the thread."""
        if comm in self.comms:
            first = comm is self.comms[0]
            self.comms.remove(comm)
            if first or not self.comms:
                self.stop()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    # ---- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The thread (on the rank's device: ``threads``). Note (a poll that raises): a completion query or an
        asynchronous-error check that raises (a sticky CUDA error: the context is unusable) is this rank's failure,
        fired like a deadline; the thread never ends silently with flushes in flight and nobody watching them."""
        while not self._stopped.is_set():
            self._wake.wait()
            while not self._stopped.wait(self.poll_s):
                try:
                    if self._check(time.monotonic()):
                        return  # fired (or stood down for an error path's claim): nothing is left to watch
                    busy = self._busy()
                except Exception as error:  # noqa: BLE001 - Note (a poll that raises)
                    self._poll_failed(error)
                    return
                if not busy:  # disarm; see ``arm``: whoever runs second sees the other's write
                    self.armed = False
                    self._wake.clear()
                    if not self._busy():
                        break
                    self.armed = True
                    self._wake.set()

    def _poll_failed(self, error: Exception) -> None:
        """Note (a poll that raises): fire naming the oldest group not forgotten on any communicator (formatted, never
        queried again), else the call the main thread is inside."""
        for comm in self.family():
            entries = comm.watched()
            if entries:
                flush, name = comm.entry_name(entries[0])
                issued_at = entries[0].issued_at
                break
        else:
            comm = self.held_by or self.comms[0]
            flush, name, issued_at = comm.flush, self.in_call or "no call in flight", self.in_call_since
        waited = 0.0 if issued_at is None else time.monotonic() - issued_at
        self._fire(self._error(comm, flush, name, waited, f"failed: the watchdog's poll of its completion raised "
                                                          f"{type(error).__name__}: {first_line(error)}"))

    def _busy(self) -> bool:
        return self.in_call_since is not None or any(self._oldest_pending(c) is not None for c in self.family())

    def _oldest_pending(self, comm: Watched) -> Any:
        """The oldest group of ``comm`` not complete, or None. Groups complete in issue order on one communicator
        (NCCL orders a communicator's kernels across streams), so the scan starts after the newest seen complete."""
        entries = comm.watched()
        if not entries:
            return None
        key = id(comm)
        last = self._seen_done.get(key)
        start = 0
        if last is not None:
            for i, entry in enumerate(entries):
                if entry is last:
                    start = i + 1
                    break
        for entry in entries[start:]:
            if not comm.entry_done(entry):
                return entry
            self._seen_done[key] = entry
        return None

    def _check(self, now: float) -> bool:
        """One poll; True when the watchdog has nothing more to do."""
        if self.failed:
            return True
        overdue = []
        for comm in self.family():
            entry = self._oldest_pending(comm)
            stall = comm.deadline.stall
            if stall is not None and entry is not None:  # ``stall_report``: a flush waiting a second marks arrival
                stall.waiting(entry.flush, entry.issued_at, now)
            if entry is None or now - entry.issued_at < comm.deadline.allowed_s(entry.issued_at):
                continue
            if not comm.entry_watched(entry):  # completed and forgotten meanwhile: Note (firing) in ``nccl_comm``
                continue
            overdue.append((entry.issued_at, comm, entry))
        if overdue:  # the oldest group past its deadline: the flush that stalled, not one queued behind it
            issued_at, comm, entry = min(overdue, key=lambda o: o[0])
            flush, name = comm.entry_name(entry)
            self._fire(self._error(comm, flush, name, now - issued_at, "timed out"))
            return True
        since, held_by, what = self.in_call_since, self.held_by, self.in_call
        if since is not None and held_by is not None and now - since >= held_by.deadline.allowed_s(since):
            self._fire(self._error(held_by, held_by.flush, what or "an NCCL call", now - since, "has not returned"))
            return True
        if self.lock.acquire(blocking=False):  # never while the main thread is inside a call (Note (guard))
            try:
                found = None if self.failed else next(
                    ((c, e) for c in self.family() if (e := c.async_error()) is not None), None)
            finally:
                self.lock.release()
            if found is not None:
                comm, reason = found
                entry = self._oldest_pending(comm)
                flush, name = comm.entry_name(entry) if entry is not None else (comm.flush, "no call in flight")
                waited = now - entry.issued_at if entry is not None else 0.0
                self._fire(self._error(comm, flush, name, waited, f"failed: {reason}"))
                return True
        return False

    def _fire(self, error: OwnerReduceCommError) -> None:
        """Note (firing), steps 1 to 3."""
        if self.failed:
            return
        self.error = error  # from now on the main thread's next call raises it, without calling NCCL
        why = self._take_guard()
        if why is not None:
            self._end(error, why)
            return
        try:
            if self.failed:  # an error path of the main thread claimed them first: it raises its own error
                return
            self.failed = True
            aborts = self._claim()
        finally:
            self.lock.release()
        stuck, abort_error = abort_concurrently(aborts, self.abort_bound_s)
        if stuck:
            self._end(error, f"the abort of the {' and the '.join(stuck)} communicator did not return within "
                             f"{self.abort_bound_s:g} s")
            return
        if abort_error is not None:
            error.add_note(f"owner_reduce: aborting a communicator failed too: {type(abort_error).__name__}: "
                           f"{abort_error}")
        if not self._delivered.wait(self.grace_s):
            self._end(error, f"every communicator was aborted, but the main thread did not come back to owner_reduce "
                             f"within {self.grace_s:g} s to raise it")

    def _error(self, comm: Watched, flush: int | None, call: str, waited_s: float, reason: str
               ) -> OwnerReduceCommError:
        """``rank 5, flush #7: flush watchdog: reduce(...) on the rail communicator timed out after waiting 12 s (the
        deadline, ...)``, with ``(the main thread in end_backward)`` after "flush watchdog" where the main thread was
        in a bounded wait then (waited since the issue, not since that wait)."""
        waiting = self.waiting
        where = "" if waiting is None else f" (the main thread in {waiting})"
        return OwnerReduceCommError(rank=comm.global_rank, dp_rank=comm.dp_rank, flush=flush,
                                    call=f"flush watchdog{where}: {call} on the {comm.role} communicator",
                                    waited_s=waited_s, deadline=comm.deadline, reason=reason)

    def _take_guard(self) -> str | None:
        """Note (firing) 1: acquire the guard (then None), or say why the process must end."""
        started = _monotonic()
        while not self.lock.acquire(timeout=0.02):
            now = _monotonic()
            since, held_by = self.in_call_since, self.held_by
            where = "" if held_by is None else f" on the {held_by.role} communicator"
            if since is not None and now - since >= self.lock_wait_s:
                return (f"the main thread is inside {self.in_call or 'an NCCL call'}{where}, which cannot be "
                        f"interrupted")
            if now - started >= self.group_wait_s:
                return (f"the main thread kept an NCCL group open{where} for {self.group_wait_s:g} s after the "
                        f"deadline, and no communicator may be aborted under an open group")
        return None

    def _end(self, error: OwnerReduceCommError, why: str) -> None:
        """Say why on stderr and end the process, as init's watchdog does (``deadline`` Note (a blocking init))."""
        self.ended = why
        message = (f"owner_reduce flush watchdog: {type(error).__name__}: {error}\nowner_reduce: {why}; owner_reduce "
                   f"ends this process (exit status {BLOCKED_EXIT_CODE}), as torch's NCCL watchdog does, instead of "
                   f"hanging.\n")
        try:
            (self.write or sys.stderr.write)(message)
            sys.stderr.flush()
        finally:
            self.end(BLOCKED_EXIT_CODE)


def abort_concurrently(aborts: Sequence[tuple[str, Callable[[], Any], int | None]], bound_s: float
                       ) -> tuple[list[str], BaseException | None]:
    """Run every ``(name, abort, device)`` at once, one thread each on its communicator's device (``threads``: NCCL's
    abort runs CUDA calls on the thread's device), and wait for them until ``bound_s`` from now: (the names of those
    still running then, the first failure). Why at once: Note (firing) 2."""
    if not aborts:
        return [], None
    failures: list[BaseException | None] = [None] * len(aborts)

    def run(i: int, abort: Callable[[], Any]) -> None:
        try:
            abort()
        except BaseException as error:  # noqa: BLE001 - reported to the caller
            failures[i] = error

    started = [threads.start(run, name=f"owner_reduce abort: {name} communicator", device=device, args=(i, abort))
               for i, (name, abort, device) in enumerate(aborts)]
    until = time.monotonic() + bound_s
    for thread in started:
        thread.join(max(0.0, until - time.monotonic()))
    stuck = [name for (name, _, _), thread in zip(aborts, started, strict=True) if thread.is_alive()]
    return stuck, next((f for f in failures if f is not None), None)


def stop_all() -> None:
    """At exit: no watchdog claims a communicator while the exit handler aborts what is left open."""
    for watchdog in list(_LIVE):
        watchdog.stop()
