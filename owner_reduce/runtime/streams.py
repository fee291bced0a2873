"""Stream discipline for the reduce path, as in z1.cpp: compute -> copy stream -> reduce stream -> optimizer.

Why: on a GPU the bucket copy, the reduction and the copy-out run on side streams so they overlap the rest of
the backward pass; each hand-over needs an event, and every tensor must outlive the stream work that reads it.
On CPU everything runs synchronously and ``HostStreams`` orders nothing.

Note (copy): the copy stream waits for the compute stream (the gradient is ready, and the bucket's previous
flush has been waited for), copies, and records a per-task event; the source is ``record_stream``-ed on the
copy stream so the allocator cannot hand its memory out before the copy ran.
Note (reduce): the reduce stream waits for every task's copy event; pre-division, the collectives and the
copy-out all run on it (collectives issued under ``torch.cuda.stream(reduce)`` use it as their stream).
Note (bucket reuse): after a flush the bucket records a "free" event on the reduce stream; the compute stream
waits for it before the next copy into that bucket. A bucket that must grow first drains the reduce stream.
Note (priority): both side streams are high priority, as z1.cpp's ``getStreamFromPool(true)``: the reduction
path should not queue behind the backward kernels it overlaps.
Note (optimizer): ``end_backward`` synchronizes the reduce stream, so the grad buffers are final before step().
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_HIGH_PRIORITY = -(1 << 10)


class HostStreams:
    """CPU: copies and collectives complete before the call returns."""

    def copy_into_bucket(self, bucket: Any, view: torch.Tensor, grad: torch.Tensor) -> Any:
        view.copy_(grad if grad.dim() == 1 else grad.reshape(-1))
        return None

    @contextlib.contextmanager
    def reducing(self, copy_events: Sequence[Any]) -> Iterator[None]:
        yield

    def bucket_released(self, bucket: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The highest priority the device has (torch clamps a value beyond the range to its end).
        self.copy_stream = torch.cuda.Stream(device, priority=_HIGH_PRIORITY)
        self.reduce_stream = torch.cuda.Stream(device, priority=_HIGH_PRIORITY)

    def copy_into_bucket(self, bucket: Any, view: torch.Tensor, grad: torch.Tensor) -> torch.cuda.Event:
        compute = torch.cuda.current_stream(self.device)
        free_event = getattr(bucket, "free_event", None)
        if free_event is not None:
            compute.wait_event(free_event)
        source = grad.contiguous().view(-1)
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            view.copy_(source, non_blocking=True)
        source.record_stream(self.copy_stream)
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    @contextlib.contextmanager
    def reducing(self, copy_events: Sequence[Any]) -> Iterator[None]:
        for event in copy_events:
            self.reduce_stream.wait_event(event)
        with torch.cuda.stream(self.reduce_stream):
            yield

    def bucket_released(self, bucket: Any) -> None:
        event = torch.cuda.Event()
        event.record(self.reduce_stream)
        bucket.free_event = event

    def synchronize(self) -> None:
        self.reduce_stream.synchronize()


def make_streams(device: torch.device) -> HostStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()
