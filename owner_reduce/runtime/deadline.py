"""One deadline for every wait on owner_reduce's collectives, and the one error raised when it passes.

Why: torch's ProcessGroupNCCL watchdog never sees NCCL kernels launched through cupy, and DeepSpeed creates
its data-parallel group with torch's default timeout (30 minutes), not the one the user gave
``deepspeed.init_distributed(timeout=...)``. A stalled or dead peer would hang every survivor for that long,
or forever on the cupy path. So each wait here is bounded: by ``compile.reduce_to_owner_timeout_s`` where the config
sets it (``planning.settings``; agreed across ranks at init), else by the user's timeout, the default process group's,
read once at communicator creation. A job whose group timeout is long for slow checkpoints sets the key to learn of
a stalled flush in minutes.

The core (``resolve``, ``poll_until_done``, ``wait_work``) takes its clock, sleep, completion and error
checks as arguments, so it is tested with fakes and no process group. What happens on failure is the
caller's: the cupy communicator aborts itself (``ncclCommAbort``, never ``ncclCommDestroy``) exactly once. A
communicator's creation, which nothing can interrupt, is bounded by ending the process: Note (a blocking init).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import OwnerReduceError
from ..planning.settings import TIMEOUT, key_name

T = TypeVar("T")

CONFIG_SOURCE = key_name(TIMEOUT)  # compile.reduce_to_owner_timeout_s
BLOCKED_EXIT_CODE = 1  # the exit status of a process ended by ``end_process_if_still_blocked``
TORCH_DEFAULT_S = 1800.0  # torch's default_pg_timeout, used only when the default group's cannot be read
GROUP_SOURCE = "the default process group (init_distributed timeout)"
TORCH_SOURCE = "torch's default (no process group timeout found)"

_INIT_DEADLINE: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("owner_reduce_init_deadline",
                                                                               default=None)

# Polling: a few immediate checks (a finished wait costs only them), then sleeps growing to _MAX_SLEEP_S.
_SPINS = 8
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 2e-4  # a wait that ends costs at most this much latency (end_backward on a GPU, every step)


class OwnerReduceCommError(OwnerReduceError, RuntimeError):
    """A collective of owner_reduce did not complete: a timeout, or an error NCCL or gloo reported.

    Names the rank, the flush (None: outside a flush, e.g. the init-time agreement), the call, the deadline and the
    seconds measured (``waited_s``); after a timeout in a flush, the deadline's stall report (``stall_report``): the
    ranks that never reached the flush and their hosts. On the cupy path the communicator has been aborted by then;
    the job cannot continue. The message's "after waiting N s" is the configured deadline, so one failure reads the
    same on every run; the measured seconds follow as a separate, labelled fact (see ``outcome``).
    """

    def __init__(self, *, rank: int, flush: int | None, call: str, waited_s: float, deadline: Deadline,
                 reason: str, dp_rank: int | None = None) -> None:
        where = "outside a flush" if flush is None else f"flush #{flush}"
        who = f"rank {rank}" + ("" if dp_rank is None or dp_rank == rank else f" (data-parallel rank {dp_rank})")
        # A stalled flush's report (``stall_report``): the ranks that never reached it and their hosts, from the store.
        stalled = deadline.stall is not None and flush is not None and not reason.startswith("failed")
        self.stall_report = deadline.stall.explain(flush, call) if stalled else None
        report = "" if self.stall_report is None else f"; {self.stall_report}"
        super().__init__(f"owner_reduce: {who}, {where}: {call} {outcome(reason, waited_s, deadline)}{report}")
        self.rank = rank
        self.dp_rank = rank if dp_rank is None else dp_rank
        self.flush = flush
        self.call = call
        self.waited_s = waited_s
        self.reason = reason


def outcome(reason: str, waited_s: float, deadline: Deadline) -> str:
    """How a wait ended, for ``OwnerReduceCommError``: a deadline that passed ("timed out", or the flush watchdog's
    "has not returned") says the deadline it waited for, as configured (``timed out after waiting 20 s (the deadline,
    from ...; measured 20.0 s)``; init's shared deadline, which a later wait gets only the rest of: ``timed out at
    init's deadline (...)``); a reported error ("failed: ...") says the seconds it came after and the deadline."""
    if reason.startswith("failed"):
        return f"{reason} (measured {waited_s:.1f} s into the wait; deadline {deadline.describe()})"
    if deadline.until is not None:
        return f"{reason} at init's deadline ({deadline.describe()}; measured {waited_s:.1f} s in this wait)"
    return f"{reason} after waiting {deadline.seconds:g} s (the deadline, from {deadline.source}; measured " \
           f"{waited_s:.1f} s)"


@dataclass(frozen=True)
class Deadline:
    seconds: float
    source: str  # where the value came from, for the error message
    until: float | None = None  # init's one deadline: every wait ends by then (time.monotonic); Note (one for init)
    # The flushes' stall reporter (``stall_report.StallReporter``), set by the runtime after init: marks this rank's
    # arrival at a flush that waits (``wait_work``, the flush watchdog) and explains a stalled one in the error.
    stall: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.seconds:g} s from {self.source}" + ("" if self.until is None else ", shared by all of init")

    @property
    def short_source(self) -> str:
        """Where the seconds came from, in a word or two (the settings line): ``init_distributed``,
        ``torch default`` or the config key."""
        if self.source.startswith(CONFIG_SOURCE):
            return CONFIG_SOURCE
        return "init_distributed" if self.source.startswith(GROUP_SOURCE) else "torch default"

    def allowed_s(self, start: float) -> float:
        """How long a wait that starts at ``start`` (``time.monotonic()``) may last."""
        return self.seconds if self.until is None else max(0.0, min(self.seconds, self.until - start))


def resolve(timeout_s: float | None, group_timeout_s: float | None) -> Deadline:
    """The flushes' deadline: ``compile.reduce_to_owner_timeout_s`` (``timeout_s``, already validated) if set, else the
    default group's timeout, else torch's default."""
    if timeout_s is not None:
        return Deadline(float(timeout_s), CONFIG_SOURCE)
    if group_timeout_s is not None and group_timeout_s > 0:
        return Deadline(float(group_timeout_s), GROUP_SOURCE)
    return Deadline(TORCH_DEFAULT_S, TORCH_SOURCE)


def default_group_timeout_s() -> float | None:
    """The timeout of torch's default process group, i.e. what ``init_distributed(timeout=...)`` set; None if
    there is no group or no backend exposing one. Read from the backend's options (torch 2.13: every backend
    of a ProcessGroup has ``options._timeout``), CUDA's backend first."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    group = c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:  # noqa: BLE001 - no backend for this device type
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return None


def from_environment() -> Deadline:
    """The deadline a communicator made now takes, read once per communicator, never per call: inside
    ``init_window``, init's one deadline (Note (one deadline for init)); elsewhere the default process group's timeout
    (a communicator made outside the runtime's init: tests, scripts). The runtime gives its communicators the flushes'
    deadline after init (``set_deadline``)."""
    init = _INIT_DEADLINE.get()
    if init is not None:
        return init
    return resolve(None, default_group_timeout_s())


def for_init(flush: Deadline, group_timeout_s: float | None, now: float) -> Deadline:
    """Init's one deadline from ``now`` (Note (one deadline for init)): the larger of the flushes' deadline and the
    default process group's timeout (torch's default where there is none)."""
    group = float(group_timeout_s) if group_timeout_s is not None and group_timeout_s > 0 else TORCH_DEFAULT_S
    if flush.seconds >= group:
        return Deadline(flush.seconds, f"{flush.source}, counted from the start of init", until=now + flush.seconds)
    source = GROUP_SOURCE if group_timeout_s else TORCH_SOURCE
    return Deadline(group, f"{source}, counted from the start of init", until=now + group)


@contextlib.contextmanager
def init_window(deadline: Deadline) -> Iterator[Deadline]:
    """Inside: every communicator made takes ``deadline`` (``from_environment``), so that init's waits and
    communicator creations share it; the runtime gives them the flushes' deadline afterwards."""
    token = _INIT_DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _INIT_DEADLINE.reset(token)


def poll_until_done(done: Callable[[], bool], *, deadline: Deadline, rank: int,
                    flush: int | None | Callable[[], int | None],
                    call: str | Callable[[], str], check_error: Callable[[], str | None] = lambda: None,
                    abort: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep, dp_rank: int | None = None) -> float:
    """Poll ``done`` (a CUDA event's or stream's ``query``) until it is true; return the seconds waited.

    Between polls ``check_error`` (``ncclCommGetAsyncError``) may report an error. On an error or when the
    deadline passes, ``abort`` runs (once, here) and ``OwnerReduceCommError`` is raised, naming ``call`` (a
    function: the name is formatted then, before the abort). Already done costs one call of ``done``.
    """
    if done():
        return 0.0
    start = clock()
    allowed = deadline.allowed_s(start)
    pause = _FIRST_SLEEP_S
    polls = 0
    while True:
        error = check_error()
        waited = clock() - start
        if error is not None or waited >= allowed:
            reason = "timed out" if error is None else f"failed: {error}"
            name = call() if callable(call) else call
            flush = flush() if callable(flush) else flush
            try:
                abort()
            except Exception as abort_error:  # noqa: BLE001 - the wait's failure is the one to report
                reason += f" (and aborting the communicator failed: {type(abort_error).__name__}: {abort_error})"
            raise OwnerReduceCommError(rank=rank, flush=flush, call=name, waited_s=waited, deadline=deadline,
                                       reason=reason, dp_rank=dp_rank)
        polls += 1
        if polls > _SPINS:
            sleep(pause)
            pause = min(pause * 2, _MAX_SLEEP_S)
        if done():
            return clock() - start


def first_line(error: BaseException) -> str:
    """What an error says, in one line (its first), or its type's name when it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def add_note(error: BaseException, what: str, cause: BaseException) -> None:
    """Record on ``error`` (the one being raised) that ``what`` failed too, with ``cause``'s first line: a later
    failure on the error path never replaces the first error."""
    error.add_note(f"owner_reduce: {what}: {type(cause).__name__}: {first_line(cause)}")


def wait_work(work: Any, *, deadline: Deadline, started: float, rank: int, flush: int | None,
              call: str | Callable[[], str], clock: Callable[[], float] = time.monotonic,
              dp_rank: int | None = None) -> None:
    """Wait for a torch.distributed ``Work`` until ``started + deadline``; ``OwnerReduceCommError`` otherwise.

    ``Work.wait(timeout)`` raises on a timeout (gloo: "Operation timed out!") and on a failed collective
    (a peer that closed its connection); both become the one error, naming the call (``call`` may be a
    function: the name is then formatted only on failure).
    """
    remaining = deadline.allowed_s(started) - (clock() - started)
    try:
        if remaining <= 0 and not work.is_completed():
            raise TimeoutError("Operation timed out!")
        stall = deadline.stall
        if stall is not None and flush is not None:
            # ``stall_report``: the reporter's thread marks this rank's arrival if the wait lasts MARK_AFTER_S (a gloo
            # wait cut short would close a send/recv pair: the wait itself stays whole).
            stall.watch(flush, started)
            try:
                work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))
            finally:
                stall.unwatch()
        else:
            work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))
    except Exception as error:  # noqa: BLE001 - gloo and NCCL raise RuntimeError (or DistBackendError)
        text = first_line(error)
        reason = "timed out" if "timed out" in text.lower() else f"failed: {type(error).__name__}: {text}"
        raise OwnerReduceCommError(rank=rank, flush=flush, call=call() if callable(call) else call,
                                   waited_s=clock() - started, deadline=deadline, reason=reason,
                                   dp_rank=dp_rank) from error


def end_process_if_still_blocked(call: Callable[[], T], *, deadline: Deadline, rank: int, what: str,
                                 write: Callable[[str], Any] | None = None,
                                 end: Callable[[int], Any] = os._exit) -> T:
    """Run ``call`` here; if it has not returned when the deadline passes, say so on stderr and end this process.
    See Note (a blocking init)."""
    returned = threading.Event()
    allowed = deadline.allowed_s(time.monotonic())

    # The deadline as configured, never a measured time: init's shared one says so, with what was left of it here.
    when = (f"after {deadline.seconds:g} s (deadline {deadline.describe()})" if deadline.until is None else
            f"by init's deadline ({deadline.describe()}; {allowed:.3g} s of it were left when it started)")

    def watchdog() -> None:
        if returned.wait(allowed):
            return
        message = (f"owner_reduce: rank {rank}: {what} has not returned {when}: a peer never joined it. NCCL cannot "
                   f"interrupt it, so owner_reduce ends this process (exit status {BLOCKED_EXIT_CODE}), as torch's "
                   f"NCCL watchdog does, instead of hanging.\n")
        try:
            (write or sys.stderr.write)(message)
            sys.stderr.flush()
        finally:
            end(BLOCKED_EXIT_CODE)

    # On the rank's device, as every thread of the runtime (``threads``), although it makes no CUDA call of its own.
    from .threads import current_cuda_device, start

    thread = start(watchdog, name=f"owner_reduce watchdog: {what}", device=current_cuda_device())
    try:
        return call()
    finally:
        returned.set()
        thread.join()


NOTES = """
Note (a blocking init): ``ncclCommInitRank`` (a communicator's creation: the data-parallel one, and a two-level
flush's node and rail ones) returns only when every rank of the new communicator has joined. A peer that dies or
stalls after the bounded exchange of the unique id leaves the others inside it, and nothing can interrupt it: it is
one C call, cupy's blocking configuration (cupy 14 exposes no ``blocking=0``), and there is no communicator to abort
until it returns. cupy 14 calls it without the GIL, so a watchdog thread still runs: at the deadline it writes why to
stderr and ends the process with ``os._exit(1)``, as torch's NCCL watchdog takes a process down after a collective
timeout; the launcher then stops the others. A call that returns, or raises, in time stops the watchdog.

Note (one deadline for init): the runtime's init (the communicator's choice and creation, the agreement, the node and
rail communicators) is one phase that waits for every rank several times. All of it shares one deadline counted from
its start (``Deadline.until``), not a fresh one per wait: the larger of the flushes' deadline
(``compile.reduce_to_owner_timeout_s``, or the default group's timeout) and the default process group's timeout, so
that a short ``compile.reduce_to_owner_timeout_s`` meant to detect a stalled flush quickly never ends healthy ranks
whose init at hundreds of ranks is merely slow. Every communicator made inside ``init_window`` takes it; after init the
runtime gives each the flushes' deadline.
"""
