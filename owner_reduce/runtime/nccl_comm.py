"""The cupy NCCL communicator: the flush's Reduce/AllReduce on torch CUDA buffers through ``cupy.cuda.nccl``.

Why a communicator of our own: torch's NCCL process group has no grouped ``ncclReduce`` to a chosen root
that we could batch with AllReduces in one ``ncclGroupStart/End``, and DeepCompile's native runtime owns its
communicator the same way (z1.cpp). The requested form is Python only, so NCCL is reached through cupy's
binding, and only through ``nccl_binding`` (the only module of the package that imports cupy, lazily, so that
importing owner_reduce never needs cupy or a GPU).

The communicator mirrors the data-parallel group: group rank 0 creates the unique id, it is broadcast over
that torch process group (gloo or NCCL), and every rank builds ``NcclCommunicator(ws, uid, group_rank)`` on
its current CUDA device. ``root`` in ``reduce`` is a rank of that group.

Note (stream): by default every call runs on torch's current stream at call time, which orders it after the
copies that filled the bucket and before the copy-out that reads it, with no extra synchronisation. With an
explicit side ``stream``, the group waits for the current stream when it opens, and the current stream waits
for the side stream when it closes: results are visible to later work on the current stream either way.

Note (buffer lifetime): NCCL reads and writes the buffers asynchronously. On the current stream the caching
allocator's stream order keeps a freed buffer from being reused too early; on a side stream every buffer is
``record_stream``-ed on it, so the allocator waits for the collective before handing the memory out again.

Note (ordering): NCCL kernels of this communicator and of torch's NCCL process group share the GPU; every
rank must issue them in the same order. The flush runs at the same point of the step on every rank, so it
does; do not issue collectives of either from another thread while a flush is in flight.

Note (bounded waits): nothing here waits with a plain ``synchronize()``: ``all_gather_ints`` and ``close``
poll the stream and ``ncclCommGetAsyncError`` within the deadline (``ReduceComm.wait_until``), and so do the
runtime's end-of-backward, bucket-growth and cleanup waits. On a timeout, an asynchronous NCCL error, a
failed NCCL call or a call that raises inside a group, this rank aborts every communicator of its family (the
data-parallel one and its node, rail and node hand-off ones) at once, each in a thread of its own and bounded
(``ncclCommAbort``, at most once each; never ``ncclCommDestroy``, which waits for work the peers never finish): an
abort waits for its communicator's last kernel, which may sit behind another communicator's spinning kernel on the
same stream, so no order one after another is safe (``watchdog`` Note (firing)). Where the host never reaches one of
these waits (blocked in a CUDA launch behind a stalled stream), the flush watchdog's thread does it at the deadline
counted from each group's issue (``watchdog``); every NCCL call and open group holds its guard, so no abort ever
runs under one. Peers then see a connection error where NCCL's transport reports one (network), or reach their own
deadline.

Note (abort inside a group): never between ``ncclGroupStart`` and ``ncclGroupEnd``. A call enqueued in a group
links the communicator into the thread's group; ``ncclCommAbort`` frees it (NCCL 2.21: at once; 2.28: as a job
that ``ncclGroupEnd`` runs before it launches the group, or drops when the group failed), so the group end would
walk freed memory (a crash instead of this package's error) or never abort. So a failure inside a group only
asks for the abort (``_abort`` defers it while the group is open); the group is ended first (``ncclGroupEnd``;
after a failed enqueue NCCL reports that error again there and launches nothing, which is only noted on the
first error), then the communicator is aborted, once, and the first error is the one raised. ``ncclGroupStart``
only counts the nesting in NCCL; a failure to call it leaves no group open, so it aborts at once.

Note (DLPack views): each buffer a collective is given a view of (in the flush: a bucket buffer) reaches cupy
once, through DLPack; its device, dtype and NCCL dtype are checked and resolved then, and every later call on a
view of it only adds the view's element offset to the cached pointer. The cache holds the buffer alive until
``release_buffers()`` (the runtime calls it when it releases its buckets) or ``close()``. The capsule is made
with ``__dlpack__(stream=-1)``, "no synchronization", and handed to ``cupy.from_dlpack`` as is: given the
tensor, cupy would pass its current stream (the legacy default stream) and torch would record an event on its
own current stream (the reduce stream, in a flush) and make the default stream wait for it, so the backward's
compute would wait for the previous flush's collectives whenever views are made (every step where the buckets
are released). None is needed: cupy never touches the memory on a stream of its own, every collective on it
is issued on a torch stream ordered after the current stream at call time (Note (stream)), and a view is reused
by every later flush, so a synchronization when it is made could order only its first use anyway. Without
``max_version`` torch (2.9 to 2.15 alike) exports the unversioned capsule (DLPack 0.8, ``_C._to_dlpack``): it has
no flags field, so it is never read-only, as it must not be (NCCL writes the buffer in place); torch 2.14's
``read_only`` applies to the versioned capsule only, and cupy 14 takes either capsule as is.

Note (in flight): NCCL reports no per-call completion, so after each group (or a call outside one) an event is
recorded on the stream it was issued on and kept with its flush and first call until it completes: a stalled wait
names the first unfinished call, its flush and its communicator (``ReduceComm.wait_until``; a node or rail
communicator's calls run on the level streams, which the data-parallel communicator's stream never sees), ``close``
waits for exactly this communicator's work, and completed groups give their events to later ones (one event record
per group on the hot path, none created in a steady step).

Note (events outlive the aborts): the flush watchdog claims a communicator for its abort from its own thread; the
events of the groups still in flight then move to ``_retired`` instead of being dropped there, and ``close`` (the main
thread) releases them. Dropping the last reference destroys a CUDA event (``cudaEventDestroy``), which takes CUDA
driver locks that a main thread blocked behind the stalled collective may hold; on the watchdog thread, before any
``ncclCommAbort`` has run, that wait would have no bound and nothing would ever abort (issue 46, finding 2; torch's
ProcessGroupNCCL moved event destruction off its own watchdog for the same reason).

Note (a bounded destroy): see ``CupyNcclComm._destroy_bounded``; every thread of this module's runs on the
communicator's device (``threads``).

Note (init can block): ``ncclCommInitRank`` waits for every rank. ``comm_select`` agrees on every local
precondition before any rank calls it, so a rank that cannot even try never leaves the others waiting; a peer that
never joins ends the waiting ranks' processes at the deadline (``deadline`` Note (a blocking init)).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..planning.wording import by_reason, ranks_phrase
from . import deadline as deadlines
from . import nccl_binding as binding
from . import threads
from .comm import ReduceComm, check_scatter
from .host_memory import pinned


class _IssuedGroup(NamedTuple):
    """A group (or a call outside one) issued on the device, until an event recorded after it completes: what a
    stalled wait names (``first_unfinished``), as ``torch_comm._InFlight`` does for torch's works."""

    event: Any  # a torch.cuda.Event recorded on the call's stream after it
    flush: int | None
    first: tuple[str, str | None, int, int, torch.dtype]  # the first call: (name, root/peer label, value, count, dtype)
    calls: int
    issued_at: float = 0.0  # time.monotonic() when its group opened: the flush watchdog's deadline counts from it


class _BufferView(NamedTuple):
    """A buffer as cupy sees it (through DLPack), made once per buffer: what every call on a view of it needs."""

    tensor: torch.Tensor  # the torch buffer itself: alive while cached, so its id() keys no other buffer
    array: Any  # the cupy array over its bytes
    ptr: int
    itemsize: int
    storage_offset: int  # the torch buffer's storage offset, to turn a view's offset into elements past ptr
    nccl_dtype: int


class CupyNcclComm(ReduceComm):
    """An NCCL communicator over the data-parallel group, driven through cupy on torch CUDA buffers.

    Buffers are contiguous CUDA tensors on this communicator's device (typically views of a bucket buffer),
    reduced in place; they reach cupy through DLPack once per underlying buffer (see the module's note).
    ``stream`` is a ``torch.cuda.Stream`` or None (torch's current stream at call time).
    """

    name = "cupy-nccl"
    connects_lazily = True  # ``comm`` Note (lazy connections)
    _issued_at = 0.0  # when the group's ncclGroupEnd launched it (``watchdog.calling``)

    def __init__(self, unique_id: bytes, rank: int, world_size: int, *, device: int | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(rank, world_size)
        if len(unique_id) != binding.UNIQUE_ID_BYTES:
            raise ValueError(f"owner_reduce: NCCL unique id must have {binding.UNIQUE_ID_BYTES} bytes, "
                             f"got {len(unique_id)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"owner_reduce: rank {rank} outside 0..{world_size - 1}")
        self.stream = stream
        self._calls_in_group = 0
        self._group_open = False  # between ncclGroupStart and ncclGroupEnd
        self._abort_pending = False  # asked for inside the open group: see Note (abort inside a group)
        self._comm: Any = None
        self.aborted = False
        self._views: dict[int, _BufferView] = {}  # id(buffer) -> its DLPack view (the view keeps it alive)
        self._issued: list[_IssuedGroup] = []  # groups on the device not yet seen complete: Note (in flight)
        self._free_events: list[Any] = []  # events of completed groups, recorded again by later ones
        self._retired: list[_IssuedGroup] = []  # an aborted communicator's groups: Note (events outlive the aborts)
        self._make_event: Callable[[], Any] = torch.cuda.Event  # tests: a fake
        self._first_call: tuple[str, str | None, int, int, torch.dtype] | None = None  # the open group's first call
        self.global_rank = binding.process_rank(rank)
        what = f"communicator creation (world_size={world_size}, rank={rank}, device={device})"
        try:
            cupy = binding.cupy_module()
            nccl = binding.nccl_module()
            self._cupy = cupy
            self._sum = binding.nccl_op("sum")  # resolved once: the flush only sums
            self.device = binding.current_device() if device is None else int(device)
            self.cuda_device = self.device  # the device the flush watchdog's and the aborts' threads set
            what = f"communicator creation (world_size={world_size}, rank={rank}, device=cuda:{self.device})"
            with cupy.cuda.Device(self.device):  # deadline.py Note (a blocking init)
                self._comm = deadlines.end_process_if_still_blocked(
                    lambda: nccl.NcclCommunicator(world_size, unique_id, rank), deadline=self.deadline,
                    rank=self.global_rank,
                    what=f"ncclCommInitRank (world_size={world_size}, rank={rank}, device=cuda:{self.device})")
            binding.remember_open(self._comm, self.device)
        except Exception as error:  # noqa: BLE001 - every cause becomes one RuntimeError naming the call
            raise binding.failure(what, self.global_rank, error) from error

    @classmethod
    def from_process_group(cls, process_group: Any, *, stream: torch.cuda.Stream | None = None) -> CupyNcclComm:
        """Mirror a torch/DeepSpeed process group: exchange the id over it, then create on the current device.

        Collective over ``process_group``: every rank must call it.
        """
        import torch.distributed as dist
        from torch._dispatch.python import no_python_dispatcher

        group = binding.group_or_world(process_group)
        unique_id = binding.exchange_unique_id(group)
        # ncclCommInitRank blocks until every rank joins: settle everything that can fail on one rank alone
        # (cupy, the device) first, and agree on it, so that no rank waits in an init its peers never reach.
        device, problem = None, None
        try:
            binding.nccl_module()
            device = binding.current_device()
        except Exception as error:  # noqa: BLE001 - agreed on below
            problem = f"{type(error).__name__}: {error}"
        problems: list[str | None] = [None] * dist.get_world_size(group)
        with no_python_dispatcher():
            dist.all_gather_object(problems, problem, group=group)
        failed = {r: p for r, p in enumerate(problems) if p is not None}
        if failed:
            raise RuntimeError("owner_reduce: not creating the NCCL communicator: " + "; ".join(by_reason(problems)))
        return cls(unique_id, dist.get_rank(group), dist.get_world_size(group), device=device, stream=stream)

    # ---- the seam ------------------------------------------------------------------------------------------

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"owner_reduce: reduce root {root} outside 0..{self.world_size - 1}")
        self._collective(buf, "reduce", "root", root,
                         lambda comm, ptr, n, dt, op, s: comm.reduce(ptr, ptr, n, dt, op, root, s))

    def all_reduce(self, buf: torch.Tensor) -> None:
        self._collective(buf, "all_reduce", None, 0,
                         lambda comm, ptr, n, dt, op, s: comm.allReduce(ptr, ptr, n, dt, op, s))

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        """One ncclReduceScatter, in place: NCCL allows ``recvbuff == sendbuff + rank * recvcount``, so this rank's
        block of ``buf`` receives its sum and no other buffer is needed."""
        check_scatter(self, buf, per_rank)
        offset = self.rank * per_rank * buf.element_size()
        self._collective(buf, "reduce_scatter", "per_rank", per_rank,
                         lambda comm, ptr, n, dt, op, s: comm.reduceScatter(ptr, ptr + offset, per_rank, dt, op, s))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._check_peer(peer)
        self._collective(buf, "send", "peer", peer,
                         lambda comm, ptr, n, dt, op, s: comm.send(ptr, n, dt, peer, s))

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._check_peer(peer)
        self._collective(buf, "recv", "peer", peer,
                         lambda comm, ptr, n, dt, op, s: comm.recv(ptr, n, dt, peer, s))

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"owner_reduce: send/recv peer {peer} on rank {self.rank} must be another rank of "
                             f"0..{self.world_size - 1}")

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Through this communicator (ncclAllGather of int64), so it needs no torch process group.

        Note (no blocking copy): a blocking copy synchronizes the host with the stream, outside the deadline, behind
        whatever the stream holds (issue 37, finding 6). So the values go to the device by a non-blocking copy from
        pinned memory, the host waits for the gather within the deadline (an event after it, polled by
        ``wait_until``), and only then copies the result back (non-blocking into pinned memory, that copy waited for
        the same way): a pageable buffer (where pinning is unavailable) can make a copy synchronous, but never behind
        an unfinished collective."""
        if self.in_group:
            raise RuntimeError(f"{self.name}: all_gather_ints inside a collective group on rank {self.rank}")
        count = len(values)
        device = torch.device("cuda", self.device)
        host = pinned(torch.tensor(values, dtype=torch.int64))
        stream = self._stream()
        self._wait_current(stream)
        with torch.cuda.stream(stream):
            local = torch.empty(count, dtype=torch.int64, device=device)
            out = torch.empty(self.world_size * count, dtype=torch.int64, device=device)
            local.copy_(host, non_blocking=True)
        what = f"all_gather(count={count}, dtype=int64)"
        self._call(what, lambda: self._live(what).allGather(local.data_ptr(), out.data_ptr(), count,
                                                            binding.nccl_dtype(torch.int64), stream.cuda_stream))
        self._wait_for_event(stream, what)
        back = pinned(torch.empty(self.world_size * count, dtype=torch.int64))
        with torch.cuda.stream(stream):
            back.copy_(out, non_blocking=True)
        self._wait_for_event(stream, f"{what}: its copy to the host")
        return back.view(self.world_size, -1).tolist()

    def _wait_for_event(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait, within the deadline, for what ``stream`` holds now (an event recorded after it)."""
        done = self._make_event()
        done.record(stream)
        self.wait_until(done.query, what, flush=None)

    def _split(self, groups: Sequence[Sequence[int]]) -> CupyNcclComm:
        """A new NCCL communicator per group: each group's first rank creates its unique id, every rank gathers them
        with a status in one ``all_gather_ints`` on this communicator (bounded by the deadline), then builds its
        group's with ``ncclCommInitRank`` on this device, on torch's current stream at call time (the flush picks the
        stream). A first rank that cannot create an id says so in its status, and every rank raises naming it (its own
        cause on that rank), instead of its group waiting for an id that never comes."""
        mine = next((g for g in groups if self.rank in g), None)
        if mine is None:
            raise ValueError(f"owner_reduce: rank {self.rank} is in none of the groups {[list(g) for g in groups]}")
        status, uid, cause = 1, bytes(binding.UNIQUE_ID_BYTES), ""
        if mine[0] == self.rank:
            try:
                uid = binding.new_unique_id()
            except Exception as error:  # noqa: BLE001 - agreed on below, then raised on every rank
                status, cause = 0, f": {type(error).__name__}: {error}"
        rows = self.all_gather_ints([status, *uid])
        failed = [r for r, row in enumerate(rows) if row[0] != 1]
        if failed:
            raise RuntimeError(f"owner_reduce: data-parallel {ranks_phrase(failed)} could not create an NCCL unique id "
                               f"for a node or rail communicator{cause}")
        return CupyNcclComm(bytes(rows[mine[0]][1:]), list(mine).index(self.rank), len(mine), device=self.device)

    def release_buffers(self) -> None:
        """Forget every buffer's DLPack view, so that released buckets can be freed."""
        self._views.clear()

    def close(self) -> None:
        """Release the communicator (idempotent, bounded): the work it issued is waited for within the deadline, on
        whatever stream it ran (a node or rail communicator's run on the level streams: Note (in flight)), then
        ``ncclCommDestroy``; if that wait fails, or the communicator was aborted, nothing is destroyed
        (``ncclCommAbort`` already released it)."""
        self._views.clear()
        self._retired.clear()  # on the main thread: Note (events outlive the aborts)
        if self._comm is None:
            self.watchdog.forget(self)
            return
        self.wait_until(lambda: True, "close (work still in flight on the communicator)")
        self.watchdog.enter(self)
        comm, self._comm = self._comm, None
        binding.forget_open(comm)
        self.watchdog.leave()
        self.watchdog.forget(self)
        if comm is not None:
            self._destroy_bounded(comm)

    def _destroy_bounded(self, comm: Any) -> None:
        """Note (a bounded destroy): ``ncclCommDestroy`` returns after this communicator's kernels (none are left: the
        wait before it saw them complete) and ``commFree``'s frees, which may wait for every kernel on the GPU (NCCL
        issue 549, PR 564): a kernel of another library that never finishes (a torch collective on a dead peer) would
        hold it forever. So it runs on a thread of its own (on this device: ``threads``) and the close waits for it
        within the deadline; past it, the error names the call, and the destroy is left to its thread (nothing else
        may touch the handle: an abort now would free it twice)."""
        started = time.monotonic()
        failed: list[BaseException] = []

        def destroy() -> None:
            try:
                comm.destroy()
            except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
                failed.append(error)

        thread = threads.start(destroy, name=f"owner_reduce close: ncclCommDestroy ({self.role} communicator)",
                               device=self.device)
        thread.join(self.deadline.allowed_s(started))
        if thread.is_alive():
            raise deadlines.OwnerReduceCommError(
                rank=self.global_rank, dp_rank=self.dp_rank, flush=None,
                call=f"close: ncclCommDestroy{self.where}", waited_s=time.monotonic() - started,
                deadline=self.deadline, reason="has not returned (its frees wait for every kernel on the GPU, and a "
                                               "kernel outside owner_reduce never finished)")
        if failed:
            raise binding.failure("communicator destroy" + self.where, self._failed_on(), failed[0]) from failed[0]

    @contextlib.contextmanager
    def group(self, flush: int | None = None) -> Iterator[None]:
        """As ``ReduceComm.group``; when anything raises inside it, the group is ended, then this rank aborts the
        communicator, so it never leaves its peers inside a half-issued group, and the first error is the one
        raised (see Note (abort inside a group))."""
        try:
            with super().group(flush):
                yield
        except BaseException as error:
            self._abort_noting(error)  # the base class has ended the group by now
            raise

    def async_error(self) -> str | None:
        comm = self._comm
        if comm is None:
            return None
        try:
            comm.check_async_error()  # ncclCommGetAsyncError: raises NcclError for an asynchronous failure
        except Exception as error:  # noqa: BLE001 - reported through the wait's error
            return f"{type(error).__name__}: {error}"
        return None

    def _abort(self) -> None:
        """ncclCommAbort of this communicator alone, at most once; inside an open group only asked for."""
        abort = self.take_for_abort()
        if abort is not None:
            abort()

    def take_for_abort(self) -> Callable[[], Any] | None:
        """Claim the handle (``watch_protocol.Watched.take_for_abort``): its ``ncclCommAbort`` (which returns without
        waiting for peers, after this communicator's last kernel; cupy then forgets the handle), at most once. Inside an
        open group nothing is taken: the abort is only asked for, and done when the group has ended (Note (abort inside
        a group))."""
        if self._group_open:
            self._abort_pending = True
            return None
        comm, self._comm = self._comm, None
        # Nothing waits for an aborted communicator's work any more, but its events stay alive until ``close``:
        # Note (events outlive the aborts).
        self._retired += self._issued
        self._issued.clear()
        if comm is None:
            return None
        binding.forget_open(comm)
        self.aborted = True
        return comm.abort

    def _abort_noting(self, error: BaseException) -> None:
        """Abort every communicator of the family on the way out of ``error`` (at once: ``watchdog``), or, inside an
        open group, ask for it when the group ends (Note (abort inside a group)); if an abort fails too, that is a
        note on ``error``, not the error."""
        if self._group_open:
            self._abort_pending = True
            return
        try:
            self.watchdog.abort_all()
        except Exception as abort_error:  # noqa: BLE001 - the first error is the one to report
            deadlines.add_note(error, "aborting the NCCL communicator failed too", abort_error)

    # ---- group hooks ---------------------------------------------------------------------------------------

    def _group_start(self) -> None:
        """The group holds the watchdog's guard from here to its end (``watchdog`` Note (guard)); once the watchdog has
        aborted the communicators, its error is raised here instead."""
        self._calls_in_group = 0
        self._wait_current(self._stream())
        watchdog = self.watchdog
        watchdog.enter(self)
        try:
            binding.nccl_module().groupStart()
        except Exception as error:  # noqa: BLE001 - no group is open: the guard goes, then every communicator aborts
            watchdog.leave()
            raised = binding.failure("groupStart" + self.where, self._failed_on(), error)
            self._abort_noting(raised)
            raise raised from error
        self._group_open = True

    def _group_end(self) -> None:
        calls, self._calls_in_group = self._calls_in_group, 0
        pending, self._abort_pending = self._abort_pending, False
        self._group_open = False
        watchdog = self.watchdog
        self._issued_at = watchdog.calling("ncclGroupEnd")  # the group's kernels are launched here
        try:
            binding.nccl_module().groupEnd()
        except Exception as error:  # noqa: BLE001 - the group is ended by then: the guard goes, then the aborts
            watchdog.leave()
            raised = binding.failure(f"groupEnd ({calls} calls){self.where}", self._failed_on(), error)
            self._abort_noting(raised)
            raise raised from error
        watchdog.leave()
        if pending:  # a call failed inside the group and its error was swallowed there: abort now
            self._abort_now()
        stream = self._stream()
        if calls and self._first_call is not None:
            self._issued_on(stream, self._first_call, calls, self._issued_at)
        self._first_call = None
        self._current_waits_for(stream)

    def _group_failed(self, error: BaseException) -> None:
        """End the NCCL group after a failure inside it; ``group()`` aborts next. A failing ``ncclGroupEnd`` (NCCL
        reports a failed enqueue again there) raises here and becomes a note on ``error``."""
        self._calls_in_group = 0
        self._first_call = None
        self._abort_pending = False  # group() aborts anyway
        if self._group_open:
            self.watchdog.calling("ncclGroupEnd")
            try:
                binding.nccl_module().groupEnd()
            finally:
                self._group_open = False
                self.watchdog.leave()

    def _abort_now(self) -> None:
        """The abort a failure inside the group asked for, now that the guard is released: every communicator; a
        failing abort is not the error (the call's is being raised)."""
        try:
            self.watchdog.abort_all()
        except Exception:  # noqa: BLE001, S110 - the call's error is the one to report
            pass

    # ---- helpers -------------------------------------------------------------------------------------------

    def _stream(self) -> torch.cuda.Stream:
        return self.stream if self.stream is not None else torch.cuda.current_stream(self.device)

    def _wait_current(self, stream: torch.cuda.Stream) -> None:
        if self.stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def _current_waits_for(self, stream: torch.cuda.Stream) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _live(self, what: str) -> Any:
        if self._comm is None:
            self.watchdog.raise_if_failed()  # aborted by the flush watchdog: its error
            state = "was aborted after an earlier failure" if self.aborted else "is closed"
            raise RuntimeError(f"owner_reduce NCCL {what}{self.where} on {self.who()}: the communicator {state}")
        return self._comm

    def _view_of(self, base: torch.Tensor, what: str) -> _BufferView:
        """The DLPack view of ``base`` (made and checked on first use)."""
        view = self._views.get(id(base))
        if view is not None:
            return view
        if base.device.type != "cuda" or base.device.index != self.device:
            raise ValueError(f"owner_reduce NCCL {what}: buffer on {base.device}, communicator on cuda:{self.device}")
        dtype = binding.nccl_dtype(base.dtype)
        try:
            # As bytes: cupy has no bfloat16, and NCCL takes its data type from the torch dtype anyway. The capsule
            # asks for no stream synchronization: see Note (DLPack views).
            array = self._cupy.from_dlpack(base.detach().view(torch.uint8).__dlpack__(stream=-1))
        except Exception as error:  # noqa: BLE001 - named with the call and rank
            raise binding.failure(f"{what}{self.where}: DLPack view of the buffer", self._failed_on(), error) from error
        if array.device.id != self.device:
            raise ValueError(f"owner_reduce NCCL {what}: DLPack view on cuda:{array.device.id}, "
                             f"communicator on cuda:{self.device}")
        view = _BufferView(base, array, int(array.data.ptr), base.element_size(), base.storage_offset(), dtype)
        self._views[id(base)] = view
        return view

    def _collective(self, buf: torch.Tensor, name: str, label: str | None, value: int,
                    issue: Callable[..., None]) -> None:
        """Check, then issue ``name`` in place on ``buf`` (SUM); ``label``/``value`` are its other argument (``root``,
        ``per_rank``, ``peer``; None for none), formatted only for an error."""
        count = buf.numel()
        base = buf._base if buf._base is not None else buf
        view = self._views.get(id(base))
        if view is None or not buf.is_contiguous() or buf.dtype != base.dtype:
            what = self._call_text((name, label, value, count, buf.dtype))
            if not buf.is_contiguous():
                raise ValueError(f"owner_reduce NCCL {what}: buffer must be contiguous (shape {tuple(buf.shape)}, "
                                 f"stride {buf.stride()})")
            if buf.dtype != base.dtype:
                raise ValueError(f"owner_reduce NCCL {what}: a {binding.dtype_name(buf.dtype)} view of a "
                                 f"{binding.dtype_name(base.dtype)} buffer")
            view = self._view_of(base, what)
        if count == 0:
            return  # every rank skips it alike: counts come from the same plan everywhere
        ptr = view.ptr + (buf.storage_offset() - view.storage_offset) * view.itemsize
        stream = self._stream()
        if self.stream is not None:
            buf.record_stream(stream)
        if not self.in_group:
            self._wait_current(stream)
        comm = self._comm
        call = (name, label, value, count, buf.dtype)
        if comm is None:
            self._live(self._call_text(call))
        self._call_lazy(call, lambda: issue(comm, ptr, count, view.nccl_dtype, self._sum, stream.cuda_stream))
        if self.in_group:
            if not self._calls_in_group:
                self._first_call = call
            self._calls_in_group += 1
        else:
            self._issued_on(stream, call, 1, time.monotonic())
            self._current_waits_for(stream)

    def _call_text(self, call: tuple[str, str | None, int, int, torch.dtype]) -> str:
        """``reduce(root=1 = data-parallel rank 3, count=8, dtype=bfloat16)`` (``comm`` Note (names))."""
        name, label, value, count, dtype = call
        shown = self.peer_name(value) if label in ("root", "peer") else str(value)
        return (f"{name}({'' if label is None else f'{label}={shown}, '}count={count}, "
                f"dtype={binding.dtype_name(dtype)})")

    def _failed_on(self) -> str:
        """``rank 5, flush #3`` or ``rank 5 (data-parallel rank 2), outside a flush``: where a call failed."""
        return f"{self.who()}, {'outside a flush' if self.flush is None else f'flush #{self.flush}'}"

    def _call_lazy(self, call: tuple[str, str | None, int, int, torch.dtype], fn: Callable[[], Any]) -> Any:
        """``_call`` whose description is formatted only when the call fails (the hot path formats nothing, and inside
        the open group, which holds the guard, adds nothing to the call)."""
        if not self._group_open:
            return self._guarded(lambda: self._call_text(call), fn)
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - NcclError, CUDARuntimeError: re-raised with rank and call
            raised = binding.failure(self._call_text(call) + self.where, self._failed_on(), error)
            self._abort_noting(raised)  # peers wait in the failed call: stop this rank's side (after the group)
            raise raised from error

    # ---- in flight: Note (in flight); what the watchdog reads (``watch_protocol.Watched``) --------------------

    def _issued_on(self, stream: torch.cuda.Stream, first: tuple[str, str | None, int, int, torch.dtype],
                   calls: int, issued_at: float) -> None:
        """Record that a group (or one call) was issued on ``stream``: an event after it, reused once it completed; the
        flush watchdog watches it from then on."""
        event = self._free_events.pop() if self._free_events else self._make_event()
        event.record(stream)
        self._issued.append(_IssuedGroup(event, self.flush, first, calls, issued_at))
        if not self.watchdog.armed:  # after the append: see ``FlushWatchdog._run``
            self.watchdog.arm()

    def watched(self) -> Sequence[Any]:
        return self._issued[:]

    def entry_done(self, entry: Any) -> bool:
        return bool(entry.event.query())

    def entry_watched(self, entry: Any) -> bool:
        """Note (firing): events are reused, but only after ``works_done`` dropped their group from ``_issued``, so a
        group still there after its event said "not done" was not done when it said so."""
        return any(g is entry for g in self._issued)

    def entry_name(self, entry: Any) -> tuple[int | None, str]:
        return entry.flush, self._call_text(entry.first) + ("" if entry.calls == 1 else f" (call 1 of {entry.calls})")

    def works_done(self) -> bool:
        issued = self._issued
        done = 0
        for group in issued:
            if not group.event.query():
                break
            done += 1
        if done:
            self._free_events += [g.event for g in issued[:done]]
            del issued[:done]
        return not issued

    def first_unfinished(self) -> tuple[int | None, str] | None:
        pending = next((g for g in self._issued if not g.event.query()), None)
        if pending is None:
            return None
        return pending.flush, self._call_text(pending.first) + ("" if pending.calls == 1 else
                                                                 f" (call 1 of {pending.calls})")

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        return self._guarded(lambda: what, fn)

    def _guarded(self, what: Callable[[], str], fn: Callable[[], Any]) -> Any:
        """Run the NCCL call ``fn`` holding the watchdog's guard (inside an open group the group holds it); on failure
        raise its error naming it (``what()``), after aborting every communicator (or asking for it, in a group)."""
        guarded = not self._group_open
        if guarded:
            self.watchdog.enter(self)
            self.watchdog.calling("an NCCL call outside a group")
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - NcclError, CUDARuntimeError: re-raised with rank and call
            raised = binding.failure(what() + self.where, self._failed_on(), error)
            if guarded:
                guarded = False
                self.watchdog.leave()
            self._abort_noting(raised)  # peers wait in the failed call: stop this rank's side (after the group)
            raise raised from error
        finally:
            if guarded:
                self.watchdog.leave()
