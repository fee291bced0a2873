"""``allreduce``: one AllReduce of the whole flush (what the native runtime sends, in one call). Every rank receives
every region; a latency-bound flush is cheapest so, and it is always a candidate (``flush_choice``'s bound against
native rests on it). Laid out from 0 with no alignment gaps: one call needs none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..calls import ALLREDUCE, Algo
from ..collectives import Collective
from ..flush_layout import FlushFacts, OwnerLayout, pack_regions, place_everyone, placed_grads
from ..flush_plan import merge_ranges
from .base import Algorithm, Estimate


def cost(facts: FlushFacts) -> Estimate:
    elems = facts.owner_elems + sum(p.length for p in facts.everyone)
    return Estimate(facts.cost.group_us([(ALLREDUCE, elems)]), facts.cost.issue_us(1), 1)


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    packed = pack_regions(facts, owners=False)
    ranges = list(packed.ranges)
    end = place_everyone(facts.everyone, packed.placed, ranges, packed.end)
    calls = (Collective(ALLREDUCE, 0, end),) if end else ()
    plan = replace(facts.counted, ranges=merge_ranges(ranges), owner_tasks=0, owner_elems=0)
    return OwnerLayout(grads=placed_grads(facts.entries, packed.placed), plan=plan, collectives=calls,
                       padding=tuple(packed.padding), total=end)


ALGORITHM = Algorithm(Algo.ALLREDUCE, cost, layout)
