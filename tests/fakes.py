"""In-process stand-ins for the communicator seam (no processes): unit tests of the runtime's bookkeeping."""

from __future__ import annotations

import torch

from owner_reduce.runtime.comm import ReduceComm


class MirrorComm(ReduceComm):
    """Rank ``rank`` of ``world_size`` ranks that all hold the same data: a SUM multiplies by world_size.

    Where this rank is not the root of a reduce, the result is undefined, so it is filled with NaN: any copy
    of a value that never reached this rank shows up as NaN in the grad buffers.
    """

    name = "mirror"

    def __init__(self, rank: int = 0, world_size: int = 2, fail_on_call: int | None = None) -> None:
        super().__init__(rank, world_size)
        self.calls: list[tuple[str, int | None, int]] = []
        self.groups = 0
        self.open_groups = 0
        self.fail_on_call = fail_on_call
        self.gathered_rows: list[list[int]] | None = None
        self.buffer_releases = 0

    def _group_start(self) -> None:
        self.groups += 1
        self.open_groups += 1

    def _group_end(self) -> None:
        self.open_groups -= 1

    def _maybe_fail(self) -> None:
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("injected collective failure")

    def reduce(self, buf: torch.Tensor, root: int) -> None:
        self._maybe_fail()
        self.calls.append(("reduce", root, buf.numel()))
        if root == self.rank:
            buf.mul_(self.world_size)
        else:
            buf.fill_(float("nan"))

    def all_reduce(self, buf: torch.Tensor) -> None:
        self._maybe_fail()
        self.calls.append(("all_reduce", None, buf.numel()))
        buf.mul_(self.world_size)

    def reduce_scatter(self, buf: torch.Tensor, per_rank: int) -> None:
        self._check_scatter(buf, per_rank)
        self._maybe_fail()
        self.calls.append(("reduce_scatter", None, buf.numel()))
        start = self.rank * per_rank
        buf.narrow(0, start, per_rank).mul_(self.world_size)
        buf.narrow(0, 0, start).fill_(float("nan"))  # the other blocks never reach this rank
        buf.narrow(0, start + per_rank, buf.numel() - start - per_rank).fill_(float("nan"))

    def release_buffers(self) -> None:
        self.buffer_releases += 1

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return self.gathered_rows if self.gathered_rows is not None else [list(values)] * self.world_size
