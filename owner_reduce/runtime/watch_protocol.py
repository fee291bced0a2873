"""What the flush watchdog and a bounded wait read of a communicator: its work in flight, its asynchronous error, its
abort. A public protocol, so that neither reaches into a communicator's private state.

Why a module of its own: the seam (``comm.ReduceComm``) builds a ``watchdog.FlushWatchdog`` for every communicator,
and the watchdog drives communicators; with the protocol here, ``comm`` imports ``watchdog`` and ``watchdog`` imports
only this module, so the two never import each other.

Who implements it: each backend (``torch_comm.TorchDistComm``: torch's works; ``nccl_comm.CupyNcclComm``: an event
recorded after each group). Every communicator answers it: ``ReduceComm`` derives from ``NothingInFlight``, the
answers of a communicator that keeps nothing in flight (a host-only stand-in), which a backend overrides.

Who reads it: ``ReduceComm.wait_until`` on the main thread (``works_done``, ``first_unfinished``, ``async_error``) and
the flush watchdog's thread (``watched``, ``entry_done``, ``entry_watched``, ``entry_name``, ``async_error``,
``take_for_abort``); ``watchdog`` Note (guard) says which of them run under the watchdog's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .deadline import Deadline


class WatchedEntry(Protocol):
    """A group (or a call outside one) issued on the device and not yet forgotten: the flush watchdog's deadline counts
    from ``issued_at`` (``time.monotonic()``), and the stall report names its ``flush``."""

    @property
    def flush(self) -> int | None: ...

    @property
    def issued_at(self) -> float: ...


class Watched(Protocol):
    """A communicator as the watchdog and the bounded waits see it (``comm.ReduceComm`` is one). Its names (``role``,
    ``global_rank``, ``dp_rank``, ``flush``) go into the error; ``deadline`` bounds its groups; ``cuda_device`` is
    where its abort's thread runs; ``subs`` are its sub-communicators (``comm`` Note (sub-communicators))."""

    role: str
    global_rank: int
    flush: int | None
    deadline: Deadline
    cuda_device: int | None

    @property
    def dp_rank(self) -> int: ...

    @property
    def subs(self) -> Sequence[Watched]: ...

    def works_done(self) -> bool:
        """Forget the works in flight that completed; True when none is left."""
        ...

    def first_unfinished(self) -> tuple[int | None, str] | None:
        """(flush, name) of the first call issued here that has not completed, or None."""
        ...

    def async_error(self) -> str | None:
        """An error the communicator reported asynchronously (NCCL), or None."""
        ...

    def take_for_abort(self) -> Callable[[], Any] | None:
        """Under the watchdog's guard, no group open: claim this communicator for an abort and return what aborts it
        (run in a thread of its own), or None where there is nothing to abort (nothing kept, or already claimed). From
        then on no call of this communicator reaches the collective library."""
        ...

    def watched(self) -> Sequence[WatchedEntry]:
        """A snapshot of the groups (or works) issued and not yet forgotten, oldest first (read from the watchdog's
        thread)."""
        ...

    def entry_done(self, entry: Any) -> bool:
        """``entry`` (one of ``watched()``) has completed."""
        ...

    def entry_watched(self, entry: Any) -> bool:
        """``entry`` is still among those issued (checked after ``entry_done`` said it is not done)."""
        ...

    def entry_name(self, entry: Any) -> tuple[int | None, str]:
        """(its flush, its first call's name), formatted for an error."""
        ...


class NothingInFlight:
    """``Watched``'s answers for a communicator that keeps nothing in flight: every wait on the host is over when its
    call returns, so there is nothing to watch, to name or to abort. ``ReduceComm`` derives from it; a backend that
    keeps work in flight overrides every method."""

    def works_done(self) -> bool:
        return True

    def first_unfinished(self) -> tuple[int | None, str] | None:
        return None

    def async_error(self) -> str | None:
        return None

    def take_for_abort(self) -> Callable[[], Any] | None:
        return None

    def watched(self) -> Sequence[WatchedEntry]:
        return ()

    def entry_done(self, entry: Any) -> bool:
        raise NotImplementedError(f"{type(self).__name__} watches nothing, so it has no entry {entry!r}")

    def entry_watched(self, entry: Any) -> bool:
        raise NotImplementedError(f"{type(self).__name__} watches nothing, so it has no entry {entry!r}")

    def entry_name(self, entry: Any) -> tuple[int | None, str]:
        raise NotImplementedError(f"{type(self).__name__} watches nothing, so it has no entry {entry!r}")
