"""The collective seam: the few calls a flush makes, behind one small interface.

Why a seam: the flush logic must not care whether bytes move through gloo on CPU, torch's NCCL process
group, or a cupy NCCL communicator on a side stream. Each implementation provides ``group()`` (a context
that batches the calls and always closes, also when a call raises), ``reduce(buf, root)``,
``all_reduce(buf)``, ``reduce_scatter(buf, per_rank)``, and ``send(buf, peer)`` / ``recv(buf, peer)`` for the owner
hand-off (in a group of their own); ``root`` and ``peer`` are ranks of the data-parallel communicator, not global
ranks.

Note (bounded waits): every wait on a collective is bounded by ``self.deadline`` (see ``deadline``) and
fails with ``OwnerReduceCommError`` naming the rank, the flush (``group(flush=n)`` sets it), the call and
the seconds waited; ``wait_until`` is the one place that waits on the device.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import deadline as deadlines


class ReduceComm(ABC):
    """SUM-reductions over the data-parallel communicator (pre-division is the caller's job)."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, deadline: deadlines.Deadline | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._in_group = False
        self.deadline = deadlines.from_environment() if deadline is None else deadline
        self.flush: int | None = None  # the flush being issued or last issued (error messages)

    @contextlib.contextmanager
    def group(self, flush: int | None = None) -> Iterator[None]:
        """Batch the calls of one flush (number ``flush``, for errors); closed in ``finally`` so an error never
        leaves a group open."""
        if self._in_group:
            raise RuntimeError(f"{self.name}: nested collective group on rank {self.rank}")
        if flush is not None:
            self.flush = flush
        self._in_group = True
        self._group_start()
        try:
            yield
        finally:
            self._in_group = False
            self._group_end()

    def wait_until(self, done: Callable[[], bool], call: str, flush: int | None = None) -> None:
        """Poll ``done`` (a CUDA stream's or event's ``query``) within the deadline; on a timeout or an error
        of this communicator, abort it and raise ``OwnerReduceCommError``."""
        deadlines.poll_until_done(done, deadline=self.deadline, rank=self.rank,
                                  flush=self.flush if flush is None else flush, call=call,
                                  check_error=self._async_error, abort=self._abort)

    def _async_error(self) -> str | None:
        """An error the communicator reported asynchronously (NCCL), or None."""
        return None

    def _abort(self) -> None:  # noqa: B027 - optional hook
        """Stop this communicator after a failed wait, without waiting for peers (at most once)."""

    def _group_start(self) -> None:  # noqa: B027 - optional hook
        pass

    def _group_end(self) -> None:  # noqa: B027 - optional hook
        pass

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

    def release_buffers(self) -> None:  # noqa: B027 - optional hook
        """Drop whatever this communicator keeps per buffer (the runtime released its buckets)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the communicator (at cleanup)."""


class TorchDistComm(ReduceComm):
    """Through torch.distributed on DeepSpeed's data-parallel process group: gloo on CPU, NCCL on GPU.

    Note (Python dispatcher): DeepCompile profiles graphs with the Python dispatcher on; a gloo worker whose
    destructor needs the GIL then deadlocks against the main thread (about 1 run in 6 on CPU). Every call
    and every wait here runs with the Python dispatcher off: once for a whole group, or around a single call
    outside one.

    Note (per-call cost): the group, the global rank of every root and the SUM op are resolved once; the calls
    go to ``torch.distributed`` directly (the process group is DeepSpeed's; ``deepspeed.comm``'s wrappers add
    about 14 µs per call, and the flush issues one call per owner run).

    Note (bounded waits): every call is issued with async_op=True and waited with Work.wait(timeout): in a
    group, all of the flush's calls at its end against one deadline; outside a group, at once. A flush
    therefore fails within the deadline when a peer stalls, instead of DeepSpeed's group timeout.

    Note (send/recv): a group's sends and receives are issued together at its end with ``batch_isend_irecv`` (on
    NCCL one grouped launch, so that two ranks sending to each other cannot block each other; on gloo each is
    asynchronous anyway) and waited like every call; gloo's send/recv works honour ``wait(timeout)``.
    """

    name = "torch.distributed"

    def __init__(self, process_group: Any) -> None:
        import deepspeed.comm as dist
        import torch.distributed as tdist

        self._tdist = tdist
        self._group = process_group
        super().__init__(dist.get_rank(group=process_group), dist.get_world_size(group=process_group))
        self._global_rank = [dist.get_global_rank(process_group, r) for r in range(self.world_size)]
        self._sum = tdist.ReduceOp.SUM
        self._no_dispatcher: Any = None
        self._native_scatter = str(tdist.get_backend(process_group)).lower() != "gloo"  # see reduce_scatter
        self._works: list[tuple[Any, tuple[str, int | None, int, torch.dtype]]] = []  # issued, not yet waited for
        self._p2p: list[tuple[Any, tuple[str, int | None, int, torch.dtype]]] = []  # P2POps, issued at group end

    def _group_start(self) -> None:
        self._no_dispatcher = _no_python_dispatcher()
        self._no_dispatcher.__enter__()

    def _group_end(self) -> None:
        works, self._works = self._works, []
        p2p, self._p2p = self._p2p, []
        context, self._no_dispatcher = self._no_dispatcher, None
        try:
            if p2p:
                works += self._issue_p2p(p2p)
            self._wait(works, flush=self.flush)
        finally:
            if context is not None:
                context.__exit__(None, None, None)

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        if self._in_group:
            work = self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group,
                                      async_op=True)
            self._works.append((work, ("reduce", root, buf.numel(), buf.dtype)))
            return
        with _no_python_dispatcher():
            work = self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group,
                                      async_op=True)
            self._wait([(work, ("reduce", root, buf.numel(), buf.dtype))], flush=self.flush)

    def all_reduce(self, buf: torch.Tensor) -> None:
        if self._in_group:
            work = self._tdist.all_reduce(buf, op=self._sum, group=self._group, async_op=True)
            self._works.append((work, ("all_reduce", None, buf.numel(), buf.dtype)))
            return
        with _no_python_dispatcher():
            work = self._tdist.all_reduce(buf, op=self._sum, group=self._group, async_op=True)
            self._wait([(work, ("all_reduce", None, buf.numel(), buf.dtype))], flush=self.flush)

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
        call = ("reduce_scatter", None, buf.numel(), buf.dtype)
        if self._in_group:
            work = self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group, async_op=True)
            self._works.append((work, call))
            return
        with _no_python_dispatcher():
            work = self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group, async_op=True)
            self._wait([(work, call)], flush=self.flush)

    def _issue_p2p(self, p2p: list[tuple[Any, tuple[str, int | None, int, torch.dtype]]]) -> list[Any]:
        """Issue a group's sends and receives together; a failure to issue (gloo: a pair its peer closed) is the one
        error too, naming the round."""
        try:
            issued = self._tdist.batch_isend_irecv([op for op, _ in p2p])
        except Exception as error:  # noqa: BLE001 - gloo and NCCL raise RuntimeError (or DistBackendError)
            raise deadlines.OwnerReduceCommError(
                rank=self.rank, flush=self.flush, call=f"send/recv round ({len(p2p)} operations, first "
                f"{_call_name(p2p[0][1], 0, 1)})", waited_s=0.0, deadline=self.deadline,
                reason=f"failed: {type(error).__name__}: {deadlines.first_line(error)}") from error
        return list(zip(issued, (call for _, call in p2p), strict=True))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._point_to_point(self._tdist.isend, "send", buf, peer)

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._point_to_point(self._tdist.irecv, "recv", buf, peer)

    def _point_to_point(self, fn: Any, name: str, buf: torch.Tensor, peer: int) -> None:
        op = self._tdist.P2POp(fn, buf, self._global_rank[peer], group=self._group)
        call = (name, peer, buf.numel(), buf.dtype)
        if self._in_group:
            self._p2p.append((op, call))
            return
        with _no_python_dispatcher():
            self._wait(self._issue_p2p([(op, call)]), flush=self.flush)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        from deepspeed.accelerator import get_accelerator

        local = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        with _no_python_dispatcher():
            work = self._tdist.all_gather(gathered, local, group=self._group, async_op=True)
            self._wait([(work, ("all_gather", None, local.numel(), local.dtype))], flush=None)
        return [g.tolist() for g in gathered]

    def _wait(self, works: list[tuple[Any, tuple[str, int | None, int, torch.dtype]]], flush: int | None) -> None:
        """Wait for ``works`` in issue order, all within one deadline from now (Python dispatcher already off)."""
        started = time.monotonic()
        for i, (work, call) in enumerate(works):
            if work is None:  # a rank outside the group (not ours: every rank of the group calls)
                continue
            deadlines.wait_work(work, deadline=self.deadline, started=started, rank=self.rank, flush=flush,
                                call=lambda call=call, i=i: _call_name(call, i, len(works)))


def _call_name(call: tuple[str, int | None, int, torch.dtype], index: int, calls: int) -> str:
    """``reduce(root=1, count=143, dtype=float32) (call 1 of 4)``: formatted only for an error."""
    kind, root, count, dtype = call
    who = "" if root is None else f"{'peer' if kind in ('send', 'recv') else 'root'}={root}, "
    name = f"{kind}({who}count={count}, dtype={str(dtype).removeprefix('torch.')})"
    return name if calls == 1 else f"{name} (call {index + 1} of {calls})"


def _no_python_dispatcher() -> Any:
    from torch._dispatch.python import no_python_dispatcher

    return no_python_dispatcher()
