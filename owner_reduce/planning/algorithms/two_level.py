"""``two_level``: where ranks form whole nodes over a network, a ReduceScatter in each node, then each owner's region
reduced across nodes on its rail, pipelined (the pipeline's model and geometry: ``planning.two_level``).

Its cost is a set of pipelines (``TwoLevel.options``: stage counts, rail steps, rail layouts), each with the AllReduce
of the gradients that reach every rank after it; the step's plan picks one per flush (``Pipeline``, ``step_plan``), a
flush alone takes the fastest. A candidate only where the node and rail communicators exist (``FlushCost.two_level``),
and, a calibration timing the data-parallel communicator only, under a calibration only when forced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..alignment import align_up, slots
from ..calls import ALLREDUCE, Algo
from ..collectives import Collective
from ..flush_layout import CostModel, FlushFacts, OwnerLayout, PlacedPiece, RegionPiece, place_everyone, placed_grads
from ..step_plan import FlushTimes
from ..two_level import BALANCED, TwoLevelGeometry, TwoLevelOption, balanced_parts, two_level_calls
from .base import Algorithm, Estimate, Pipeline


def cost(facts: FlushFacts) -> Estimate | None:
    """``detail``: every pipeline worth comparing, padding at most ``two_level_max_padding_share`` of the flush."""
    c = facts.cost
    if not facts.owner_elems or facts.world_size <= 1 or c.two_level is None:
        return None
    options = c.two_level.options(list(facts.sizes), c.dtype_bytes,
                                  int(facts.two_level_max_padding_share * facts.counted.reduced_elems),
                                  host=c.host_cost)
    if not options:
        return None
    return Estimate(min(times(facts, o).alone_us for o in options), 0.0, len(facts.entries) + 1, options)


def times(facts: FlushFacts, option: TwoLevelOption) -> FlushTimes:
    """``option`` as the step's schedule sees it: its stages on the node and rail streams, then the AllReduce of the
    gradients that reach every rank, each stage and that call with its host issue."""
    return FlushTimes(option.stage_us, facts.everyone_us,
                      (*option.stage_issue, *((facts.everyone_issue,) if facts.everyone_us else ())))


def recost(facts: FlushFacts, option: TwoLevelOption, cost: CostModel) -> TwoLevelOption | None:
    """``option``'s pipeline costed under ``cost`` (the sizing's hand-off sensitivity); None without two levels."""
    if cost.two_level is None:
        return None
    return cost.two_level.recost(list(facts.sizes), option, cost.dtype_bytes, cost.host_cost)


def layout(facts: FlushFacts, estimate: Estimate, option: TwoLevelOption | None = None) -> OwnerLayout:
    """Owner regions in their local rank's block (each in its aligned slot), blocks cut into the option's stages
    (``TwoLevelGeometry``: ReduceScatter stages ``[stage][local rank][slice]``, the shorter blocks zero-padded there,
    then the longer blocks' tails packed), its rail step's calls; the AllReduce region after them."""
    if option is None:
        raise ValueError("owner_reduce: a two-level layout needs its pipeline (TwoLevelOption)")
    geo = option.geometry
    ranks_per_node = geo.ranks_per_node
    regions, sizes = facts.regions, facts.sizes
    placed: dict[int, list[PlacedPiece]] = {e.param_id: [] for e in facts.entries}
    if option.rail_layout == BALANCED:
        _place_balanced(regions, sizes, geo, placed)
    else:
        positions = [0] * ranks_per_node  # where the next owner region starts in each block
        for owner in sorted(range(len(regions)), key=lambda o: (o % ranks_per_node, o)):
            local = owner % ranks_per_node
            at = positions[local]
            for _, param_id, src_offset, length in regions[owner]:
                for offset, position, count in geo.segments(local, at, length):
                    placed[param_id].append(PlacedPiece(param_id, src_offset + position - at, count, offset, owner))
                at += length
            positions[local] = align_up(at, geo.align)  # the region's slot
    collectives, ranges, padding, transfers = two_level_calls(list(sizes), geo, option.rail_step, option.rail_layout)
    collectives, ranges = list(collectives), list(ranges)
    all_elems = sum(p.length for p in facts.everyone)
    if all_elems:
        collectives.append(Collective(ALLREDUCE, geo.span, all_elems))
    offset = place_everyone(facts.everyone, placed, ranges, geo.span)
    return OwnerLayout(grads=placed_grads(facts.entries, placed), plan=replace(facts.counted, ranges=tuple(ranges)),
                       collectives=tuple(collectives), padding=padding, total=offset, transfers=transfers,
                       stages=geo.stages, ranks_per_node=ranks_per_node, rail_step=option.rail_step,
                       rail_layout=option.rail_layout, stage_us=option.stage_us, everyone_us=facts.everyone_us)


def _place_balanced(regions: Sequence[Sequence[RegionPiece]], sizes: Sequence[int], geo: TwoLevelGeometry,
                    placed: dict[int, list[PlacedPiece]]) -> None:
    """Each owner region's pieces in a balanced layout (``two_level`` Note (balanced rails)): the region's slot cut
    into ``G`` parts in region order, part ``j`` at its position in block ``j`` (``balanced_parts``); the region fills
    its parts in order, the slot's padding ends its last one."""
    parts: dict[int, list[tuple[int, int, int]]] = {}  # owner -> (block, position, elements) of its parts, in order
    for owner, _, part, position, count in balanced_parts(slots(sizes, geo.align), geo.ranks_per_node, geo.align):
        parts.setdefault(owner, []).append((part, position, count))
    for owner, region in enumerate(regions):
        cursor = iter(parts.get(owner, ()))
        block, position, left = next(cursor, (0, 0, 0))
        for _, param_id, src_offset, length in region:
            done = 0
            while done < length:
                if not left:
                    block, position, left = next(cursor)
                n = min(left, length - done)
                for offset, at, count in geo.segments(block, position, n):
                    placed[param_id].append(PlacedPiece(param_id, src_offset + done + at - position, count, offset,
                                                        owner))
                done, position, left = done + n, position + n, left - n


ALGORITHM = Algorithm(Algo.TWO_LEVEL, cost, layout, calibrated=False,
                      pipeline=Pipeline(lambda estimate: estimate.detail, times, recost))
