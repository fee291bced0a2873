"""A happens-before checker for the CUDA stream discipline, on CPU: a fake ``torch.cuda`` whose streams, events and
(Being replaced: tests/sim_cuda.py with hb_cuda.HbChecker runs these checks on the simulated device.)
host waits are vector clocks, and a ``TorchDispatchMode`` that stamps every aten op's reads and writes with the
stream that is current when it runs.

Why: counting stream calls (``test_cuda_calls.py``) cannot tell a wait that orders the right accesses from one that
orders nothing, nor notice a wait that is missing on one path only. This checker drives the real ``CudaStreams``
(through its ``cuda`` seam) and the real runtime on CPU tensors, and reports every pair of accesses to the same bytes
that CUDA would be free to run in either order.

The model (threads are the host and each stream; each has a vector clock, thread -> epoch):

- An op runs on the fake's current stream S (``with cuda.stream(s)`` changes it). It is enqueued by the host, so it
  happens after everything the host knew then: ``VC[S] |= VC[host]``, then S ticks and the op's accesses are
  stamped (S, ``VC[S][S]``).
- ``Event.record(S)`` is enqueued on S and keeps a copy of ``VC[S]``; ``S.wait_event(e)`` joins it into S (an event
  never recorded orders nothing, as in CUDA); ``S.wait_stream(T)`` joins ``VC[T]`` into S.
- ``S.synchronize()``, ``e.synchronize()``, ``cuda.synchronize()`` and a ``query()`` that returns True join into the
  host. ``query()`` is honest: the fake GPU has finished everything enqueued, so it may return True (after
  ``false_queries`` Falses, to exercise a poll loop) and it joins the host whenever it does.
- An access a (thread t, epoch e) happens before the access b of thread u iff ``e <= VC[u][t]`` when b happens.
  A race: two accesses to overlapping bytes of one storage, at least one a write, neither before the other.
- Reads and writes come from the op's schema: an argument whose alias info writes (``Tensor(a!)``, ``out=``) is
  written, every other tensor argument read; a view op touches nothing; a new storage an op returns is written
  (``empty*`` only allocates). An op that returns a Python number (``.item()``, ``equal``) makes the host wait for
  its stream, as CUDA does. ``access()`` records what no aten op shows (a communicator's send).
- Frees follow the caching allocator: when a storage dies on the host, its memory may serve the next allocation on
  the stream it was allocated on, so every access to it must happen before ``VC[host] | VC[that stream]`` at that
  moment; otherwise it is reported as freed while in use. A storage the checker never saw allocated counts as
  allocated on the default ("compute") stream.

Limits: a view's byte range is the span from its first to its last element (exact for the contiguous views the
runtime uses, conservative otherwise); ops are seen on CPU, so a CUDA-only path (cupy's NCCL calls) is modelled by
the fake communicator that stands in for it. Reports name the buffer, both ops with the source lines that issued
them, and their streams.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST = "host"
_ALLOC_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_THIS_FILE = __file__


def _join(into: dict[str, int], other: dict[str, int]) -> None:
    for thread, epoch in other.items():
        if into.get(thread, 0) < epoch:
            into[thread] = epoch


@dataclass
class _Access:
    thread: str
    epoch: int
    write: bool
    lo: int
    hi: int
    op: str
    site: str


@dataclass
class _Storage:
    label: str
    alloc_stream: str
    accesses: list[_Access]
    finalizer: Any = None


class FakeStream:
    def __init__(self, hb: HbCuda, name: str, priority: int = 0) -> None:
        self._hb, self.name, self.priority = hb, name, priority
        hb.clocks[name] = {}

    def wait_event(self, event: FakeEvent) -> None:
        self._hb._enqueue(self.name)
        if event.clock is not None:
            _join(self._hb.clocks[self.name], event.clock)

    def wait_stream(self, stream: FakeStream) -> None:
        self._hb._enqueue(self.name)
        _join(self._hb.clocks[self.name], self._hb.clocks[stream.name])

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent(self._hb)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._hb._host_joins(self._hb.clocks[self.name])

    def query(self) -> bool:
        if self._hb._false_query():
            return False
        self._hb._host_joins(self._hb.clocks[self.name])
        return True

    def __repr__(self) -> str:
        return f"<fake stream {self.name}>"


class FakeEvent:
    def __init__(self, hb: HbCuda) -> None:
        self._hb = hb
        self.clock: dict[str, int] | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self._hb.current
        self._hb._enqueue(stream.name)
        self.clock = dict(self._hb.clocks[stream.name])

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream if stream is not None else self._hb.current).wait_event(self)

    def synchronize(self) -> None:
        if self.clock is not None:
            self._hb._host_joins(self.clock)

    def query(self) -> bool:
        if self._hb._false_query():
            return False
        self.synchronize()
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        """CUDA raises (cudaErrorNotReady) unless both events completed: the host must have waited for them."""
        host = self._hb.clocks[HOST]
        for event in (self, end):
            if event.clock is None or any(host.get(t, 0) < e for t, e in event.clock.items()):
                raise AssertionError("elapsed_time read before the host waited for the event's stream")
        return 1.0


class HbCuda:
    """Stands in for ``torch.cuda`` in ``CudaStreams`` and checks, while entered (``with hb:``), every tensor access
    made meanwhile. ``races`` lists what it found (each distinct pair of ops once, with how often it happened)."""

    def __init__(self, false_queries: int = 0) -> None:
        self.clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}}
        self.current = FakeStream(self, "compute")
        self.default = self.current
        self._streams = 0
        self._false_queries = false_queries
        self._queries = 0
        self._storages: dict[int, _Storage] = {}  # id(untyped storage) -> its record, dropped when it dies
        self._labels: dict[int, str] = {}
        self.races: dict[str, int] = {}
        self.ops = 0  # aten ops seen (a check that the run really went through the mode)
        self.host_syncs = 0
        self._active = False
        self._mode = _Mode(self)

    # ---- torch.cuda's surface (what CudaStreams calls) -----------------------------------------------------

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        self._streams += 1
        return FakeStream(self, f"stream#{self._streams}", priority)

    def Event(self, **kwargs: Any) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        return FakeEvent(self)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device: Any = None) -> None:
        for name, clock in list(self.clocks.items()):
            if name != HOST:
                self._host_joins(clock)

    # ---- the test's side ------------------------------------------------------------------------------------

    def name(self, tensor: torch.Tensor, label: str) -> None:
        """Call ``tensor``'s storage ``label`` in reports."""
        self._record(tensor.untyped_storage()).label = label

    def rename_stream(self, stream: FakeStream, name: str) -> None:
        clock = self.clocks.pop(stream.name)
        self.clocks[name] = clock
        for other in self.clocks.values():
            if stream.name in other:
                other[name] = other.pop(stream.name)
        for record in self._storages.values():
            if record.alloc_stream == stream.name:
                record.alloc_stream = name
            for a in record.accesses:
                if a.thread == stream.name:
                    a.thread = name
        stream.name = name

    def access(self, tensor: torch.Tensor, write: bool, op: str, on_host: bool = False) -> None:
        """Record an access no aten op shows (a communicator's send reads its buffer), on the current stream or, with
        ``on_host``, by the host (CPU code reading or writing the tensor)."""
        thread = HOST if on_host else self.current.name
        if on_host:
            self.clocks[HOST][HOST] += 1
        else:
            self._enqueue(thread)
        self._touch(tensor, write, thread, op, _site())

    def report(self, limit: int = 8) -> str:
        lines = [f"{n}x {text}" for text, n in list(self.races.items())[:limit]]
        more = len(self.races) - limit
        return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))

    def __enter__(self) -> HbCuda:
        self._active = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._active = False
        for record in self._storages.values():
            if record.finalizer is not None:
                record.finalizer.detach()
        self._storages.clear()

    # ---- clocks -----------------------------------------------------------------------------------------------

    def _enqueue(self, stream: str) -> int:
        clock = self.clocks[stream]
        _join(clock, self.clocks[HOST])
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def _host_joins(self, clock: dict[str, int]) -> None:
        host = self.clocks[HOST]
        _join(host, clock)
        host[HOST] += 1
        self.host_syncs += 1

    def _false_query(self) -> bool:
        self._queries += 1
        return self._false_queries > 0 and self._queries % (self._false_queries + 1) != 0

    # ---- accesses ---------------------------------------------------------------------------------------------

    def _record(self, storage: Any, label: str | None = None, alloc_stream: str | None = None) -> _Storage:
        key = id(storage)
        record = self._storages.get(key)
        if record is None:
            record = self._storages[key] = _Storage(label or f"a {storage.nbytes()}-byte buffer",
                                                    alloc_stream or self.default.name, [])
            record.finalizer = weakref.finalize(storage, self._freed, key)
        return record

    def _touch(self, tensor: torch.Tensor, write: bool, thread: str, op: str, site: str,
               record: _Storage | None = None) -> None:
        if tensor.numel() == 0:
            return
        size = tensor.element_size()
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        lo = tensor.storage_offset() * size
        access = _Access(thread, self.clocks[thread][thread], write, lo, lo + extent * size, op, site)
        record = record or self._record(tensor.untyped_storage())
        clock = self.clocks[thread]
        kept = []
        for prior in record.accesses:
            before = prior.epoch <= clock.get(prior.thread, 0)
            if prior.lo < access.hi and access.lo < prior.hi and (prior.write or write) and not before:
                self._race(record, prior, access)
            covered = access.lo <= prior.lo and prior.hi <= access.hi and (write or not prior.write)
            if not (before and covered):
                kept.append(prior)
        kept.append(access)
        record.accesses = kept

    def _race(self, record: _Storage, a: _Access, b: _Access) -> None:
        lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
        text = (f"race on {record.label}, bytes [{lo}, {hi}): {'write' if a.write else 'read'} by {a.op} on "
                f"{a.thread} ({a.site}) and {'write' if b.write else 'read'} by {b.op} on {b.thread} ({b.site}) "
                f"are unordered")
        self.races[text] = self.races.get(text, 0) + 1

    def _freed(self, key: int) -> None:
        record = self._storages.pop(key, None)
        if record is None or not self._active:
            return
        reuse = dict(self.clocks[HOST])
        _join(reuse, self.clocks[record.alloc_stream])
        for a in record.accesses:
            if a.epoch > reuse.get(a.thread, 0):
                text = (f"{record.label} freed on the host (its memory serves the next allocation on "
                        f"{record.alloc_stream}) while {'a write' if a.write else 'a read'} by {a.op} on {a.thread} "
                        f"({a.site}) is not known to be finished; freed at {_site()}")
                self.races[text] = self.races.get(text, 0) + 1

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if func.is_view or not self._active:
            return out
        self.ops += 1
        thread = self.current.name
        self._enqueue(thread)
        name = func.__name__.split(".")[0]
        op = f"aten.{name}"
        site = _site()
        seen: set[int] = set()
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = value if isinstance(value, list | tuple) else [value]
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    seen.add(id(t.untyped_storage()))
                    self._touch(t, write, thread, op, site)
        outputs = out if isinstance(out, list | tuple) else [out]
        for t in outputs:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in seen:
                what = f"{str(t.dtype).removeprefix('torch.')}[{t.numel()}] from {op} ({site})"
                record = self._record(t.untyped_storage(), what, thread)
                if name not in _ALLOC_ONLY:
                    self._touch(t, True, thread, op, site, record)
        if not any(isinstance(t, torch.Tensor) for t in outputs) and out is not None and func._schema.returns:
            self._host_joins(self.clocks[thread])  # .item(), equal(): the host waits for the result
        return out


class _Mode(TorchDispatchMode):
    def __init__(self, hb: HbCuda) -> None:
        super().__init__()
        self._hb = hb

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._hb._dispatch(func, args, kwargs or {})


def _site() -> str:
    """The two innermost frames of owner_reduce or the tests that led here, e.g. ``runtime/flush.py:152 flush``."""
    frame = sys._getframe(2)
    found = []
    while frame is not None and len(found) < 2:
        path = frame.f_code.co_filename
        if path != _THIS_FILE and ("owner_reduce" in path or "/tests/" in path):
            short = path.split("owner_reduce/", 1)[-1] if "/owner_reduce/" in path else path.rsplit("/", 1)[-1]
            found.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(found) or "?"
