"""The torch.distributed implementation of the collective seam (``comm.ReduceComm``): DeepSpeed's data-parallel
process group, gloo on CPU and NCCL on GPU. The runtime falls back to it wherever cupy's NCCL cannot run
(``comm_select``), and CPU runs and tests use it throughout; its notes are on ``TorchDistComm``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from . import deadline as deadlines
from .comm import ReduceComm, check_scatter
from .host_memory import pinned


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
        if self.in_group:
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
        if self.in_group:
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
        check_scatter(self, buf, per_rank)
        out = buf.narrow(0, self.rank * per_rank, per_rank)
        call = _Call("reduce_scatter", None, buf.numel(), buf.dtype, buf.is_cuda)
        if self.in_group:
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
        if self.in_group:
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

    # ---- waiting, and what the watchdog reads (``watch_protocol.Watched``) ------------------------------------

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

    def works_done(self) -> bool:
        """Forget the works in flight that completed (in issue order); True when none is left. A work that failed
        stays, for ``async_error`` to report."""
        in_flight = self._in_flight
        done = 0
        for entry in in_flight:
            if not entry.work.is_completed() or entry.work.exception() is not None:
                break
            done += 1
        del in_flight[:done]
        return not in_flight

    def async_error(self) -> str | None:
        """A device work in flight that completed with an error (NCCL's, as torch reports it), named. Also read by the
        flush watchdog's thread: over a snapshot."""
        for entry in self._in_flight[:]:
            if entry.work.is_completed():
                error = entry.work.exception()
                if error is not None:
                    return (f"{_in_flight_name(entry, None, self)}: {type(error).__name__}: "
                            f"{deadlines.first_line(error)}")
        return None

    def first_unfinished(self) -> tuple[int | None, str] | None:
        pending = next((e for e in self._in_flight if not e.work.is_completed() or e.work.exception() is not None),
                       None)
        if pending is None:
            return None
        return pending.flush, _call_name(pending.call, pending.index, pending.calls, self)

    def _abort(self) -> None:
        """After a failed wait on device works: abort the process group (once), so that its NCCL kernels stop."""
        abort = self.take_for_abort()
        if abort is not None:
            abort()

    def take_for_abort(self) -> Callable[[], Any] | None:
        """The process group's ``abort`` (once); torch's own watchdog aborts it from another thread too, so no guard
        is needed around this communicator's calls. The works' CUDA events stay alive until ``close``, on the main
        thread (``nccl_comm`` Note (events outlive the aborts))."""
        self._retired += self._in_flight
        self._in_flight.clear()
        if self.aborted:
            return None
        self.aborted = True
        return getattr(self._group if self._group is not None else self._tdist.group.WORLD, "abort", None)

    def watched(self) -> Sequence[Any]:
        return self._in_flight[:]

    def entry_done(self, entry: Any) -> bool:
        return bool(entry.work.is_completed())

    def entry_watched(self, entry: Any) -> bool:
        return any(e is entry for e in self._in_flight)

    def entry_name(self, entry: Any) -> tuple[int | None, str]:
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


def _no_python_dispatcher() -> Any:
    from torch._dispatch.python import no_python_dispatcher

    return no_python_dispatcher()
