"""``reduce_scatter``: one ReduceScatter over the owner regions padded to equal blocks, for a flush that covers every
rank with near-equal regions (ZeRO's own flat partition layout: the owner regions are then exactly its input).

Applies where every rank owns part of the flush, the blocks fit the bucket and equalising the regions pads at most
``max_padding_share`` of the flush. Cannot be forced: it needs every owner present. Block ``r`` starts at
``r x per_rank`` (the largest region, aligned: ``alignment``), its short tail zero padding.
"""

from __future__ import annotations

from typing import Any

from ..calls import REDUCE_SCATTER, Algo
from ..collectives import Collective
from ..flush_layout import FlushFacts, OwnerLayout, owner_regions_layout, pack_regions
from .base import Algorithm, Estimate


def cost(facts: FlushFacts) -> Estimate | None:
    n, sizes = facts.world_size, facts.sizes
    if not facts.owner_elems or n <= 1:
        return None
    pad = n * max(sizes) - facts.owner_elems  # the bound is on equalising the regions; alignment adds < align each
    all_elems = sum(p.length for p in facts.everyone)
    fits = facts.capacity is None or n * facts.per_rank + all_elems <= facts.capacity
    if not (all(sizes) and fits and pad <= facts.max_padding_share * facts.counted.reduced_elems):
        return None
    calls = [(REDUCE_SCATTER, n * facts.per_rank), *facts.everyone_call]
    return Estimate(facts.cost.group_us(calls), facts.cost.issue_us(1 + len(facts.everyone_call)),
                    1 + bool(facts.everyone))


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    packed = pack_regions(facts, stride=facts.per_rank)
    call = Collective(REDUCE_SCATTER, 0, facts.world_size * facts.per_rank, per_rank=facts.per_rank)
    return owner_regions_layout(facts, packed, [call], packed.end)


ALGORITHM = Algorithm(Algo.REDUCE_SCATTER, cost, layout, forceable=False)
