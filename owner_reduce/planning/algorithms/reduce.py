"""``reduce``: one Reduce per owner the flush touches, to that owner; a larger region cut into consecutive Reduces to
its owner where that lets NCCL's planner run them as one aggregate, one chain's latency (``aggregation``).

Applies wherever the flush holds owner regions. Each region starts aligned (``alignment``) and is cut at multiples of
the alignment.
"""

from __future__ import annotations

from typing import Any

from ..aggregation import reduce_pieces
from ..alignment import aligned_cut
from ..calls import REDUCE, Algo
from ..collectives import Collective
from ..flush_layout import FlushFacts, OwnerLayout, owner_regions_layout, pack_regions
from .base import Algorithm, Estimate


def cost(facts: FlushFacts) -> Estimate | None:
    """``detail``: per owner, the consecutive Reduces its region runs as."""
    if not facts.owner_elems:
        return None
    pieces, us = reduce_pieces(list(facts.sizes), facts.everyone_call, facts.cost.group_us)
    return Estimate(us, facts.cost.issue_us(sum(pieces) + len(facts.everyone_call)),
                    sum(pieces) + bool(facts.everyone), pieces)


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    packed = pack_regions(facts)
    calls = []
    for rank, (start, size) in enumerate(zip(packed.starts, facts.sizes, strict=True)):
        at = start
        for part in aligned_cut(size, estimate.detail[rank], facts.align) if size else ():
            if part:
                calls.append(Collective(REDUCE, at, part, rank))
            at += part
    return owner_regions_layout(facts, packed, calls, packed.end)


ALGORITHM = Algorithm(Algo.REDUCE, cost, layout)
