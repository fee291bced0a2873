"""The collective seam: the few calls a flush makes, behind one small interface.

Why a seam: the flush logic must not care whether bytes move through gloo on CPU, torch's NCCL process
group, or a cupy NCCL communicator on a side stream. Each implementation provides ``group()`` (a context
that batches the calls and always closes, also when a call raises), ``reduce(buf, root)``,
``all_reduce(buf)`` and ``reduce_scatter(buf, per_rank)``; ``root`` is a rank of the data-parallel
communicator, not a global rank.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch


class ReduceComm(ABC):
    """SUM-reductions over the data-parallel communicator (pre-division is the caller's job)."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._in_group = False

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Batch the calls of one flush; closed in ``finally`` so an error never leaves a group open."""
        if self._in_group:
            raise RuntimeError(f"{self.name}: nested collective group on rank {self.rank}")
        self._in_group = True
        self._group_start()
        try:
            yield
        finally:
            self._in_group = False
            self._group_end()

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
    here runs with the Python dispatcher off: once for a whole group, or around a single call outside one.

    Note (per-call cost): the group, the global rank of every root and the SUM op are resolved once; the calls
    go to ``torch.distributed`` directly (the process group is DeepSpeed's; ``deepspeed.comm``'s wrappers add
    about 14 µs per call, and the flush issues one call per owner run).
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

    def _group_start(self) -> None:
        self._no_dispatcher = _no_python_dispatcher()
        self._no_dispatcher.__enter__()

    def _group_end(self) -> None:
        context, self._no_dispatcher = self._no_dispatcher, None
        if context is not None:
            context.__exit__(None, None, None)

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        if self._in_group:
            self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group)
            return
        with _no_python_dispatcher():
            self._tdist.reduce(buf, dst=self._global_rank[root], op=self._sum, group=self._group)

    def all_reduce(self, buf: torch.Tensor) -> None:
        if self._in_group:
            self._tdist.all_reduce(buf, op=self._sum, group=self._group)
            return
        with _no_python_dispatcher():
            self._tdist.all_reduce(buf, op=self._sum, group=self._group)

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        """One ``reduce_scatter_tensor`` (gloo in torch 2.13 and NCCL both have it), in place: the output is this
        rank's own block of the input, as ncclReduceScatter allows."""
        self._check_scatter(buf, per_rank)
        out = buf.narrow(0, self.rank * per_rank, per_rank)
        if self._in_group:
            self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group)
            return
        with _no_python_dispatcher():
            self._tdist.reduce_scatter_tensor(out, buf, op=self._sum, group=self._group)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        from deepspeed.accelerator import get_accelerator

        local = torch.tensor(values, dtype=torch.int64, device=get_accelerator().current_device_name())
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        with _no_python_dispatcher():
            self._tdist.all_gather(gathered, local, group=self._group)
        return [g.tolist() for g in gathered]


def _no_python_dispatcher() -> Any:
    from torch._dispatch.python import no_python_dispatcher

    return no_python_dispatcher()
