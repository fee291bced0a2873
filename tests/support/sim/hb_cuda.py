"""A happens-before checker for CUDA streams: vector clocks over the host and each stream, and every device access
stamped with the stream that runs it; any two accesses to the same bytes that CUDA could run in either order are a
race.

Why: counting stream calls (``test_cuda_calls.py``) cannot tell a wait that orders the right accesses from one that
orders nothing, nor notice a wait that is missing on one path only. The checker is fed by the simulated device
(``sim_cuda``, ``Sim(hb=True)``), which records every op it enqueues: the clocks advance by what the product asked
CUDA for (records, waits, host synchronizations), never by how the sim's worker threads happened to run, so a missing
wait is reported even when the scheduling hid it.

The model (threads are each process's host and each stream; each has a vector clock, thread -> epoch):

- An op enqueued on stream S by host H happens after everything H knew then: ``VC[S] |= VC[H]``, then S ticks and the
  op's accesses are stamped (S, ``VC[S][S]``).
- ``Event.record(S)`` keeps a copy of ``VC[S]``; ``S.wait_event(e)`` joins it into S (an event never recorded orders
  nothing, as in CUDA); ``S.wait_stream(T)`` joins ``VC[T]`` into S; NCCL orders a communicator's kernels across
  streams, so an NCCL kernel joins its communicator's previous kernel.
- A host wait (a synchronize, a ``query()`` that returns True, a blocking copy, NCCL's waits) joins into the host.
- An access a (thread t, epoch e) happens before the access b of thread u iff ``e <= VC[u][t]`` when b happens. A
  race: two accesses to overlapping bytes of one storage, at least one a write, neither before the other.
- Reads and writes come from the op's schema (the sim passes them): an argument whose alias info writes
  (``Tensor(a!)``, ``out=``) is written, every other tensor argument read; a view touches nothing; a new storage an
  op returns is written (``empty*`` only allocates). NCCL calls read their send buffer and write their receive buffer.
- Frees follow the caching allocator: when a storage dies on the host, its memory may serve the next allocation on
  the stream it was allocated on, so every access to it must happen before ``VC[host] | VC[that stream] | VC[each
  stream it was record_stream-ed on]`` at that moment; otherwise it is reported as freed while in use.

Limits: a view's byte range is the span from its first to its last element (exact for the contiguous views the
runtime uses, conservative otherwise). Reports name the buffer, both ops with the source lines that issued them, and
their streams.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

HOST = "host"
ALLOC_ONLY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_THIS_FILES: set[str] = {__file__}


def join(into: dict[str, int], other: dict[str, int]) -> None:
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


class HbChecker:
    """The clocks and the accesses; ``races`` lists what it found (each distinct pair of ops once, with how often it
    happened). Thread names are the sim's stream and host names."""

    def __init__(self) -> None:
        self.clocks: dict[str, dict[str, int]] = {}
        self._storages: dict[int, _Storage] = {}
        self.races: dict[str, int] = {}
        self.ops = 0  # accesses recorded by enqueued ops (a check that a run really went through the checker)
        self.host_syncs = 0

    # ---- clocks -------------------------------------------------------------------------------------------

    def thread(self, name: str) -> None:
        self.clocks.setdefault(name, {name: 0})

    def enqueue(self, stream: str, host: str) -> int:
        clock = self.clocks[stream]
        join(clock, self.clocks[host])
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def snapshot(self, thread: str) -> dict[str, int]:
        return dict(self.clocks[thread])

    def join_into(self, thread: str, clock: dict[str, int] | None) -> None:
        if clock is not None:
            join(self.clocks[thread], clock)

    def host_joins(self, host: str, clock: dict[str, int] | None) -> None:
        """``host`` waited for everything ``clock`` covers (a synchronize, a true query, a blocking copy)."""
        clocks = self.clocks[host]
        if clock is not None:
            join(clocks, clock)
        clocks[host] = clocks.get(host, 0) + 1
        self.host_syncs += 1

    def host_tick(self, host: str) -> None:
        self.clocks[host][host] = self.clocks[host].get(host, 0) + 1

    def rename(self, old: str, new: str) -> None:
        if old == new:
            return
        if new in self.clocks:
            raise ValueError(f"a thread named {new!r} exists already")
        self.clocks[new] = self.clocks.pop(old)
        for clock in self.clocks.values():
            if old in clock:
                clock[new] = clock.pop(old)
        for record in self._storages.values():
            if record.alloc_stream == old:
                record.alloc_stream = new
            for a in record.accesses:
                if a.thread == old:
                    a.thread = new

    # ---- accesses ---------------------------------------------------------------------------------------------

    def allocated(self, key: int, label: str, alloc_stream: str) -> None:
        self._storages[key] = _Storage(label, alloc_stream, [])

    def name(self, key: int, label: str) -> None:
        record = self._storages.get(key)
        if record is not None:
            record.label = label

    def touch(self, key: int, lo: int, hi: int, write: bool, thread: str, op: str, site: str) -> None:
        """An access of bytes ``[lo, hi)`` of storage ``key`` by ``thread`` at its current epoch."""
        record = self._storages.get(key)
        if record is None or hi <= lo:
            return
        self.ops += 1
        clock = self.clocks[thread]
        access = _Access(thread, clock.get(thread, 0), write, lo, hi, op, site)
        kept = []
        for prior in record.accesses:
            before = prior.epoch <= clock.get(prior.thread, 0)
            if prior.lo < hi and lo < prior.hi and (prior.write or write) and not before:
                self._race(record, prior, access)
            covered = lo <= prior.lo and prior.hi <= hi and (write or not prior.write)
            if not (before and covered):
                kept.append(prior)
        kept.append(access)
        record.accesses = kept

    def freed(self, key: int, host: str, also: tuple[str, ...] = ()) -> None:
        """Storage ``key`` died on ``host``; its memory may serve the next allocation on its allocation stream once
        the host, that stream and every stream in ``also`` (``record_stream``) have passed their current work."""
        record = self._storages.pop(key, None)
        if record is None:
            return
        reuse = dict(self.clocks[host])
        for stream in (record.alloc_stream, *also):
            if stream in self.clocks:
                join(reuse, self.clocks[stream])
        for a in record.accesses:
            if a.epoch > reuse.get(a.thread, 0):
                text = (f"{record.label} freed on the host (its memory serves the next allocation on "
                        f"{record.alloc_stream}) while {'a write' if a.write else 'a read'} by {a.op} on {a.thread} "
                        f"({a.site}) is not known to be finished; freed at {site()}")
                self.races[text] = self.races.get(text, 0) + 1

    def _race(self, record: _Storage, a: _Access, b: _Access) -> None:
        lo, hi = max(a.lo, b.lo), min(a.hi, b.hi)
        text = (f"race on {record.label}, bytes [{lo}, {hi}): {'write' if a.write else 'read'} by {a.op} on "
                f"{a.thread} ({a.site}) and {'write' if b.write else 'read'} by {b.op} on {b.thread} ({b.site}) "
                f"are unordered")
        self.races[text] = self.races.get(text, 0) + 1

    def report(self, limit: int = 8) -> str:
        lines = [f"{n}x {text}" for text, n in list(self.races.items())[:limit]]
        more = len(self.races) - limit
        return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))


def skip_file(path: str) -> None:
    """Frames of ``path`` never name a site (the simulator's own modules)."""
    _THIS_FILES.add(path)


def site(depth: int = 2) -> str:
    """The two innermost frames of owner_reduce or the tests that led here, e.g. ``runtime/flush.py:152 flush``."""
    frame: Any = sys._getframe(depth)
    found = []
    while frame is not None and len(found) < 2:
        path = frame.f_code.co_filename
        if path not in _THIS_FILES and ("owner_reduce" in path or "/tests/" in path):
            short = path.split("owner_reduce/", 1)[-1] if "/owner_reduce/" in path else path.rsplit("/", 1)[-1]
            found.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(found) or "?"
