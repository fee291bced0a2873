"""The collective seam: the few calls a flush makes, behind one small interface.

Why a seam: the flush logic must not care whether bytes move through gloo on CPU, torch's NCCL process
group, or a cupy NCCL communicator on a side stream. Each implementation provides ``group()`` (a context
that batches the calls and always closes, also when a call raises), ``reduce(buf, root)``,
``all_reduce(buf)``, ``reduce_scatter(buf, per_rank)``, and ``send(buf, peer)`` / ``recv(buf, peer)`` for the owner
hand-off (in a group of their own); ``root`` and ``peer`` are ranks of the data-parallel communicator, not global
ranks.

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
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from . import deadline as deadlines
from .watchdog import FlushWatchdog


class ReduceComm(ABC):
    """SUM-reductions over the data-parallel communicator (pre-division is the caller's job)."""

    name: str = "abstract"
    cuda_device: int | None = None  # the CUDA device its calls run on (None: the host), which its threads set first
    connects_lazily = False  # NCCL's communicators: Note (lazy connections)

    def __init__(self, rank: int, world_size: int, deadline: deadlines.Deadline | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._in_group = False
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
        if self._in_group:
            raise RuntimeError(f"{self.name}: nested collective group on rank {self.rank}")
        if flush is not None:
            self.flush = flush
        self._in_group = True
        try:
            self._group_start()
        except BaseException:
            self._in_group = False
            raise
        try:
            yield
        except BaseException as error:
            self._in_group = False
            try:
                self._group_failed(error)
            except Exception as close_error:  # noqa: BLE001 - the error raised inside the group is the one to report
                deadlines.add_note(error, "closing the collective group afterwards failed too", close_error)
            raise
        self._in_group = False
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
                named.append(self._waiting_for(comms, call, flush))
            return named[0]

        def check_error() -> str | None:
            watchdog.raise_if_failed()
            return self._any_async_error()

        watchdog.waiting = call
        try:
            deadlines.poll_until_done(lambda: all(c._works_done() for c in comms) and done(), deadline=self.deadline,
                                      rank=self.global_rank, dp_rank=self.dp_rank, flush=lambda: names()[0],
                                      call=lambda: names()[1], check_error=check_error, abort=self._abort_all)
        finally:
            watchdog.waiting = None
        watchdog.raise_if_failed()  # done only because the watchdog's abort forgot the works meanwhile

    def _works_done(self) -> bool:
        """Forget the works in flight that completed; True when none is left (none are kept by default)."""
        return True

    def _first_unfinished(self) -> tuple[int | None, str] | None:
        """(flush, name) of the first call issued here that has not completed, or None (none are kept by default)."""
        return None

    def _waiting_for(self, comms: Sequence[ReduceComm], call: str, flush: int | None) -> tuple[int | None, str]:
        """(the flush, ``end_backward, waiting for all_reduce(count=8, dtype=float32) (call 2 of 3)``, or ``... on
        the rail communicator``): the oldest unfinished call on any of ``comms``; formatted on failure."""
        pending = [(p, comm) for comm in comms if (p := comm._first_unfinished()) is not None]
        if not pending:
            return (self.flush if flush is None else flush), call
        (oldest, name), comm = min(pending, key=lambda pc: (pc[0][0] is None, pc[0][0] or 0))
        shown = oldest if flush is None else flush
        of = "" if oldest is None or oldest == shown else f" of flush #{oldest}"
        return shown, f"{call}, waiting for {name}{of}{comm.where}"

    def _any_async_error(self) -> str | None:
        """This communicator's asynchronous error, else the first sub-communicator's, named. Under the watchdog's
        guard, so never while it aborts them (``watchdog`` Note (guard))."""
        with self.watchdog.lock:
            error = self._async_error()
            if error is not None:
                return error
            for sub in self.subs:
                error = sub._async_error()
                if error is not None:
                    return f"{sub.role} communicator: {error}"
        return None

    def _abort_all(self) -> None:
        """Abort every communicator of this family (this one, the one it was split from, every sub-communicator) at
        once, each in a thread of its own, within the watchdog's bound (``watchdog`` Note (claims by the main
        thread)); the first failure is raised."""
        self.watchdog.abort_all()

    def _take_for_abort(self) -> Callable[[], Any] | None:
        """Under the watchdog's guard, no group open: claim this communicator for an abort and return what aborts it
        (run in a thread of its own), or None where there is nothing to abort (already claimed). From then on no call
        of this communicator reaches the collective library. By default its ``_abort``."""
        return self._abort

    # ---- what the flush watchdog watches (``watchdog`` Note (firing)); read from its thread ----------------

    def _watched(self) -> Sequence[Any]:
        """A snapshot of the groups (or works) issued and not yet forgotten, oldest first; each has ``issued_at``."""
        return ()

    def _entry_done(self, entry: Any) -> bool:
        raise NotImplementedError

    def _entry_watched(self, entry: Any) -> bool:
        """``entry`` is still among those issued (checked after ``_entry_done`` said it is not done)."""
        raise NotImplementedError

    def _entry_name(self, entry: Any) -> tuple[int | None, str]:
        """(its flush, its first call's name)."""
        raise NotImplementedError

    def _async_error(self) -> str | None:
        """An error the communicator reported asynchronously (NCCL), or None."""
        return None

    def _abort(self) -> None:  # noqa: B027 - optional hook
        """Stop this communicator after a failed wait, without waiting for peers (at most once)."""

    def _group_start(self) -> None:  # noqa: B027 - optional hook
        pass

    def _group_end(self) -> None:  # noqa: B027 - optional hook
        pass

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
        self._check_scatter(buf, per_rank)
        for root in range(self.world_size):
            self.reduce(buf.narrow(0, root * per_rank, per_rank), root)

    def _check_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        if per_rank < 0 or buf.numel() != self.world_size * per_rank:
            raise ValueError(f"{self.name}: reduce_scatter on rank {self.rank} needs world_size x per_rank = "
                             f"{self.world_size} x {per_rank} elements, the buffer has {buf.numel()}")

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
        buf = torch.zeros(counts[-1], dtype=torch.float32, device=self._warm_up_device())
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
        buf = torch.zeros(4 * len(todo), dtype=torch.float32, device=self._warm_up_device())  # 16-byte aligned slots
        with self.group():
            for i, (send, peer) in enumerate(todo):
                (self.send if send else self.recv)(buf.narrow(0, 4 * i, 1), peer)
        self.wait_until(lambda: True, f"the connection warm-up of the {self.role} communicator's sends and receives "
                        f"({len(todo)} peers and directions)", flush=None)
        done.update(todo)

    def _warm_up_device(self) -> torch.device:
        return torch.device("cpu") if self.cuda_device is None else torch.device("cuda", self.cuda_device)

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


class _Call(NamedTuple):
    """One issued call, for its error message (formatted only on failure) and how it is waited for."""

    kind: str
    peer: int | None  # the root of a reduce, the peer of a send/recv
    count: int
    dtype: torch.dtype
    on_device: bool  # a CUDA tensor (NCCL): ordered on the stream, never waited for on the host per flush


class _InFlight(NamedTuple):
    """A device call ordered on a stream whose completion no sync point has seen yet."""

    work: Any
    call: _Call
    index: int  # its place in its group, for the error message
    calls: int
    flush: int | None
    issued_at: float = 0.0  # time.monotonic() at its issue: the flush watchdog's deadline counts from it


class TorchDistComm(ReduceComm):
    """Through torch.distributed on DeepSpeed's data-parallel process group: gloo on CPU, NCCL on GPU.

    Note (Python dispatcher): DeepCompile profiles graphs with the Python dispatcher on; a gloo worker whose
    destructor needs the GIL then deadlocks against the main thread (about 1 run in 6 on CPU). Every call
    and every wait here runs with the Python dispatcher off: once for a whole group, or around a single call
    outside one.

    Note (per-call cost): the group, the global rank of every root and the SUM op are resolved once; the calls
    go to ``torch.distributed`` directly (the process group is DeepSpeed's; ``deepspeed.comm``'s wrappers add
    about 14 µs per call, and the flush issues one call per owner run).

    Note (bounded waits): every call is issued with async_op=True. On the host (gloo, CPU tensors) it is waited
    with Work.wait(timeout): in a group, all of the flush's calls at its end against one deadline; outside a
    group, at once. A flush therefore fails within the deadline when a peer stalls, instead of DeepSpeed's group
    timeout. On the device (NCCL, CUDA tensors) ``Work.wait(timeout)`` would block the host until the collective
    ends, so the autograd thread would stop issuing the backward's kernels and communication would no longer
    overlap compute: there each work is ordered on the current stream instead (``Work.block_current_stream()``:
    the stream waits for it, the host never does, whatever ``TORCH_NCCL_BLOCKING_WAIT`` says) and kept in flight;
    the deadline is enforced where the runtime already waits for the reduce stream (end of backward, bucket
    growth, cleanup: ``wait_until``), which also polls every work in flight (``is_completed()``, ``exception()``).
    A stall there fails naming the first unfinished call and its flush, and aborts the process group
    (``ProcessGroup.abort()``, once) so that no NCCL kernel is left spinning.

    Note (send/recv): a group's sends and receives are issued together at its end with ``batch_isend_irecv`` (on
    NCCL one grouped launch, so that two ranks sending to each other cannot block each other; on gloo each is
    asynchronous anyway) and waited like every call; gloo's send/recv works honour ``wait(timeout)``.
    """

    name = "torch.distributed"

    def __init__(self, process_group: Any, tdist: Any = None) -> None:
        """``tdist`` is ``torch.distributed`` (tests pass a fake with the same functions)."""
        if tdist is None:
            import torch.distributed as tdist
        self._tdist = tdist
        self._group = process_group
        group = tdist.group.WORLD if process_group is None else process_group
        world_size = tdist.get_world_size(group=group)
        super().__init__(tdist.get_rank(group=group), world_size)
        self._global_rank = [tdist.get_global_rank(group, r) for r in range(world_size)]
        self.global_rank = self._global_rank[self.rank]
        self._sum = tdist.ReduceOp.SUM
        self._no_dispatcher: Any = None
        self._native_scatter = str(tdist.get_backend(group)).lower() != "gloo"  # see reduce_scatter
        self._works: list[tuple[Any, _Call]] = []  # issued in the open group, not yet waited for or ordered
        self._p2p: list[tuple[Any, _Call]] = []  # P2POps, issued at group end
        self._in_flight: list[_InFlight] = []  # device works ordered on a stream, not yet seen complete
        self._retired: list[_InFlight] = []  # an aborted group's works (their CUDA events): kept until ``close``
        self.aborted = False
        if self._native_scatter and torch.cuda.is_available():  # NCCL: its works run on this rank's device
            from .threads import current_cuda_device

            self.cuda_device = current_cuda_device()
            self.connects_lazily = self.cuda_device is not None  # torch's NCCL backend: Note (lazy connections)

    def _group_start(self) -> None:
        self.watchdog.raise_if_failed()  # aborted by the flush watchdog: its error, never a call on an aborted group
        self._no_dispatcher = _no_python_dispatcher()
        self._no_dispatcher.__enter__()

    def _group_end(self) -> None:
        works, self._works = self._works, []
        p2p, self._p2p = self._p2p, []
        context, self._no_dispatcher = self._no_dispatcher, None
        try:
            if p2p:
                works += self._issue_p2p(p2p)
            self._settle(works, flush=self.flush)
        finally:
            if context is not None:
                context.__exit__(None, None, None)

    def _group_failed(self, error: BaseException) -> None:
        """Nothing more is issued (the hand-off's operations are dropped) or waited for: the job cannot go on, and
        the error raised inside the group is the one to report. Device works already issued stay in flight, so
        the next sync point still bounds them (and aborts the group on a timeout)."""
        works, self._works = self._works, []
        self._p2p = []
        context, self._no_dispatcher = self._no_dispatcher, None
        try:
            now = time.monotonic()
            self._in_flight += [_InFlight(work, call, i, len(works), self.flush, now)
                                for i, (work, call) in enumerate(works) if work is not None and call.on_device]
            del works  # gloo's works are released with the Python dispatcher still off (see Note (Python dispatcher))
        finally:
            if context is not None:
                context.__exit__(None, None, None)

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        call = _Call("reduce", root, buf.numel(), buf.dtype, buf.is_cuda)
        if self._in_group:
            work = self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group,
                                      async_op=True)
            self._works.append((work, call))
            return
        with _no_python_dispatcher():
            work = self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group,
                                      async_op=True)
            self._settle([(work, call)], flush=self.flush)

    def all_reduce(self, buf: torch.Tensor) -> None:
        call = _Call("all_reduce", None, buf.numel(), buf.dtype, buf.is_cuda)
        if self._in_group:
            work = self._tdist.all_reduce(buf, op=self._sum, group=self._group, async_op=True)
            self._works.append((work, call))
            return
        with _no_python_dispatcher():
            work = self._tdist.all_reduce(buf, op=self._sum, group=self._group, async_op=True)
            self._settle([(work, call)], flush=self.flush)

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        """One ``reduce_scatter_tensor``, in place: the output is this rank's own block of the input, as
        ncclReduceScatter allows.

        Note (gloo's ReduceScatter cannot be bounded): gloo has ``reduce_scatter_tensor`` in torch 2.13, but its
        async work neither reports completion (``is_completed()`` stays false) nor honours ``wait(timeout)``: it
        blocks until every peer answers, so a stalled peer would hang this rank past the deadline. On gloo the
        flush's ReduceScatter is therefore issued as one Reduce per block (the seam's default: the same sums,
        bitwise, and the same bytes, at ``world_size`` calls), each waited within the deadline.
        """
        if not self._native_scatter:
            super().reduce_scatter(buf, per_rank)
            return
        self._check_scatter(buf, per_rank)
        out = buf.narrow(0, self.rank * per_rank, per_rank)
        call = _Call("reduce_scatter", None, buf.numel(), buf.dtype, buf.is_cuda)
        if self._in_group:
            work = self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group, async_op=True)
            self._works.append((work, call))
            return
        with _no_python_dispatcher():
            work = self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group, async_op=True)
            self._settle([(work, call)], flush=self.flush)

    def _issue_p2p(self, p2p: list[tuple[Any, _Call]]) -> list[tuple[Any, _Call]]:
        """Issue a group's sends and receives together; a failure to issue (gloo: a pair its peer closed) is the one
        error too, naming the round. gloo returns one work per operation; NCCL coalesces the round into one work,
        named ``send/recv(count=<the round's elements>, ...)``."""
        try:
            issued = self._tdist.batch_isend_irecv([op for op, _ in p2p])
        except Exception as error:  # noqa: BLE001 - gloo and NCCL raise RuntimeError (or DistBackendError)
            raise deadlines.OwnerReduceCommError(
                rank=self.global_rank, dp_rank=self.dp_rank, flush=self.flush,
                call=f"send/recv round ({len(p2p)} operations, first {_call_name(p2p[0][1], 0, 1, self)}){self.where}",
                waited_s=0.0, deadline=self.deadline,
                reason=f"failed: {type(error).__name__}: {deadlines.first_line(error)}") from error
        calls = [call for _, call in p2p]
        if len(issued) != len(calls):  # one coalesced work for the whole round
            first = calls[0]
            calls = [first._replace(kind="send/recv", peer=None, count=sum(c.count for c in calls))] * len(issued)
        return list(zip(issued, calls, strict=True))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._point_to_point(self._tdist.isend, "send", buf, peer)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._point_to_point(self._tdist.irecv, "recv", buf, peer)

    def _point_to_point(self, fn: Any, name: str, buf: torch.Tensor, peer: int) -> None:
        op = self._tdist.P2POp(fn, buf, self._global_rank[peer], group=self._group)
        call = _Call(name, peer, buf.numel(), buf.dtype, buf.is_cuda)
        if self._in_group:
            self._p2p.append((op, call))
            return
        with _no_python_dispatcher():
            self._settle(self._issue_p2p([(op, call)]), flush=self.flush)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """On the accelerator the backend needs (NCCL: CUDA) without a blocking copy (``nccl_comm`` Note (no blocking
        copy)): the values go there by a non-blocking copy from pinned memory, the gather's work is polled within the
        deadline (``wait_until``), and only then the result comes back, by a non-blocking copy waited for the same
        way (issue 37, finding 6)."""
        from deepspeed.accelerator import get_accelerator

        self.watchdog.raise_if_failed()
        device = torch.device(get_accelerator().current_device_name())
        host = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            local = torch.empty_like(host, device=device)
            local.copy_(pinned(host), non_blocking=True)
        else:
            local = host
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        with _no_python_dispatcher():
            work = self._tdist.all_gather(gathered, local, group=self._group, async_op=True)
            self._settle([(work, _Call("all_gather", None, local.numel(), local.dtype, local.is_cuda))], flush=None)
        if not local.is_cuda:
            return [g.tolist() for g in gathered]
        self.wait_until(lambda: True, "all_gather_ints", flush=None)  # the gather's work, in flight
        out = pinned(torch.empty(self.world_size * local.numel(), dtype=torch.int64))
        out.copy_(torch.cat(gathered), non_blocking=True)  # on the current stream, which waited for the work
        copied = torch.cuda.Event()
        copied.record()
        self.wait_until(copied.query, "all_gather_ints: its copy to the host", flush=None)
        return out.view(self.world_size, -1).tolist()

    def _split(self, groups: Sequence[Sequence[int]]) -> TorchDistComm:
        """This rank's group as a ``new_group`` with local synchronization: only its members create it, and torch names
        it by a hash of its ranks. Why not every rank creating every group: under a data-parallel group smaller than
        the job (tensor or pipeline parallelism beside it), only this data-parallel group's ranks run ``split``, and
        torch's default names count the groups each process made, so two data-parallel groups would give groups of
        different ranks the same name, and their ranks would meet in one rendezvous. Every rank creates its groups in
        the same order (node, then rail), as local synchronization needs. The deadline is the group's timeout."""
        from datetime import timedelta

        mine = next((g for g in groups if self.rank in g), None)
        if mine is None:
            raise ValueError(f"{self.name}: rank {self.rank} is in none of the groups {[list(g) for g in groups]}")
        timeout = timedelta(seconds=max(1.0, self.deadline.allowed_s(time.monotonic())))
        with _no_python_dispatcher():
            group = self._tdist.new_group(ranks=[self._global_rank[m] for m in mine], timeout=timeout,
                                          use_local_synchronization=True)
        return TorchDistComm(group, self._tdist)

    def _after_split(self) -> None:
        """Note (warm-up): torch's NCCL backend creates a group's NCCL communicator lazily, on the host, inside the
        group's first operation; without this that is the first overlapped flush (a wait no deadline bounds), and the
        node hand-off group's first operation is ``batch_isend_irecv``, which torch documents as undefined unless every
        rank of the group takes part in that first call. So every new group runs one tiny AllReduce here, at init,
        every rank of it together, within init's deadline: the call itself under ``end_process_if_still_blocked``
        (a creation nothing can interrupt: ``deadline`` Note (a blocking init)), its completion polled by
        ``wait_until``. On gloo too (it connects at creation: the AllReduce only checks the group works)."""
        device = torch.device("cpu")
        if "nccl" in str(self._tdist.get_backend(self._group)).lower() and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        buf = torch.zeros(1, device=device)
        call = _Call("warm-up all_reduce", None, 1, buf.dtype, buf.is_cuda)
        what = (f"the warm-up all_reduce(count=1) of the new {self.role} group (torch creates its NCCL communicator "
                f"there)")
        with _no_python_dispatcher():
            work = deadlines.end_process_if_still_blocked(
                lambda: self._tdist.all_reduce(buf, op=self._sum, group=self._group, async_op=True),
                deadline=self.deadline, rank=self.global_rank, what=what)
            self._settle([(work, call)], flush=None)
        if buf.is_cuda:
            self.wait_until(lambda: True, f"warm-up of the {self.role} group", flush=None)

    def close(self) -> None:
        """The runtime's cleanup has waited for the reduce stream (and so for every work in flight) already."""
        self._in_flight.clear()
        self._retired.clear()
        self.watchdog.forget(self)

    # ---- waiting --------------------------------------------------------------------------------------------

    def _settle(self, works: list[tuple[Any, _Call]], flush: int | None) -> None:
        """Host works (gloo): wait for them in issue order, all within one deadline from now. Device works (NCCL):
        order them on the current stream and keep them in flight; see Note (bounded waits). The Python
        dispatcher is already off."""
        started = time.monotonic()
        on_device = False
        for i, (work, call) in enumerate(works):
            if work is None:  # a rank outside the group (not ours: every rank of the group calls)
                continue
            if call.on_device:
                work.block_current_stream()  # returns at once: the stream waits, not the host
                self._in_flight.append(_InFlight(work, call, i, len(works), flush, started))
                on_device = True
                continue
            deadlines.wait_work(work, deadline=self.deadline, started=started, rank=self.global_rank,
                                dp_rank=self.dp_rank, flush=flush,
                                call=lambda call=call, i=i: _call_name(call, i, len(works), self) + self.where)
        if on_device and not self.watchdog.armed:  # after the append: see ``FlushWatchdog._run``
            self.watchdog.arm()

    def _works_done(self) -> bool:
        """Forget the works in flight that completed (in issue order); True when none is left. A work that failed
        stays, for ``_async_error`` to report."""
        in_flight = self._in_flight
        done = 0
        for entry in in_flight:
            if not entry.work.is_completed() or entry.work.exception() is not None:
                break
            done += 1
        del in_flight[:done]
        return not in_flight

    def _async_error(self) -> str | None:
        """A device work in flight that completed with an error (NCCL's, as torch reports it), named. Also read by the
        flush watchdog's thread: over a snapshot."""
        for entry in self._in_flight[:]:
            if entry.work.is_completed():
                error = entry.work.exception()
                if error is not None:
                    return (f"{_in_flight_name(entry, None, self)}: {type(error).__name__}: "
                            f"{deadlines.first_line(error)}")
        return None

    def _first_unfinished(self) -> tuple[int | None, str] | None:
        pending = next((e for e in self._in_flight if not e.work.is_completed() or e.work.exception() is not None),
                       None)
        if pending is None:
            return None
        return pending.flush, _call_name(pending.call, pending.index, pending.calls, self)

    def _abort(self) -> None:
        """After a failed wait on device works: abort the process group (once), so that its NCCL kernels stop."""
        abort = self._take_for_abort()
        if abort is not None:
            abort()

    def _take_for_abort(self) -> Callable[[], Any] | None:
        """The process group's ``abort`` (once); torch's own watchdog aborts it from another thread too, so no guard
        is needed around this communicator's calls. The works' CUDA events stay alive until ``close``, on the main
        thread (``nccl_comm`` Note (events outlive the aborts))."""
        self._retired += self._in_flight
        self._in_flight.clear()
        if self.aborted:
            return None
        self.aborted = True
        return getattr(self._group if self._group is not None else self._tdist.group.WORLD, "abort", None)

    def _watched(self) -> Sequence[Any]:
        return self._in_flight[:]

    def _entry_done(self, entry: Any) -> bool:
        return bool(entry.work.is_completed())

    def _entry_watched(self, entry: Any) -> bool:
        return any(e is entry for e in self._in_flight)

    def _entry_name(self, entry: Any) -> tuple[int | None, str]:
        return entry.flush, _call_name(entry.call, entry.index, entry.calls, self)


def _in_flight_name(entry: _InFlight, reported_flush: int | None, comm: ReduceComm) -> str:
    """The call's name, and its flush where the error names another one (or none)."""
    name = _call_name(entry.call, entry.index, entry.calls, comm)
    return name if entry.flush is None or entry.flush == reported_flush else f"{name} of flush #{entry.flush}"


def _call_name(call: _Call, index: int, calls: int, comm: ReduceComm) -> str:
    """``reduce(root=1, count=143, dtype=float32) (call 1 of 4)``, a root or peer named by ``comm.peer_name`` (Note
    (names)): formatted only for an error."""
    kind, root, count, dtype, _ = call
    who = "" if root is None else f"{'peer' if kind in ('send', 'recv') else 'root'}={comm.peer_name(root)}, "
    name = f"{kind}({who}count={count}, dtype={str(dtype).removeprefix('torch.')})"
    return name if calls == 1 else f"{name} (call {index + 1} of {calls})"


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned host memory, so that a copy between it and the device is asynchronous; ``tensor`` itself
    where no pinned allocator is available (a copy may then be synchronous, which is why each is made only after the
    collective it reads was waited for within the deadline: ``nccl_comm`` Note (no blocking copy))."""
    try:
        return tensor.pin_memory()
    except RuntimeError:
        return tensor


def _no_python_dispatcher() -> Any:
    from torch._dispatch.python import no_python_dispatcher

    return no_python_dispatcher()
