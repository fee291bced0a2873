"""Per-dtype reduce buckets with double buffering, as DeepCompile's ``DoubleBufferedReduceBucket``.

Why two buffers per dtype: while one bucket's reduction is in flight, gradients of the next flush are
copied into the other. Note (buffer lifetime): a bucket is reused only after ``swap()``; on a device with
streams the caller records an event for the flush before swapping and waits on it before the next copy
into that buffer.

Note (size): a bucket holds min(``reduce_bucket_size``, the elements of every registered gradient of its dtype):
DeepSpeed's default of 5e8 elements would otherwise be 2 GB of bf16 for GPT-2's 248 MB of gradients. A
gradient larger than that still fits (``reserve``). Buckets are allocated once and kept across steps until
``clear()`` (the native runtime's ``release_reduce_buckets``). Note (CPU): no shadow buffer; nothing overlaps
a flush there, so a second buffer would only cost memory.

Note (views): ``views`` keeps, per scheduled flush, the views of this bucket's buffer that each gradient is copied
into, and per flush plan the views its copy-out reads (made at first use), so that a step makes none; they live and
die with the buffer (``reserve`` drops them). Each entry holds the object it is keyed by the id of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ReduceBucket:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size = int(size)
        self.dtype = dtype
        self.device = device
        self.buffer = torch.empty(self.size, dtype=dtype, device=device)
        self.offset = 0
        self.free_event: object | None = None  # CUDA: recorded on the reduce stream when a flush released it
        self.views: dict[int, tuple[Any, Any]] = {}  # id(flush or plan) -> (it, its views): see Note (views)

    def should_flush(self, numel: int) -> bool:
        return self.offset > 0 and self.offset + numel > self.size

    def reserve(self, numel: int) -> None:
        """Grow an empty bucket so one oversized gradient fits (the native runtime does the same)."""
        if numel > self.size:
            if self.offset:
                raise RuntimeError("owner_reduce: cannot grow a reduce bucket that holds gradients")
            self.buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.size = numel
            self.views.clear()

    def allocate(self, numel: int) -> tuple[int, torch.Tensor]:
        if self.offset + numel > self.size:
            raise RuntimeError(f"owner_reduce: {numel} elements exceed the reduce bucket ({self.offset}/{self.size})")
        start = self.offset
        self.offset += numel
        return start, self.buffer.narrow(0, start, numel)

    def reset(self) -> None:
        self.offset = 0


class DoubleBufferedBuckets:
    def __init__(self, size: int, double_buffer: bool,
                 registered_elems: Callable[[torch.dtype], int | None] | None = None) -> None:
        self.size = int(size)
        self.double_buffer = double_buffer
        self._registered_elems = registered_elems  # dtype -> elements of the registered gradients (None: unknown)
        self._current: dict[torch.dtype, ReduceBucket] = {}
        self._shadow: dict[torch.dtype, ReduceBucket] = {}

    def size_for(self, dtype: torch.dtype) -> int:
        """min(reduce_bucket_size, registered gradient elements of ``dtype``)."""
        registered = self._registered_elems(dtype) if self._registered_elems is not None else None
        return min(self.size, registered) if registered else self.size

    def get(self, dtype: torch.dtype, device: torch.device) -> ReduceBucket:
        bucket = self._current.get(dtype)
        if bucket is None:
            size = self.size_for(dtype)
            bucket = self._current[dtype] = ReduceBucket(size, dtype, device)
            if self.double_buffer and device.type != "cpu":
                self._shadow[dtype] = ReduceBucket(size, dtype, device)
        return bucket

    def for_tensor(self, tensor: torch.Tensor) -> ReduceBucket:
        """The current bucket for ``tensor``'s dtype (the hot path: one dict lookup once it exists)."""
        bucket = self._current.get(tensor.dtype)
        return bucket if bucket is not None else self.get(tensor.dtype, tensor.device)

    def current(self, dtype: torch.dtype) -> ReduceBucket:
        return self._current[dtype]

    def swap(self, dtype: torch.dtype) -> None:
        self._current[dtype].reset()
        if dtype in self._shadow:
            self._current[dtype], self._shadow[dtype] = self._shadow[dtype], self._current[dtype]

    def clear(self) -> None:
        self._current.clear()
        self._shadow.clear()
