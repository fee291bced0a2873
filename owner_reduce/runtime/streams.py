"""Stream discipline for the reduce path: gradients are copied on the compute stream, reduced on a side stream.

Why not z1.cpp's copy stream: a copy on a side stream costs, per gradient, a stream wait, a stream switch, an
event and a ``record_stream``, each a Python call (with them a reduce_grad took 43-63 µs of host time on an H200
host, against 8.6 µs on the CPU path and 5-15 µs for native C++). The copy itself is a few microseconds of HBM time
against a compute-bound backward, so it runs where the gradient was made, on the current (compute) stream, and
only the flush hands over to the reduce stream: per gradient one copy and no stream or event call; per flush one
stream wait, one stream switch and one event.

Note (copy): the copy into the bucket is enqueued on the current stream right after the gradient's producer, so
it reads the gradient before anything later on that stream can reuse its memory (the caching allocator's stream
order, and inductor reusing a graph buffer in place): no ``record_stream`` and no reference kept.
Note (reduce): at a flush the reduce stream waits for the current stream (every copy of the bucket is behind it);
pre-division, the collectives (issued under ``torch.cuda.stream(reduce)``, they run on it) and the copy-out run
on the reduce stream.
Note (bucket reuse): after a flush the bucket records a "free" event on the reduce stream; before the first copy
into that bucket again, the current stream waits for it (once per bucket fill, not per gradient). A bucket whose
buffer must grow first drains the reduce stream on the host, which frees the old buffer safely (the caching
allocator hands a freed block to the next allocation on the stream it was allocated on, the current one); buffers
grow only in the first step that needs it (``buckets`` Note (growth)).
Note (two levels): a two-level flush (``planning.two_level``) runs its node ReduceScatters on a node stream and its
rail Reduces on a rail stream, both entered from the reduce stream: the node stream waits for the reduce stream once
(pre-division and padding are behind it), each node stage records an event that the rail stream waits for before
that stage's rail calls (stage ``k``'s rail step reads only what node step ``k`` wrote, so node step ``k + 1`` runs
meanwhile; one event serves every stage and flush: a wait takes the event's last record when it is enqueued, and
each record is waited for at once), and at the end the reduce stream waits for both, so the copy-out, the bucket's
free event and every host wait on the reduce stream cover them (the buckets are released or grown only after such a
wait). No host wait in between. The GPU must run both levels' kernels at once (different communicators on different
streams): NCCL's kernels take one block per channel, far from a GPU's SMs.
Note (priority): the reduce stream is high priority, as z1.cpp's ``getStreamFromPool(true)``: the reduction should
not queue behind the backward kernels it overlaps.
Note (optimizer): ``end_backward`` waits for the reduce stream, so the grad buffers are final before step().
Note (bounded waits): ``synchronize(wait)`` hands the reduce stream's ``query`` to ``wait`` (the communicator's
``wait_until``), which polls it within the deadline and aborts the communicator on failure; a plain
``synchronize()`` would hang forever on an NCCL kernel whose peer stalled.
Note (seam): ``CudaStreams`` reaches CUDA only through its ``cuda`` argument (``torch.cuda`` by default) and copies
only through ``copy``, so a CPU test counts what the hot path asks of CUDA (``tests/test_cuda_calls.py``), and
another proves the notes above by happens-before: every tensor access of the runtime stamped with its stream, the
waits as vector clocks, any unordered pair of accesses a race (``tests/hb_cuda.py``, ``tests/test_stream_hb.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_HIGH_PRIORITY = -(1 << 10)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class HostStreams:
    """CPU: copies and collectives complete before the call returns."""

    copy = staticmethod(_copy)

    def bucket_acquired(self, bucket: Any) -> None:
        pass

    @contextlib.contextmanager
    def reducing(self) -> Iterator[None]:
        yield

    def bucket_released(self, bucket: Any) -> None:
        pass

    def synchronize(self, wait: Callable[[Callable[[], bool]], None] | None = None) -> None:
        pass

    def levels_begin(self) -> None:
        pass

    @contextlib.contextmanager
    def level(self, name: str) -> Iterator[None]:
        yield

    def node_stage_done(self) -> None:
        pass

    def levels_end(self) -> None:
        pass

    @staticmethod
    def mark() -> float:
        """A point in the flush's work (``trial`` Note (timing)): the wall clock, the work being synchronous."""
        return time.perf_counter()

    @staticmethod
    def elapsed_us(start: float, end: float) -> float:
        return (end - start) * 1e6


class CudaStreams:
    copy = staticmethod(_copy)  # on the current stream: see Note (copy)

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device = device
        self._cuda = cuda
        # The highest priority the device has (torch clamps a value beyond the range to its end).
        self.reduce_stream = cuda.Stream(device, priority=_HIGH_PRIORITY)
        self._levels: dict[str, Any] = {}  # "node" / "rail" -> its stream, made by the first two-level flush
        self._stage_event: Any = None  # recorded after every node stage: see Note (two levels)

    def bucket_acquired(self, bucket: Any) -> None:
        """Before the first copy into ``bucket`` since its last flush: the current stream waits for that flush."""
        event = bucket.free_event
        if event is not None:
            self._cuda.current_stream(self.device).wait_event(event)
            bucket.free_event = None

    @contextlib.contextmanager
    def reducing(self) -> Iterator[None]:
        stream = self.reduce_stream
        stream.wait_stream(self._cuda.current_stream(self.device))
        with self._cuda.stream(stream):
            yield

    def bucket_released(self, bucket: Any) -> None:
        event = self._cuda.Event()
        event.record(self.reduce_stream)
        bucket.free_event = event

    def synchronize(self, wait: Callable[[Callable[[], bool]], None] | None = None) -> None:
        if wait is None:
            self.reduce_stream.synchronize()
        else:
            wait(self.reduce_stream.query)

    def levels_begin(self) -> None:
        """Inside ``reducing()``, before a two-level flush's first stage: see Note (two levels)."""
        if not self._levels:
            self._levels = {name: self._cuda.Stream(self.device, priority=_HIGH_PRIORITY) for name in ("node", "rail")}
        self._levels["node"].wait_stream(self.reduce_stream)

    @contextlib.contextmanager
    def level(self, name: str) -> Iterator[None]:
        with self._cuda.stream(self._levels[name]):
            yield

    def node_stage_done(self) -> None:
        """The rail stream waits for the node stage just issued (and nothing later), through the one stage event: see
        Note (two levels)."""
        event = self._stage_event
        if event is None:
            event = self._stage_event = self._cuda.Event()
        event.record(self._levels["node"])
        self._levels["rail"].wait_event(event)

    def levels_end(self) -> None:
        self.reduce_stream.wait_stream(self._levels["node"])
        self.reduce_stream.wait_stream(self._levels["rail"])

    def mark(self) -> Any:
        """A point in the flush's work (``trial`` Note (timing)): a timing event on the reduce stream."""
        event = self._cuda.Event(enable_timing=True)
        event.record(self.reduce_stream)
        return event

    @staticmethod
    def elapsed_us(start: Any, end: Any) -> float:
        """After the reduce stream was waited: the time between two marks on it."""
        return start.elapsed_time(end) * 1000.0


def make_streams(device: torch.device) -> HostStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()
