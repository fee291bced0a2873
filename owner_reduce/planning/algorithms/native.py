"""``native``: what DeepCompile's own runtime sends (z1.cpp / z2.cpp), issued by this runtime: every gradient whole, in
arrival order, one AllReduce each, in one group; every rank receives everything and keeps its share. Always a
candidate: the measured guard's baseline, and the flush for which native's own calls are cheapest.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..alignment import align_up
from ..calls import ALLREDUCE, Algo
from ..collectives import Collective
from ..flush_layout import FlushFacts, OwnerLayout, PlacedGrad, PlacedPiece
from ..flush_plan import ALL, FlushRange, merge_ranges
from .base import Algorithm, Estimate


def cost(facts: FlushFacts) -> Estimate:
    calls = [(ALLREDUCE, e.numel) for e in facts.entries if e.numel]
    return Estimate(facts.cost.group_us(calls), facts.cost.issue_us(len(calls)), len(facts.entries))


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    """Each gradient starts aligned (``alignment``; DeepCompile packs them back to back); the gaps are never
    reduced."""
    grads, collectives, offset, end = [], [], 0, 0
    for e in facts.entries:
        offset = align_up(end, facts.align)
        pieces = (PlacedPiece(e.param_id, 0, e.numel, offset, ALL),) if e.numel else ()
        grads.append(PlacedGrad(e.param_id, e.numel, pieces))
        if e.numel:
            collectives.append(Collective(ALLREDUCE, offset, e.numel))
            end = offset + e.numel
    plan = replace(facts.counted, ranges=merge_ranges(FlushRange(c.offset, c.count, ALL) for c in collectives),
                   owner_tasks=0, owner_elems=0)
    return OwnerLayout(grads=tuple(grads), plan=plan, collectives=tuple(collectives), padding=(), total=end)


ALGORITHM = Algorithm(Algo.NATIVE, cost, layout)
