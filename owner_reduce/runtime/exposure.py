"""The probe's step summary at run time: each rank marks its first steps, reads each step's marks one step later
without waiting for them, and the ranks gather their numbers once; rank 0 prints one line per step
(``planning.exposure`` has the definitions and the line).

Why here and not in the flush: the flush only hands over its marks (its start, and its bucket's free event as its
end); which step they belong to, when they are read and what is printed is this module's.

Note (no host wait): a step's marks are read at the next step's ``end_backward``, after that call's own bounded wait,
and only with ``query()``: a mark not complete by then makes the step "not measured" on this rank, never a wait
(``event.synchronize()`` is never called). By then every mark has completed in practice: the step's end mark is on
the reduce stream, which the host waited for a step ago, and its compute mark precedes, on the compute stream, the
next step's first flush, which the reduce stream waited for before the host did.

Note (CUDA calls): per step of the probe, on a GPU: three timing events and their records (the first flush's start,
the compute mark, the step's end; the buckets' free events are made timing events meanwhile, which marks each
flush's end at no extra call), and a step later two ``query`` calls and three ``elapsed_time`` reads, plus one per
flush read back for the model's saving (the exposed flushes and the one before them). Nothing per gradient, and
nothing once the probe's steps are done: the flush's hooks are one ``None`` check.

Note (one gather): the slowest rank's numbers need every rank's. No collective of the step carries them, and the
measured guard's agreement runs only with the owner path on, so the ranks gather their rows once, in one
``all_gather_ints`` on the data-parallel communicator (bounded by its deadline), at the ``end_backward`` that reads
the probe's last step. Every rank takes the same branch: the step count and the flushes are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..planning.collectives import HANDOFF
from ..planning.exposure import (
    MODELLED,
    PROBE_STEPS,
    StepExposure,
    exposed_from,
    exposed_parts,
    format_step_line,
    measure_step,
    modelled_saving,
    owner_path_us,
    owner_ratio,
    pack_row,
    unpack_rows,
)
from ..planning.flush_choice import FlushCost
from ..planning.owner_layout import map_order
from ..planning.owner_map import OwnerMap
from .streams import HostStreams

_RATIO_CACHE_LIMIT = 256  # distinct flush contents whose modelled ratio is remembered


class _Step:
    """One backward's marks while it is recorded (``planning.exposure`` Note (marks))."""

    __slots__ = ("first", "last_start", "compute", "end", "ends", "ratios", "how", "flushed_before_end")

    def __init__(self) -> None:
        self.first: Any = None
        self.last_start: Any = None  # host only: the start of the flush issued last
        self.compute: Any = None
        self.end: Any = None
        self.ends: list[Any] = []  # each flush's end (its bucket's free event), in issue order
        self.ratios: list[float] = []  # owner path off: each flush's modelled ratio (owner path / what ran)
        self.how = MODELLED
        self.flushed_before_end = 0  # flushes issued before end_backward was called


class OwnerPathModel:
    """The cost model's ratio per flush of a run without the owner path: its choice for the flush's gradients over
    what ran (``planning.exposure.owner_ratio``), computed once per distinct flush content."""

    def __init__(self, owner_map: OwnerMap, cost: FlushCost) -> None:
        self._owner_map = owner_map
        self._cost = cost
        self._order = map_order(owner_map)
        self._cache: dict[int, tuple[Any, float]] = {}

    def ratio(self, pending: Any, cached: Any) -> float:
        hit = self._cache.get(id(cached))
        if hit is not None and hit[0] is cached:  # held by the entry: its id is not reused meanwhile
            return hit[1]
        cost = self._cost.for_dtype_bytes(pending.bucket.buffer.element_size())
        grads = list(zip(pending.ids, pending.numels, strict=True))
        owner_us = owner_path_us(grads, self._owner_map, cost, order=self._order,
                                 capacity=max([pending.bucket.capacity, *pending.numels]))
        # What ran, alone and issued by this runtime as the owner path's choice would be: issue on both sides.
        ran_us = cost.group_us([(c.kind, c.count) for c in cached.collectives if c.kind != HANDOFF])
        ratio = owner_ratio(owner_us, ran_us)
        if len(self._cache) >= _RATIO_CACHE_LIMIT:
            self._cache.clear()
        self._cache[id(cached)] = (cached, ratio)
        return ratio


class ExposureProbe:
    """One rank's probe steps: recorded by the flusher's and ``end_backward``'s hooks, read a step later
    (``after_wait``), gathered once (``rows``). Steps are the backwards that reduced something, numbered from 1; the
    first only marks where the second starts, so the summary covers steps 2 to ``steps + 1``."""

    def __init__(self, ratio_of: Callable[[Any, Any], float] | None, steps: int = PROBE_STEPS) -> None:
        self._ratio_of = ratio_of  # None: the owner path is on, and its lines say what was measured
        self.steps = steps
        self.recording = True  # the flusher's hooks run (until the last probe step is recorded)
        self.reduced = 0  # backwards that reduced, recorded so far
        self.samples: list[StepExposure | None] = []  # this rank's, per probe step (None: not measured)
        self._streams: Any = None
        self._step: _Step | None = None  # the backward being recorded
        self._fresh: _Step | None = None  # recorded at this end_backward: read at the next one
        self._waiting: list[_Step] = []  # recorded, not read yet
        self._start: Any = None  # the end mark of the step before the next one read

    @property
    def done(self) -> bool:
        return len(self.samples) >= self.steps

    # ---- the flusher's hooks (one flush each) -------------------------------------------------------------------

    def flush_started(self, streams: Any, level: str | None = None) -> None:
        step = self._step
        if step is None:
            step = self._step = _Step()
        if step.first is None:
            step.first = step.last_start = streams.mark(level)
        elif isinstance(streams, HostStreams):  # the wall clock: free; a GPU marks the first flush only
            step.last_start = streams.mark(level)

    def flush_ended(self, end: Any, pending: Any, cached: Any) -> None:
        step = self._step
        step.ends.append(end)
        if self._ratio_of is not None:
            step.ratios.append(self._ratio_of(pending, cached))

    # ---- end_backward's hooks ---------------------------------------------------------------------------------

    def backward_ending(self, streams: Any, pending: bool) -> None:
        """``end_backward`` was called: the compute mark, where this backward reduces something (it flushed, or has a
        bucket to flush now); a backward that reduces nothing (accumulation between boundaries) is not a step."""
        step = self._step
        if streams is None or (step is None and not pending):
            return
        if step is None:
            step = self._step = _Step()
        self._streams = streams
        step.compute = streams.compute_mark()
        step.flushed_before_end = len(step.ends)

    def backward_ended(self, streams: Any, how: int) -> None:
        """``end_backward`` flushed what was left, before its wait: the step's end mark (after the reduce stream joined
        the levels)."""
        step, self._step = self._step, None
        if step is None or not step.ends or step.compute is None:
            return
        step.end = streams.step_end_mark()
        if isinstance(streams, HostStreams) and len(step.ends) == step.flushed_before_end:
            # Every flush ran inside the backward's thread: the one issued last took its last gradient.
            step.compute = min(step.compute, step.last_start)
        step.how = how
        self.reduced += 1
        self._waiting.append(step)
        self._fresh = step
        if self.reduced > self.steps:
            self.recording = False

    def after_wait(self) -> None:
        """After ``end_backward``'s wait: read every step recorded before this call (Note (no host wait))."""
        fresh, self._fresh = self._fresh, None
        for step in [s for s in self._waiting if s is not fresh]:
            self._waiting.remove(step)
            if self._start is not None and not self.done:
                self.samples.append(self._read(step, self._start, len(self.samples) + 2))
            self._start = step.end

    def _read(self, step: _Step, start: Any, number: int) -> StepExposure | None:
        streams = self._streams
        if not (streams.completed(step.end) and streams.completed(step.compute)):
            return None
        at = streams.elapsed_us
        first, compute, end = at(start, step.first), at(start, step.compute), at(start, step.end)
        span, exposed, step_us = measure_step(0.0, first, compute, end)
        saving = None
        if self._ratio_of is not None and step.how == MODELLED:
            parts = exposed_parts(exposed_from(first, compute), end,
                                  (at(start, mark) for mark in reversed(step.ends[:-1])))
            saving = modelled_saving(parts, step.ratios[::-1][:len(parts)])
        return StepExposure(number, span, exposed, step_us, saving, step.how)

    # ---- the gather ---------------------------------------------------------------------------------------------

    def row(self) -> list[int]:
        return pack_row(self.samples, self.steps)

    @staticmethod
    def lines(rows: list[list[int]]) -> list[str]:
        """Rank 0's lines from every rank's ``row``: one per probe step."""
        return [format_step_line(2 + k, per_rank) for k, per_rank in enumerate(unpack_rows(rows))]
