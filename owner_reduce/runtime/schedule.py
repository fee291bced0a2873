"""Per-graph flush schedules: the owner-ordered layout of each flush, learned from a graph's first backward.

Why learned: a gradient must be copied into its owner-ordered place when it arrives, before the flush it
belongs to is complete, so the flush's content has to be known in advance. A graph's backward hands its
gradients to the runtime in the same order every step, so the first backward, bucketed in arrival order
exactly as DeepCompile does, records the flushes (dtype, gradients in order, sizes); every later backward
of that graph follows the record, with each flush laid out by ``owner_layout.plan_owner_layout``. Same flush
boundaries, same gradients per flush; only the positions inside a bucket change.

Note (identical on every rank): a schedule is a function of the arrival sequence and the owner map. Every
rank of the group sees the same arrival sequence (DeepCompile's own bucketing needs that too: otherwise its
flushes would differ across ranks), so every rank learns the same schedule and, when a step deviates from
it, detects the deviation at the same gradient: it then flushes what it placed so far (planned from the
pieces present) and continues in arrival order, and the schedule is dropped and learned again. No rank ever
waits for a collective another rank does not issue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.owner_layout import OwnerLayout, StepLayouts


@dataclass(frozen=True)
class ScheduledFlush:
    """One flush of a learned schedule: its gradients in arrival order and their owner-ordered layout."""

    dtype: Any  # torch.dtype
    ids: tuple[int, ...]
    numels: tuple[int, ...]
    layout: OwnerLayout


@dataclass(frozen=True)
class Schedule:
    """A graph's flushes, per dtype, in the order they happen; ``overlapped``: the step's plan overlaps consecutive
    flushes (``planning.step_plan``), so a flush's own time no longer says what it costs (``trial``); ``first_dtype``:
    the dtype of the step's first flush."""

    graph_id: int
    flushes: dict[Any, tuple[ScheduledFlush, ...]]
    overlapped: bool = False
    first_dtype: Any = None
    modelled_us: float = 0.0  # the step's plan: when its last flush ends (``step_plan``)

    def first(self) -> ScheduledFlush | None:
        """The flush the step starts with."""
        flushes = self.flushes.get(self.first_dtype) or next(iter(self.flushes.values()), ())
        return flushes[0] if flushes else None


def learn(graph_id: int, recorded: Sequence[tuple[Any, tuple[int, ...], tuple[int, ...]]],
          layouts_of: Callable[[Sequence[tuple[Any, Sequence[tuple[int, int]]]]], StepLayouts]) -> Schedule:
    """A schedule from the flushes recorded in one arrival-order backward ((dtype, ids, numels) in order);
    ``layouts_of([(dtype, grads), ...])`` lays out the step's flushes together (``owner_layout.plan_step_layouts``)."""
    step = layouts_of([(dtype, list(zip(ids, numels, strict=True))) for dtype, ids, numels in recorded])
    by_dtype: dict[Any, list[ScheduledFlush]] = {}
    for (dtype, ids, numels), layout in zip(recorded, step.layouts, strict=True):
        by_dtype.setdefault(dtype, []).append(ScheduledFlush(dtype, tuple(ids), tuple(numels), layout))
    return Schedule(graph_id, {d: tuple(f) for d, f in by_dtype.items()}, overlapped=step.plan.overlapped,
                    first_dtype=recorded[0][0] if recorded else None, modelled_us=step.plan.end_us)


class Follower:
    """Where one backward stands in a schedule: per dtype, the flush and the gradient expected next."""

    __slots__ = ("schedule", "_at")

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._at: dict[Any, tuple[int, int]] = {d: (0, 0) for d in schedule.flushes}

    def next(self, dtype: Any, ds_id: int, numel: int) -> tuple[ScheduledFlush, int, bool] | None:
        """(flush, the gradient's index in it, last of its flush) if ``ds_id`` is what the schedule expects next
        for ``dtype``; None (and nothing advances) if not."""
        at = self._at.get(dtype)
        if at is None:
            return None
        flush_index, grad_index = at
        flushes = self.schedule.flushes[dtype]
        if flush_index >= len(flushes):
            return None
        flush = flushes[flush_index]
        if flush.ids[grad_index] != ds_id or flush.numels[grad_index] != numel:
            return None
        last = grad_index + 1 == len(flush.ids)
        self._at[dtype] = (flush_index + 1, 0) if last else (flush_index, grad_index + 1)
        return flush, grad_index, last

    def complete(self) -> bool:
        """Every scheduled flush of every dtype happened in full."""
        return all(at == (len(self.schedule.flushes[d]), 0) for d, at in self._at.items())
