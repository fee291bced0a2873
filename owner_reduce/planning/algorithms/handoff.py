"""``handoff``: one ReduceScatter over the flush cut into ``world_size`` equal chunks, then one grouped send/recv round
that moves each reduced chunk's pieces to the ranks that own them (each rank receives exactly what it keeps).

Applies where the flush holds owner regions on more than one rank. The regions lie back to back in aligned slots, the
chunks cover them (the slots' tails and the last chunk's tail are zero padding: the ReduceScatter reduces them). The
round is a second group, issued while the first runs: only what its issue exceeds the ReduceScatter's device time by
is exposed (``step_plan`` Note (host)); it is costed as its busiest rank sends or receives (``FlushCost.handoff_us``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..alignment import slots
from ..calls import HANDOFF, REDUCE_SCATTER, Algo
from ..collectives import Collective, Transfer
from ..flush_layout import FlushFacts, OwnerLayout, owner_regions_layout, pack_regions, packed_transfers
from ..flush_plan import ALL, FlushRange
from .base import Algorithm, Estimate


def cost(facts: FlushFacts) -> Estimate | None:
    """``detail``: the round's transfers."""
    if not facts.owner_elems or facts.world_size <= 1:
        return None
    c, sizes = facts.cost, list(facts.sizes)
    transfers = packed_transfers(sizes, facts.chunk, slots(sizes, facts.align))
    scatter = c.calls_us([(REDUCE_SCATTER, facts.packed_span), *facts.everyone_call])
    late = max(0.0, c.issue_us(_p2p_calls(transfers)) - scatter)
    issue = c.issue_us(1 + len(facts.everyone_call))
    return Estimate(issue + scatter + late + c.handoff_us(transfers), issue, 2 + bool(facts.everyone), transfers)


def _p2p_calls(transfers: Sequence[Transfer]) -> int:
    """The most sends and receives one rank issues in a hand-off round of ``transfers``."""
    calls: dict[int, int] = {}
    for t in transfers:
        calls[t.src] = calls.get(t.src, 0) + 1
        calls[t.dst] = calls.get(t.dst, 0) + 1
    return max(calls.values(), default=0)


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    packed = pack_regions(facts, zero_slot_tails=True)
    end, span = packed.end, facts.packed_span
    if end < span:  # the last chunk's tail: zeros, reduced and never read
        packed.padding.append(FlushRange(end, span - end, ALL))
        end = span
    transfers = estimate.detail
    # Chunks that fall exactly on their owners' regions need no round.
    after = [Collective(HANDOFF, 0, span)] if transfers else []
    return owner_regions_layout(facts, packed, [Collective(REDUCE_SCATTER, 0, span, per_rank=facts.chunk)], end,
                                after=after, transfers=transfers)


ALGORITHM = Algorithm(Algo.HANDOFF, cost, layout)
