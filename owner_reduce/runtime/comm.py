"""The collective seam: the few calls a flush makes, behind one small interface (``ReduceComm``).

Why a seam: the flush logic must not care whether bytes move through gloo on CPU, torch's NCCL process
group, or a cupy NCCL communicator on a side stream. Each implementation provides ``group()`` (a context
that batches the calls and always closes, also when a call raises), ``reduce(buf, root)``,
``all_reduce(buf)``, ``reduce_scatter(buf, per_rank)``, and ``send(buf, peer)`` / ``recv(buf, peer)`` for the owner
hand-off (in a group of their own); ``root`` and ``peer`` are ranks of the data-parallel communicator, not global
ranks. Besides the calls, the runtime uses ``all_gather_ints`` (init's agreement), ``split``/``subs``/``close_subs``
(a two-level flush's communicators), ``wait_until`` (every bounded wait), ``warm_up``/``connect_peers`` (Note (lazy
connections)), ``set_deadline``, ``release_buffers`` and ``close``.

The implementations, one module each: ``torch_comm.TorchDistComm`` (torch.distributed: gloo on CPU, NCCL on GPU) and
``nccl_comm.CupyNcclComm`` (cupy's NCCL, whose binding is ``nccl_binding``). What the flush watchdog and the bounded
waits read of a communicator (its work in flight, its asynchronous error, its abort) is a protocol of its own,
``watch_protocol.Watched``, which every implementation answers; this module holds nothing backend-specific.

Note (bounded waits): every wait on a collective is bounded by ``self.deadline`` (see ``deadline``) and
fails with ``OwnerReduceCommError`` naming the rank, the flush (``group(flush=n)`` sets it), the call and
the deadline (the seconds measured follow it); ``wait_until`` is the one place that waits on the device.

Note (failure inside a group): when anything raises inside ``group()``, the group is closed through
``_group_failed`` (never ``_group_end``'s normal path: no more work is issued or waited for), and the error
raised inside stays the one raised; a failure while closing is only added to it as a note.

Note (sub-communicators): the node and rail communicators ``split`` makes (a two-level flush) run on their own
streams, which the reduce stream joins; the runtime's bounded waits are on this (the data-parallel) communicator.
So this communicator's ``wait_until`` covers them too: it waits for their works in flight, reports their errors
(``node communicator: ...``), names their unfinished call, and on failure aborts every one of them with itself, all
at once (``watchdog``), so that no kernel of a stalled level keeps the GPU after the error. ``close_subs`` releases
them. They share one flush watchdog (``watchdog``), which bounds each group from its issue where the host never gets
to a wait.

Note (lazy connections): NCCL connects a communicator's algorithms and peers inside the first ``ncclGroupEnd`` that
needs them (``NCCL_RUNTIME_CONNECT=1``, the default since 2.22), on the host, with a rendezvous of the peers and
device allocations. ``warm_up`` and ``connect_peers`` make that happen at init and when a schedule is learned
(``planning.connections`` says what and why), so that no flush, and no flush the measured guard times, carries it.

Note (names): an error names this process's global rank (``rank 5``; with its data-parallel rank where the two
differ, a data-parallel group smaller than the job), the flush, the call and, on a sub-communicator, the
communicator (``on the rail communicator``) and each root or peer as the sub-communicator's rank and the
data-parallel rank it is (``root=1 = data-parallel rank 3``): a node or rail communicator numbers its ranks from 0.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

import torch

from . import deadline as deadlines
from .watch_protocol import NothingInFlight
from .watchdog import FlushWatchdog


class ReduceComm(NothingInFlight, ABC):
    """SUM-reductions over the data-parallel communicator (pre-division is the caller's job). What the watchdog reads
    of it (``watch_protocol.Watched``) answers "nothing in flight" unless the implementation keeps work in flight."""

    name: str = "abstract"
    cuda_device: int | None = None  # the CUDA device its calls run on (None: the host), which its threads set first
    connects_lazily = False  # NCCL's communicators: Note (lazy connections)

    def __init__(self, rank: int, world_size: int, deadline: deadlines.Deadline | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.in_group = False  # inside ``group()`` (set by it alone; implementations read it)
        self.deadline = deadlines.from_environment() if deadline is None else deadline
        self.flush: int | None = None  # the flush being issued or last issued (error messages)
        self.role = "data-parallel"  # or "node" / "rail": a sub-communicator's part in a two-level flush
        self.subs: list[ReduceComm] = []  # made by split(): see Note (sub-communicators)
        self.global_rank = rank  # this process's rank in the job (implementations that know it set it): Note (names)
        self.members: tuple[int, ...] | None = None  # a sub-communicator's ranks as data-parallel ranks (split)
        self.watchdog = FlushWatchdog(self)  # shared with the sub-communicators (split): ``watchdog``
        self._connected_peers: set[tuple[bool, int]] = set()  # (a send?, peer) connected: ``connect_peers``

    # ---- names in messages: Note (names) ---------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This rank's rank in the data-parallel communicator."""
        return self.rank if self.members is None else self.members[self.rank]

    def who(self) -> str:
        """``rank 5``, or ``rank 5 (data-parallel rank 2)`` where the two differ."""
        dp = self.dp_rank
        return f"rank {self.global_rank}" + ("" if dp == self.global_rank else f" (data-parallel rank {dp})")

    def peer_name(self, peer: int) -> str:
        """A root or peer of this communicator: ``3``, or on a sub-communicator ``1 = data-parallel rank 3``."""
        return str(peer) if self.members is None else f"{peer} = data-parallel rank {self.members[peer]}"

    @property
    def where(self) -> str:
        """``""`` on the data-parallel communicator, `` on the rail communicator`` on a sub-communicator."""
        return "" if self.members is None else f" on the {self.role} communicator"

    def set_deadline(self, deadline: deadlines.Deadline) -> None:
        """This communicator's and its sub-communicators' deadline from now on (the runtime, after init)."""
        self.deadline = deadline
        for sub in self.subs:
            sub.deadline = deadline

    @contextlib.contextmanager
    def group(self, flush: int | None = None) -> Iterator[None]:
        """Batch the calls of one flush (number ``flush``, for errors). Always closed: normally by ``_group_end``;
        when something raises inside, by ``_group_failed``, and that first error is the one raised (see Note
        (failure inside a group))."""
        if self.in_group:
            raise RuntimeError(f"{self.name}: nested collective group on rank {self.rank}")
        if flush is not None:
            self.flush = flush
        self.in_group = True
        try:
            self._group_start()
        except BaseException:
            self.in_group = False
            raise
        try:
            yield
        except BaseException as error:
            self.in_group = False
            try:
                self._group_failed(error)
            except Exception as close_error:  # noqa: BLE001 - the error raised inside the group is the one to report
                deadlines.add_note(error, "closing the collective group afterwards failed too", close_error)
            raise
        self.in_group = False
        self._group_end()

    def wait_until(self, done: Callable[[], bool], call: str, flush: int | None = None) -> None:
        """Poll ``done`` (a CUDA stream's or event's ``query``) and this communicator's and its sub-communicators'
        works in flight within the deadline; on a timeout or an error of any of them, abort them all and raise
        ``OwnerReduceCommError`` naming the call still unfinished (see Note (sub-communicators)), its communicator
        and its flush (``flush``, else that call's, else the last one issued here)."""
        watchdog = self.watchdog
        watchdog.raise_if_failed()  # the flush watchdog's error, where it aborted the communicators meanwhile
        comms = (self, *self.subs)
        named: list[tuple[int | None, str]] = []

        def names() -> tuple[int | None, str]:  # formatted once, on failure (before the abort forgets the works)
            if not named:
                named.append(_waiting_for(self, comms, call, flush))
            return named[0]

        def check_error() -> str | None:
            watchdog.raise_if_failed()
            return _any_async_error(self)

        watchdog.waiting = call
        try:
            deadlines.poll_until_done(lambda: all(c.works_done() for c in comms) and done(), deadline=self.deadline,
                                      rank=self.global_rank, dp_rank=self.dp_rank, flush=lambda: names()[0],
                                      call=lambda: names()[1], check_error=check_error, abort=watchdog.abort_all)
        finally:
            watchdog.waiting = None
        watchdog.raise_if_failed()  # done only because the watchdog's abort forgot the works meanwhile

    # ---- what an implementation provides: the group's hooks and the calls ---------------------------------------

    def _group_start(self) -> None:  # noqa: B027 - optional hook
        """Open the backend's group (NCCL: ``ncclGroupStart``); by default nothing."""

    def _group_end(self) -> None:  # noqa: B027 - optional hook
        """Close it normally: issue (or wait for) what the group batched; by default nothing."""

    def _group_failed(self, error: BaseException) -> None:
        """Close the group after ``error`` was raised inside it (``error`` is re-raised afterwards whatever this
        does; what this raises becomes a note on it). By default as ``_group_end``."""
        self._group_end()

    @abstractmethod
    def reduce(self, buf: torch.Tensor, root: int) -> None:
        """Sum ``buf`` over all ranks into ``buf`` on ``root``; other ranks' ``buf`` is left undefined."""

    @abstractmethod
    def all_reduce(self, buf: torch.Tensor) -> None:
        """Sum ``buf`` over all ranks into ``buf`` on every rank."""

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        """In place: ``buf`` holds ``world_size * per_rank`` elements; afterwards rank r's block
        ``[r * per_rank, (r + 1) * per_rank)`` holds the sum of that block over all ranks, the rest is undefined.

        This default is one Reduce per block (inside the caller's group): the same sums and the same bytes for
        a seam without a native ReduceScatter, at ``world_size`` calls instead of one.
        """
        check_scatter(self, buf, per_rank)
        for root in range(self.world_size):
            self.reduce(buf.narrow(0, root * per_rank, per_rank), root)

    def send(self, buf: torch.Tensor, peer: int) -> None:
        """Send ``buf`` to ``peer`` (inside a group, matched by ``peer``'s ``recv`` of the same count)."""
        raise NotImplementedError(f"{self.name}: this communicator has no send (owner hand-off)")

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        """Receive into ``buf`` what ``peer`` sends (inside a group)."""
        raise NotImplementedError(f"{self.name}: this communicator has no recv (owner hand-off)")

    @abstractmethod
    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), by rank: the init-time agreement check."""

    # ---- Note (lazy connections): ``planning.connections`` -----------------------------------------------------

    def warm_up(self, kinds: Sequence[str], max_count: int) -> None:
        """Each collective of ``kinds`` once at every size of ``warm_up_counts(max_count)``, a group each, then waited
        for within the deadline: NCCL connects each algorithm it picks there and then, at init, instead of inside a
        flush. Nothing where the backend connects at creation (gloo). Collective: every rank, the same arguments."""
        if not self.connects_lazily or not kinds:
            return
        from ..planning.collectives import ALLREDUCE, REDUCE, REDUCE_SCATTER
        from ..planning.connections import warm_up_counts

        counts = warm_up_counts(max_count, self.world_size)
        unknown = [k for k in kinds if k not in (REDUCE, ALLREDUCE, REDUCE_SCATTER)]
        if unknown:
            raise ValueError(f"{self.name}: no warm-up for the call kinds {unknown} on the {self.role} communicator")
        buf = torch.zeros(counts[-1], dtype=torch.float32, device=_warm_up_device(self))
        for count in counts:
            view = buf.narrow(0, 0, count)
            for kind in kinds:
                with self.group():
                    if kind == REDUCE:
                        self.reduce(view, 0)
                    elif kind == ALLREDUCE:
                        self.all_reduce(view)
                    else:
                        self.reduce_scatter(view, count // self.world_size)
        self.wait_until(lambda: True, f"the connection warm-up of the {self.role} communicator ({', '.join(kinds)} "
                        f"up to {counts[-1]} elements)", flush=None)

    def connect_peers(self, sends: Sequence[int], recvs: Sequence[int]) -> None:
        """Send one element to each of ``sends`` and receive one from each of ``recvs`` that this communicator has not
        exchanged with yet, in one group, waited for within the deadline: NCCL connects a peer in a direction at its
        first send or receive, whatever the size. Every rank named calls it with the matching directions."""
        if not self.connects_lazily:
            return
        done = self._connected_peers
        todo = [pair for pair in [(True, p) for p in sends] + [(False, p) for p in recvs] if pair not in done]
        if not todo:
            return
        buf = torch.zeros(4 * len(todo), dtype=torch.float32, device=_warm_up_device(self))  # 16-byte aligned slots
        with self.group():
            for i, (send, peer) in enumerate(todo):
                (self.send if send else self.recv)(buf.narrow(0, 4 * i, 1), peer)
        self.wait_until(lambda: True, f"the connection warm-up of the {self.role} communicator's sends and receives "
                        f"({len(todo)} peers and directions)", flush=None)
        done.update(todo)

    def split(self, groups: Sequence[Sequence[int]], role: str) -> ReduceComm:
        """A communicator over the ranks of ``groups`` that holds this rank (ranks of this communicator; every rank
        in exactly one group), with ranks numbered in the group's order: a two-level flush's ``role`` ("node" or
        "rail") communicator, kept in ``subs`` (see Note (sub-communicators)). Collective: every rank calls it with
        the same ``groups``."""
        sub = self._split(groups)
        sub.role = role
        sub.members = tuple(next(g for g in groups if self.rank in g))
        sub.global_rank = self.global_rank
        sub.deadline = self.deadline
        if sub.watchdog is not self.watchdog:
            sub.watchdog.stop()  # its own, which no longer watches it
        sub.watchdog = self.watchdog  # one family: ``watchdog``
        self.watchdog.add(sub)
        self.subs.append(sub)
        sub._after_split()
        return sub

    def _after_split(self) -> None:  # noqa: B027 - optional hook
        """A sub-communicator, named and in its family: ready it within init's deadline (``TorchDistComm``)."""

    def _split(self, groups: Sequence[Sequence[int]]) -> ReduceComm:
        raise NotImplementedError(f"{self.name}: this communicator cannot make sub-communicators (two-level flush)")

    def close_subs(self) -> None:
        """Close the sub-communicators, the last made first; every one is tried, the first failure raised."""
        subs, self.subs = self.subs, []
        first: BaseException | None = None
        for sub in reversed(subs):
            try:
                sub.close()
            except BaseException as error:
                if first is None:
                    first = error
                else:
                    deadlines.add_note(first, f"closing the {sub.role} communicator failed too", error)
        if first is not None:
            raise first

    def release_buffers(self) -> None:  # noqa: B027 - optional hook
        """Drop whatever this communicator keeps per buffer (the runtime released its buckets)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the communicator (at cleanup)."""


def check_scatter(comm: ReduceComm, buf: torch.Tensor, per_rank: int) -> None:
    """Refuse a ``reduce_scatter`` whose buffer is not ``world_size`` blocks of ``per_rank`` elements (every
    implementation checks before it issues, so a wrong plan fails naming the call instead of reading out of bounds)."""
    if per_rank < 0 or buf.numel() != comm.world_size * per_rank:
        raise ValueError(f"{comm.name}: reduce_scatter on rank {comm.rank} needs world_size x per_rank = "
                         f"{comm.world_size} x {per_rank} elements, the buffer has {buf.numel()}")


def _waiting_for(comm: ReduceComm, comms: Sequence[ReduceComm], call: str, flush: int | None
                 ) -> tuple[int | None, str]:
    """(the flush, ``end_backward, waiting for all_reduce(count=8, dtype=float32) (call 2 of 3)``, or ``... on
    the rail communicator``): the oldest unfinished call on any of ``comms``; formatted on failure."""
    pending = [(p, c) for c in comms if (p := c.first_unfinished()) is not None]
    if not pending:
        return (comm.flush if flush is None else flush), call
    (oldest, name), on = min(pending, key=lambda pc: (pc[0][0] is None, pc[0][0] or 0))
    shown = oldest if flush is None else flush
    of = "" if oldest is None or oldest == shown else f" of flush #{oldest}"
    return shown, f"{call}, waiting for {name}{of}{on.where}"


def _any_async_error(comm: ReduceComm) -> str | None:
    """``comm``'s asynchronous error, else the first sub-communicator's, named. Under the watchdog's guard, so never
    while it aborts them (``watchdog`` Note (guard))."""
    with comm.watchdog.lock:
        error = comm.async_error()
        if error is not None:
            return error
        for sub in comm.subs:
            error = sub.async_error()
            if error is not None:
                return f"{sub.role} communicator: {error}"
    return None


def _warm_up_device(comm: ReduceComm) -> torch.device:
    return torch.device("cpu") if comm.cuda_device is None else torch.device("cuda", comm.cuda_device)
