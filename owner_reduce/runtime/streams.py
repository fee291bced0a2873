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
Note (bucket reuse): after a flush the bucket records a "free" event on the stream its flush ended on (the reduce
stream; the rail stream for a two-level flush); before the first copy into that bucket again, the current stream
waits for it (once per bucket fill, not per gradient). A bucket whose
buffer must grow first drains the reduce stream on the host, which frees the old buffer safely (the caching
allocator hands a freed block to the next allocation on the stream it was allocated on, the current one); buffers
grow only in the first step that needs it (``buckets`` Note (growth)).
Note (two levels): a two-level flush (``planning.two_level``) runs on two streams of its own and never on the reduce
stream, so that the levels of consecutive flushes overlap (``planning.step_plan``): flush ``i + 1``'s node step runs
while flush ``i``'s rail step does. Its node stream waits for the current stream (every copy into the bucket is
behind it, and so is the wait for the bucket's free event: Note (bucket reuse)) and for the reduce stream (a
one-level flush before it); padding, pre-division and the node ReduceScatters (or a tail stage's node Reduces) run on
it. Each node stage records an event that the rail stream waits for before that stage's rail calls (stage ``k``'s rail
step reads only what node step ``k`` wrote; one event serves every stage and flush: a wait takes the event's last
record when it is enqueued, and each record is waited for at once). The rail stream keeps issue order: after the last
stage's rail calls it runs the flush's calls on the data-parallel communicator (gradients that reach every rank), the
copy-out and the bucket's free event, so the bucket is reused only after its rail step has read it, and the node
stream of the next flush waits for nothing of this one's rail step. Where DeepSpeed needs the reduced gradients the
reduce stream joins both (``synchronize``: end of backward, bucket growth, cleanup), and a one-level flush's reduce
stream waits for both before its calls (the data-parallel communicator is never used from two streams at once). No
host wait in between. The GPU must run both levels' kernels at once (different communicators on different streams):
NCCL's kernels take one block per channel, far from a GPU's SMs.
Note (node hand-off): a balanced two-level flush (``planning.two_level`` Note (balanced rails)) ends each stage with
a send/recv round inside the node that moves each part, reduced by its rail, to its owner. It runs on the rail
stream, after the stage's rail calls (stream order: it sends what they wrote) and before the flush's copy-out and
free event (the owner copies out what it received), on a node communicator of its own: NCCL orders the calls of one
communicator across the streams they are issued on, so on the node communicator the next flush's node step would
wait for this flush's rail step.
Note (priority): the reduce stream is high priority, as z1.cpp's ``getStreamFromPool(true)``: the reduction should
not queue behind the backward kernels it overlaps.
Note (optimizer): ``end_backward`` waits for the reduce stream, so the grad buffers are final before step().
Note (bounded waits): ``synchronize(wait)`` hands the reduce stream's ``query`` to ``wait`` (the communicator's
``wait_until``), which polls it within the deadline and aborts the communicator on failure; a plain
``synchronize()`` would hang forever on an NCCL kernel whose peer stalled.
Note (seam): ``CudaStreams`` reaches CUDA only through its ``cuda`` argument (``torch.cuda`` by default) and copies
only through ``copy``, so a CPU test counts what the hot path asks of CUDA (``tests/sim/test_cuda_calls.py``), and
another proves the notes above by happens-before: every tensor access of the runtime stamped with its stream, the
waits as vector clocks, any unordered pair of accesses a race (``tests/support/sim/hb_cuda.py``,
``tests/sim/test_stream_hb.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_HIGH_PRIORITY = -(1 << 10)
_STREAM_POOL = 32  # torch's c10/cuda/CUDAStream.cpp kStreamsPerPool: Note (stream pool)


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

    def bucket_released(self, bucket: Any, level: str | None = None, timing: bool = False) -> float | None:
        """The flush's end: the wall clock where ``timing`` asks for a mark (the probe's steps: ``exposure``)."""
        return time.perf_counter() if timing else None

    def synchronize(self, wait: Callable[[Callable[[], bool]], None] | None = None) -> None:
        pass

    @contextlib.contextmanager
    def levels(self) -> Iterator[None]:
        yield

    def _distinct_streams(self, names: tuple[str, ...]) -> dict[str, Any]:
        """A stream for each of ``names``, none of them the reduce stream or another's where the pool allows. Note
        (stream pool): torch's ``Stream()`` hands out the streams of a pool (32 per device and priority) round-robin to
        every user of the process, so two calls may return the same stream; a level on the reduce stream or on the
        other level's stays correct (every wait here is an event or a stream wait, both no-ops on one stream: the
        simulated device runs the two-level flushes with pools of one and two streams), but its stages no longer
        overlap. So the draw goes on, at most a pool's length, until the streams differ."""
        taken = [self.reduce_stream]
        streams: dict[str, Any] = {}
        for name in names:
            stream = self._cuda.Stream(self.device, priority=_HIGH_PRIORITY)
            for _ in range(_STREAM_POOL):
                if all(stream != t for t in taken):  # torch compares the CUDA streams, not the Python objects
                    break
                stream = self._cuda.Stream(self.device, priority=_HIGH_PRIORITY)
            streams[name] = stream
            taken.append(stream)
        return streams

    @contextlib.contextmanager
    def level(self, name: str) -> Iterator[None]:
        yield

    def node_stage_done(self) -> None:
        pass

    def join(self) -> None:
        pass

    @staticmethod
    def mark(level: str | None = None) -> float:
        """A point in the flush's work (``trial`` Note (timing)): the wall clock, the work being synchronous."""
        return time.perf_counter()

    @staticmethod
    def elapsed_us(start: float, end: float) -> float:
        return (end - start) * 1e6

    def step_end_mark(self) -> float:
        return self.mark()

    def compute_mark(self) -> float:
        """Where the backward's compute stands (``exposure`` Note (marks)): the wall clock."""
        return time.perf_counter()

    @staticmethod
    def completed(mark: float) -> bool:
        return True


class CudaStreams:
    copy = staticmethod(_copy)  # on the current stream: see Note (copy)

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device = device
        self._cuda = cuda
        # The highest priority the device has (torch clamps a value beyond the range to its end).
        self.reduce_stream = cuda.Stream(device, priority=_HIGH_PRIORITY)
        self._levels: dict[str, Any] = {}  # "node" / "rail" -> its stream, made by the first two-level flush
        self._stage_event: Any = None  # recorded after every node stage: see Note (two levels)
        self._levels_ahead = False  # a two-level flush was issued since the reduce stream last waited for the levels

    def bucket_acquired(self, bucket: Any) -> None:
        """Before the first copy into ``bucket`` since its last flush: the current stream waits for that flush."""
        event = bucket.free_event
        if event is not None:
            self._cuda.current_stream(self.device).wait_event(event)
            bucket.free_event = None

    @contextlib.contextmanager
    def reducing(self) -> Iterator[None]:
        """A one-level flush: on the reduce stream, after the current stream and any two-level flush before it (Note
        (two levels))."""
        stream = self.reduce_stream
        stream.wait_stream(self._cuda.current_stream(self.device))
        self.join()
        with self._cuda.stream(stream):
            yield

    def bucket_released(self, bucket: Any, level: str | None = None, timing: bool = False) -> Any:
        """The bucket's free event, on the stream its flush ends on: the reduce stream, or a two-level flush's rail
        stream (``level``); a timing event where ``timing`` asks for one (the probe's steps: ``exposure``), which then
        marks the flush's end at no extra call."""
        event = self._cuda.Event(enable_timing=True) if timing else self._cuda.Event()
        event.record(self.reduce_stream if level is None else self._levels[level])
        bucket.free_event = event
        return event

    def synchronize(self, wait: Callable[[Callable[[], bool]], None] | None = None) -> None:
        self.join()
        if wait is None:
            self.reduce_stream.synchronize()
        else:
            wait(self.reduce_stream.query)

    @contextlib.contextmanager
    def levels(self) -> Iterator[None]:
        """A two-level flush: on the node stream, after the current stream and the reduce stream (Note (two
        levels)); the streams are made by the first one."""
        if not self._levels:
            self._levels = self._distinct_streams(("node", "rail"))
        node = self._levels["node"]
        node.wait_stream(self._cuda.current_stream(self.device))
        node.wait_stream(self.reduce_stream)
        self._levels_ahead = True
        with self._cuda.stream(node):
            yield

    def _distinct_streams(self, names: tuple[str, ...]) -> dict[str, Any]:
        """A stream for each of ``names``, none of them the reduce stream or another's where the pool allows. Note
        (stream pool): torch's ``Stream()`` hands out the streams of a pool (32 per device and priority) round-robin to
        every user of the process, so two calls may return the same stream; a level on the reduce stream or on the
        other level's stays correct (every wait here is an event or a stream wait, both no-ops on one stream: the
        simulated device runs the two-level flushes with pools of one and two streams), but its stages no longer
        overlap. So the draw goes on, at most a pool's length, until the streams differ."""
        taken = [self.reduce_stream]
        streams: dict[str, Any] = {}
        for name in names:
            stream = self._cuda.Stream(self.device, priority=_HIGH_PRIORITY)
            for _ in range(_STREAM_POOL):
                if all(stream != t for t in taken):  # torch compares the CUDA streams, not the Python objects
                    break
                stream = self._cuda.Stream(self.device, priority=_HIGH_PRIORITY)
            streams[name] = stream
            taken.append(stream)
        return streams

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

    def join(self) -> None:
        """The reduce stream after everything the levels issued (before a host wait on it, a one-level flush, a step's
        end mark); nothing to do where no two-level flush was issued since the last join."""
        if self._levels_ahead:
            self._levels_ahead = False
            for level in self._levels.values():
                self.reduce_stream.wait_stream(level)

    def mark(self, level: str | None = None) -> Any:
        """A point in the flush's work (``trial`` Note (timing)): a timing event on the reduce stream, or on a
        two-level flush's ``level`` stream."""
        event = self._cuda.Event(enable_timing=True)
        event.record(self.reduce_stream if level is None else self._levels[level])
        return event

    def step_end_mark(self) -> Any:
        """The end of a step's reduction (``trial`` Note (timing)): on the reduce stream, after it joined the levels."""
        self.join()
        return self.mark()

    @staticmethod
    def elapsed_us(start: Any, end: Any) -> float:
        """After the reduce stream was waited: the time between two marks on it."""
        return start.elapsed_time(end) * 1000.0

    def compute_mark(self) -> Any:
        """Where the backward's compute stands (``exposure`` Note (marks)): a timing event on the current stream."""
        event = self._cuda.Event(enable_timing=True)
        event.record(self._cuda.current_stream(self.device))
        return event

    @staticmethod
    def completed(mark: Any) -> bool:
        """Whether a mark's event has completed, without waiting for it (``query``, never ``synchronize``)."""
        return bool(mark.query())


def make_streams(device: torch.device) -> HostStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()
