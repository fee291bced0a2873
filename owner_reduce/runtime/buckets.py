"""Per-dtype reduce buckets with double buffering, as DeepCompile's ``DoubleBufferedReduceBucket``.

Why two buffers per dtype: while one bucket's reduction is in flight, gradients of the next flush are
copied into the other. Note (buffer lifetime): a bucket is reused only after ``swap()``; on a device with
streams the caller records an event for the flush before swapping and waits on it before the next copy
into that buffer.

Note (size): a bucket holds min(``reduce_bucket_size``, the elements of every registered gradient of its dtype):
DeepSpeed's default of 5e8 elements would otherwise be 2 GB of bf16 for GPT-2's 248 MB of gradients. Buckets are
allocated once and kept across steps until ``release()`` (the native runtime's ``release_reduce_buckets``). Note
(CPU): no shadow buffer; nothing overlaps a flush there, so a second buffer would only cost memory.

Note (growth): a bucket's ``size`` is where an arrival-order bucket flushes, as DeepCompile's: a gradient larger than
it raises it for that bucket (``reserve``) until the buckets are released, so arrival-order flushes end where the
native runtime's do. Its buffer's ``capacity`` may be larger: an owner-ordered flush spans its padding too, and an
oversized gradient needs room. Replacing a buffer needs a host wait (a flush in flight may still read the old one),
so ``grow`` replaces both buffers of the dtype's pair at once (after one wait, neither is in use) and the capacity is
remembered per dtype across ``release()``: the pair allocated after a release already has it, and a steady-state
step grows nothing and waits for nothing. The cost: with a gradient larger than the bucket, both buffers hold it
(the native runtime grows one, and frees and grows it again after every release).

Note (alignment): a scheduled layout starts every NCCL call at a bucket offset that is a multiple of 16 bytes
(``planning.alignment``), so a call's pointer is 16-byte aligned exactly when the buffer's first element is. Each
buffer here (and the staging buffer) is its own ``torch.empty`` of the whole capacity, never a view into another
tensor, so its first element is the start of an allocation: on CUDA a block of torch's caching allocator, whose
blocks are carved out of ``cudaMalloc`` segments (256-byte aligned) at multiples of 512 bytes (``kMinBlockSize``,
c10/core/AllocatorConfig.h), so at least 256-byte aligned; on CPU, c10's allocator aligns to 64 bytes (``gAlignment``,
c10/core/alignment.h). A buffer must stay so: never narrow, offset or share it.

Note (views): ``views`` keeps, per scheduled flush, the views of this bucket's buffer that each gradient is copied
into, and per flush plan the views its copy-out reads (made at first use), so that a step makes none; they live and
die with the buffer (``reserve`` drops them). Each entry holds the object it is keyed by the id of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ReduceBucket:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, capacity: int = 0) -> None:
        self.size = int(size)  # where an arrival-order bucket flushes: see Note (growth)
        self.dtype = dtype
        self.device = device
        self.capacity = max(self.size, int(capacity))  # the buffer's elements (>= size)
        self.buffer = torch.empty(self.capacity, dtype=dtype, device=device)
        self.offset = 0
        self.free_event: object | None = None  # CUDA: recorded on the reduce stream when a flush released it
        self.views: dict[int, tuple[Any, Any]] = {}  # id(flush or plan) -> (it, its views): see Note (views)
        self.staging: torch.Tensor | None = None  # see Note (staging) in flush.py

    def staging_for(self, numel: int) -> tuple[torch.Tensor, bool]:
        """A buffer of at least ``numel`` elements beside this bucket's, kept with it (and whether it is new: the
        views of an old one are dropped). Written and read on the reduce stream only, under the bucket's own
        lifetime rule (Note (buffer lifetime)), so replacing it never races a flush of this bucket."""
        if self.staging is not None and self.staging.numel() >= numel:
            return self.staging, False
        self.staging = torch.empty(numel, dtype=self.dtype, device=self.device)
        self.views.clear()
        return self.staging, True

    def should_flush(self, numel: int) -> bool:
        return self.offset > 0 and self.offset + numel > self.size

    def reserve(self, numel: int) -> None:
        """Raise an empty bucket's size so one oversized gradient fits (the native runtime does the same); the
        buffer must hold it already (``DoubleBufferedBuckets.grow``)."""
        if numel > self.size:
            if self.offset:
                raise RuntimeError(f"owner_reduce: cannot grow a {self.dtype} reduce bucket that holds gradients "
                                   f"({self.offset}/{self.size}) to {numel} elements")
            if numel > self.capacity:
                raise RuntimeError(f"owner_reduce: a {self.dtype} reduce bucket of {self.capacity} elements cannot "
                                   f"take a {numel}-element gradient before its buffer grows")
            self.size = numel

    def replace_buffer(self, capacity: int) -> None:
        """A larger buffer (the caller made sure that no flush still reads this one); the views die with the old."""
        self.buffer = torch.empty(capacity, dtype=self.dtype, device=self.device)
        self.capacity = capacity
        self.views.clear()
        self.staging = None

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
        self._capacity: dict[torch.dtype, int] = {}  # kept across release(): see Note (growth)
        self.double_on_host = False  # tests: a fake-CUDA run on CPU tensors double-buffers as a GPU does

    def size_for(self, dtype: torch.dtype) -> int:
        """min(reduce_bucket_size, registered gradient elements of ``dtype``)."""
        registered = self._registered_elems(dtype) if self._registered_elems is not None else None
        return min(self.size, registered) if registered else self.size

    def capacity_for(self, dtype: torch.dtype) -> int:
        """The elements every buffer of ``dtype`` holds at least, allocated or not (Note (growth))."""
        return max(self.size_for(dtype), self._capacity.get(dtype, 0))

    def get(self, dtype: torch.dtype, device: torch.device) -> ReduceBucket:
        bucket = self._current.get(dtype)
        if bucket is None:
            size, capacity = self.size_for(dtype), self._capacity.get(dtype, 0)
            bucket = self._current[dtype] = ReduceBucket(size, dtype, device, capacity)
            if self.double_buffer and (device.type != "cpu" or self.double_on_host):
                self._shadow[dtype] = ReduceBucket(size, dtype, device, capacity)
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

    def grow(self, dtype: torch.dtype, numel: int) -> None:
        """Both buffers of ``dtype``'s pair hold at least ``numel`` elements from now on, also after a release. The
        caller has waited for the reduce stream: a replaced buffer may have been read by a flush in flight."""
        if numel > self._capacity.get(dtype, 0):
            self._capacity[dtype] = numel
        for bucket in (self._current.get(dtype), self._shadow.get(dtype)):
            if bucket is not None and bucket.capacity < numel:
                bucket.replace_buffer(numel)

    def release(self) -> None:
        """Free the buffers (the next flush allocates again, as the native runtime's ``release_reduce_buckets``);
        the capacity they grew to is kept."""
        self._current.clear()
        self._shadow.clear()

    def clear(self) -> None:
        """Free the buffers and forget their growth (cleanup)."""
        self.release()
        self._capacity.clear()
