"""One deadline for every wait on owner_reduce's collectives, and the one error raised when it passes.

Why: torch's ProcessGroupNCCL watchdog never sees NCCL kernels launched through cupy, and DeepSpeed creates
its data-parallel group with torch's default timeout (30 minutes), not the one the user gave
``deepspeed.init_distributed(timeout=...)``. A stalled or dead peer would hang every survivor for that long,
or forever on the cupy path. So each wait here is bounded by the user's timeout: the default process
group's, read once at communicator creation; ``OWNER_REDUCE_TIMEOUT_S`` overrides it.

The core (``resolve``, ``poll_until_done``, ``wait_work``) takes its clock, sleep, completion and error
checks as arguments, so it is tested with fakes and no process group. What happens on failure is the
caller's: the cupy communicator aborts itself (``ncclCommAbort``, never ``ncclCommDestroy``) exactly once. A
communicator's creation, which nothing can interrupt, is bounded by ending the process: Note (a blocking init).
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

ENV_VAR = "OWNER_REDUCE_TIMEOUT_S"
BLOCKED_EXIT_CODE = 1  # the exit status of a process ended by ``end_process_if_still_blocked``
TORCH_DEFAULT_S = 1800.0  # torch's default_pg_timeout, used only when the default group's cannot be read

# Polling: a few immediate checks (a finished wait costs only them), then sleeps growing to _MAX_SLEEP_S.
_SPINS = 8
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 2e-4  # a wait that ends costs at most this much latency (end_backward on a GPU, every step)


class OwnerReduceCommError(RuntimeError):
    """A collective of owner_reduce did not complete: a timeout, or an error NCCL or gloo reported.

    Names the rank, the flush (None: outside a flush, e.g. the init-time agreement), the call and the seconds
    waited. On the cupy path the communicator has been aborted by then; the job cannot continue.
    """

    def __init__(self, *, rank: int, flush: int | None, call: str, waited_s: float, deadline: Deadline,
                 reason: str) -> None:
        where = "outside a flush" if flush is None else f"flush #{flush}"
        super().__init__(f"owner_reduce: rank {rank}, {where}: {call} {reason} after waiting {waited_s:.1f} s "
                         f"(deadline {deadline.describe()})")
        self.rank = rank
        self.flush = flush
        self.call = call
        self.waited_s = waited_s
        self.reason = reason


@dataclass(frozen=True)
class Deadline:
    seconds: float
    source: str  # where the value came from, for the error message

    def describe(self) -> str:
        return f"{self.seconds:g} s from {self.source}"


def resolve(env_value: str | None, group_timeout_s: float | None) -> Deadline:
    """The deadline: ``OWNER_REDUCE_TIMEOUT_S`` if set, else the default group's timeout, else torch's default."""
    if env_value is not None and env_value.strip():
        try:
            seconds = float(env_value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or seconds == float("inf"):
            raise ValueError(f"owner_reduce: {ENV_VAR} must be a positive number of seconds, got {env_value!r}")
        return Deadline(seconds, ENV_VAR)
    if group_timeout_s is not None and group_timeout_s > 0:
        return Deadline(float(group_timeout_s), "the default process group (init_distributed timeout)")
    return Deadline(TORCH_DEFAULT_S, "torch's default (no process group timeout found)")


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


def from_environment(environ: Mapping[str, str] | None = None) -> Deadline:
    """The deadline for this process, now: read once per communicator, never per call."""
    env = os.environ if environ is None else environ
    return resolve(env.get(ENV_VAR), default_group_timeout_s())


def poll_until_done(done: Callable[[], bool], *, deadline: Deadline, rank: int, flush: int | None,
                    call: str | Callable[[], str], check_error: Callable[[], str | None] = lambda: None,
                    abort: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """Poll ``done`` (a CUDA event's or stream's ``query``) until it is true; return the seconds waited.

    Between polls ``check_error`` (``ncclCommGetAsyncError``) may report an error. On an error or when the
    deadline passes, ``abort`` runs (once, here) and ``OwnerReduceCommError`` is raised, naming ``call`` (a
    function: the name is formatted then, before the abort). Already done costs one call of ``done``.
    """
    if done():
        return 0.0
    start = clock()
    pause = _FIRST_SLEEP_S
    polls = 0
    while True:
        error = check_error()
        waited = clock() - start
        if error is not None or waited >= deadline.seconds:
            reason = "timed out" if error is None else f"failed: {error}"
            name = call() if callable(call) else call
            try:
                abort()
            except Exception as abort_error:  # noqa: BLE001 - the wait's failure is the one to report
                reason += f" (and aborting the communicator failed: {type(abort_error).__name__}: {abort_error})"
            raise OwnerReduceCommError(rank=rank, flush=flush, call=name, waited_s=waited, deadline=deadline,
                                       reason=reason)
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
              call: str | Callable[[], str], clock: Callable[[], float] = time.monotonic) -> None:
    """Wait for a torch.distributed ``Work`` until ``started + deadline``; ``OwnerReduceCommError`` otherwise.

    ``Work.wait(timeout)`` raises on a timeout (gloo: "Operation timed out!") and on a failed collective
    (a peer that closed its connection); both become the one error, naming the call (``call`` may be a
    function: the name is then formatted only on failure).
    """
    remaining = deadline.seconds - (clock() - started)
    try:
        if remaining <= 0 and not work.is_completed():
            raise TimeoutError("Operation timed out!")
        work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))
    except Exception as error:  # noqa: BLE001 - gloo and NCCL raise RuntimeError (or DistBackendError)
        text = first_line(error)
        reason = "timed out" if "timed out" in text.lower() else f"failed: {type(error).__name__}: {text}"
        raise OwnerReduceCommError(rank=rank, flush=flush, call=call() if callable(call) else call,
                                   waited_s=clock() - started, deadline=deadline, reason=reason) from error


def end_process_if_still_blocked(call: Callable[[], T], *, deadline: Deadline, rank: int, what: str,
                                 write: Callable[[str], Any] | None = None,
                                 end: Callable[[int], Any] = os._exit) -> T:
    """Run ``call`` here; if it has not returned when the deadline passes, say so on stderr and end this process.
    See Note (a blocking init)."""
    returned = threading.Event()

    def watchdog() -> None:
        if returned.wait(deadline.seconds):
            return
        message = (f"owner_reduce: rank {rank}: {what} has not returned after {deadline.seconds:g} s (deadline "
                   f"{deadline.describe()}): a peer never joined it. NCCL cannot interrupt it, so owner_reduce ends "
                   f"this process (exit status {BLOCKED_EXIT_CODE}), as torch's NCCL watchdog does, instead of "
                   f"hanging.\n")
        try:
            (write or sys.stderr.write)(message)
            sys.stderr.flush()
        finally:
            end(BLOCKED_EXIT_CODE)

    thread = threading.Thread(target=watchdog, name=f"owner_reduce watchdog: {what}", daemon=True)
    thread.start()
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
"""
