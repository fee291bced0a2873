"""The owner-ordered bucket layout: where each gradient (or slice) of a flush goes, and which calls run.

Why: gradients reach the bucket in backward order (partitions descending) while a straddler's slices ascend,
so in arrival order the owners interleave and a flush costs one collective per run of owners (142 at ws 64 for
GPT-2 124M in one flush). Placing every gradient, or every slice of a straddling one, into its owner's region
(regions in ascending rank order, AllReduce-only entries after them) makes the owner regions contiguous, and
then a flush can run as any of ``flush_choice``'s candidates: one Reduce per owner it touches; one ReduceScatter
when it covers every rank with counts that are equal after padding the short regions with a few zeros (the owner
regions are then exactly a ReduceScatter's input: ZeRO's own flat partition layout); a ReduceScatter over equal
chunks followed by a hand-off of each chunk's pieces to their owners; or one AllReduce. The cheapest by NCCL's
alpha-beta model is laid out and runs (``flush_choice``).

Pure and deterministic: the layout is a function of (the flush's gradients in arrival order, the owner map,
the bucket capacity, the cost model) only, so every rank computes the same one without communicating. Within
an owner region pieces follow the owner map's parameter order (the order of ZeRO's flat buffer), then their
offset.

Aligned (``alignment``): every call a layout issues starts 16-byte aligned in the bucket, so NCCL moves 16-byte packs.
A region starts at a multiple of the alignment (``align``: 8 bf16 / 4 fp32 elements; the cost model's dtype) and
takes a slot of its size rounded up to it; a ReduceScatter's ``per_rank`` and a hand-off's chunk are multiples of it;
a region cut into Reduces is cut at multiples of it. The padding is zero-filled where a call reduces it (``padding``).
One AllReduce of the whole flush starts at 0 and needs none; native's gradients each start aligned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .aggregation import reduce_pieces
from .alignment import align_elems, align_up, aligned_cut, slots
from .collective_time import named_topology
from .collectives import (
    ALLREDUCE,
    HANDOFF,
    NATIVE,
    RAIL,
    REDUCE,
    REDUCE_SCATTER,
    TWO_LEVEL,
    Collective,
    Transfer,
    algo_of,
    algo_of_calls,
    collectives_of,
)
from .flush_choice import AUTO, FlushCost, choose
from .flush_plan import ALL, BucketEntry, FlushPlan, FlushRange, merge_ranges, plan_flush
from .owner_map import OwnerMap, Placement
from .step_plan import FlushTimes, StepPlan, native_step_us, plan_step, schedule
from .two_level import BALANCED, TwoLevelGeometry, TwoLevelOption, balanced_parts, two_level_calls

__all__ = ["ALLREDUCE", "HANDOFF", "NATIVE", "REDUCE", "REDUCE_SCATTER", "Collective", "OwnerLayout", "PlacedGrad",
           "PlacedPiece", "Transfer", "algo_of", "collectives_of", "default_cost", "map_order",
           "plan_owner_layout", "plan_placed"]

MAX_PADDING_SHARE = 0.01  # a padded ReduceScatter may pad the short regions by at most 1% of the flush's elements
# A two-level flush may pad the shorter node blocks (blocks hold different owners' regions); the padding grows the
# bucket and the node step's bytes (the latter costed), so it is bounded: at most an eighth of the flush. Past the
# bound the longer blocks' tails run as node Reduces instead (two_level Note (unequal blocks)).
TWO_LEVEL_MAX_PADDING_SHARE = 0.125


@dataclass(frozen=True)
class PlacedPiece:
    """Elements ``[src_offset, src_offset + length)`` of gradient ``param_id`` sit at ``bucket_offset``; they
    reduce to DP rank ``root``, or to every rank when ``root`` is None."""

    param_id: int
    src_offset: int
    length: int
    bucket_offset: int
    root: int | None


@dataclass(frozen=True)
class PlacedGrad:
    """One gradient of the flush and its pieces (in source order; none for a zero-sized gradient)."""

    param_id: int
    numel: int
    pieces: tuple[PlacedPiece, ...]

    def segments(self, src_offset: int, length: int) -> list[tuple[int, int]]:
        """(bucket offset, elements) of the gradient's elements ``[src_offset, +length)``, in source order: one per
        piece they cross (a two-level flush cuts an owner's region at its pipeline stages)."""
        out, end = [], src_offset + length
        for piece in self.pieces:
            lo, hi = max(src_offset, piece.src_offset), min(end, piece.src_offset + piece.length)
            if lo < hi:
                out.append((piece.bucket_offset + lo - piece.src_offset, hi - lo))
        if sum(n for _, n in out) != length:
            raise ValueError(f"param_id {self.param_id}: elements [{src_offset}, +{length}) are not all placed "
                             f"({[(p.src_offset, p.length) for p in self.pieces]})")
        return out


@dataclass(frozen=True)
class OwnerLayout:
    grads: tuple[PlacedGrad, ...]  # in arrival order
    plan: FlushPlan  # counters as plan_flush counts them; ranges = the regions actually reduced (no padding)
    collectives: tuple[Collective, ...]
    padding: tuple[FlushRange, ...]  # zero-filled before the collectives: bucket elements a call reduces that
    # hold no gradient (a ReduceScatter's short regions, a hand-off's last chunk, alignment: ``alignment``)
    total: int  # bucket elements the layout spans, padding included
    transfers: tuple[Transfer, ...] = ()  # the hand-off's (``handoff`` only), by (destination, source)
    choice: str = ""  # the candidate that won (flush_choice.CANDIDATES)
    modelled_us: float = 0.0  # its alpha-beta time alone: its host issue, then its device time
    costs: tuple[tuple[str, float], ...] = ()  # every candidate considered and its modelled time (issue included)
    issue_us: float = 0.0  # the host's time to issue it (``host_cost``), part of ``modelled_us``
    stages: int = 0  # a two-level flush's pipeline stages (0: not two-level)
    ranks_per_node: int = 0  # a two-level flush's node communicator size (0: not two-level)
    rail_step: str = ""  # a two-level flush's rail step (``two_level`` Note (rail step))
    rail_layout: str = ""  # a two-level flush's layout over the rails (``two_level`` Note (balanced rails))
    stage_us: tuple[tuple[float, float], ...] = ()  # a two-level flush's modelled (node, rail) us per stage
    everyone_us: float = 0.0  # a two-level flush's modelled AllReduce of gradients that reach every rank

    @property
    def calls(self) -> int:
        """The calls one rank issues for this flush (the hand-off round counted as one; a two-level flush: its node's
        calls, the busiest rail's and the data-parallel ones, not every rail's), as the runtime's probe counts them."""
        rails: dict[int | None, int] = {}
        for c in self.collectives:
            if c.comm == RAIL:
                rails[c.rail] = rails.get(c.rail, 0) + 1
        return sum(c.comm != RAIL for c in self.collectives) + max(rails.values(), default=0)

    @property
    def algo(self) -> str:
        return algo_of_calls(self.collectives)


def _entries(grads: Sequence[tuple[int, int]]) -> list[BucketEntry]:
    entries, offset = [], 0
    for param_id, numel in grads:
        entries.append(BucketEntry(int(param_id), offset, int(numel)))
        offset += int(numel)
    return entries


def _packed_transfers(sizes: Sequence[int], chunk: int, slot_sizes: Sequence[int] | None = None
                      ) -> tuple[Transfer, ...]:
    """The hand-off after a ReduceScatter of owner regions packed back to back in their slots (region r of
    ``sizes[r]`` elements in a slot of ``slot_sizes[r]``, default its size; ascending r) cut into chunks of ``chunk``
    elements, chunk i reduced on rank i: each piece of a chunk that holds elements of another rank's region moves to
    that rank (its elements only, never the slot's padding). Ordered by (destination, source)."""
    transfers = []
    start = 0
    for owner, (size, slot) in enumerate(zip(sizes, sizes if slot_sizes is None else slot_sizes, strict=True)):
        end = start + size
        at = start
        while at < end:
            holder = at // chunk
            stop = min(end, (holder + 1) * chunk)
            if holder != owner:
                transfers.append(Transfer(holder, owner, at, stop - at))
            at = stop
        start += slot
    return tuple(transfers)


@dataclass(frozen=True)
class FlushAnalysis:
    """One flush before a candidate is laid out: its owner regions and every candidate's modelled time alone, its host
    issue included (the one-level candidates in ``costs``, of which ``issue`` is the host's part; the two-level
    pipelines in ``two_level``, each with the AllReduce of gradients that reach every rank after it: ``everyone_us``
    on the device, ``everyone_issue`` on the host). ``plan_owner_layout`` lays out the cheapest for the flush alone;
    the step's plan (``plan_step_layouts``) chooses among them for the whole step. ``native``: native DeepCompile's
    (device, host) us for the flush, the baseline (``FlushCost.native_parts``)."""

    entries: tuple[BucketEntry, ...]
    counted: FlushPlan
    regions: tuple[tuple[tuple[tuple[int, int], int, int, int], ...], ...]  # per rank: (key, param_id, offset, length)
    everyone: tuple[tuple[int, int, int], ...]  # (param_id, 0, numel) of the gradients that reach every rank
    costs: dict[str, float]
    transfers: tuple[Transfer, ...]  # the hand-off's, were it chosen
    per_rank: int
    chunk: int
    packed_span: int
    two_level: tuple[TwoLevelOption, ...] = ()
    everyone_us: float = 0.0
    force: str = AUTO
    reduce_pieces: tuple[int, ...] = ()  # per rank: the consecutive Reduces its region runs as (``aggregation``)
    issue: dict[str, float] = field(default_factory=dict)  # the host's part of each one-level candidate's time
    everyone_issue: float = 0.0
    native: tuple[float, float] = (0.0, 0.0)

    def times(self, choice: str, option: TwoLevelOption | None = None) -> FlushTimes:
        """``choice`` (``option``: its two-level pipeline) as the step's schedule sees it (``step_plan.FlushTimes``):
        device time and host issue."""
        if choice == TWO_LEVEL and option is not None:
            return FlushTimes(option.stage_us, self.everyone_us,
                              (*option.stage_issue, *((self.everyone_issue,) if self.everyone_us else ())))
        issue = self.issue.get(choice, 0.0)
        return FlushTimes(world_us=self.costs[choice] - issue, issue_us=(issue,))

    @property
    def native_times(self) -> FlushTimes:
        """Native DeepCompile's calls for this flush (the baseline), as the schedule sees them."""
        return FlushTimes(world_us=self.native[0], issue_us=(self.native[1],))
    align: int = 1  # elements per 16 bytes of the flush's dtype: where regions, blocks and chunks start (``alignment``)

    @property
    def sizes(self) -> list[int]:
        return [sum(p[3] for p in region) for region in self.regions]

    @property
    def calls(self) -> dict[str, int]:
        """The calls each candidate issues, for ties (they go to the fewest: ``flush_choice.choose``); two-level
        counted past native's, so a tie with it goes to a one-level candidate, as ``CANDIDATES``' order had it."""
        everyone = bool(self.everyone)
        return {REDUCE: sum(self.reduce_pieces) + everyone, REDUCE_SCATTER: 1 + everyone, HANDOFF: 2 + everyone,
                ALLREDUCE: 1, NATIVE: len(self.entries), TWO_LEVEL: len(self.entries) + 1}

    def one_level_choice(self) -> str:
        """The cheapest candidate that is not two-level (or the forced one)."""
        one_level = {k: v for k, v in self.costs.items() if k != TWO_LEVEL}
        return choose(one_level, self.force, self.calls)

    def best_two_level(self) -> TwoLevelOption | None:
        """The two-level pipeline fastest for the flush alone (ties: the first, ``TwoLevel.options``' order)."""
        return min(self.two_level, key=lambda o: self.times(TWO_LEVEL, o).alone_us, default=None)


def analyse_flush(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, reduce_to_owner: bool = True, *,
                  capacity: int | None = None, max_padding_share: float = MAX_PADDING_SHARE,
                  order: dict[int, int] | None = None, cost: FlushCost | None = None) -> FlushAnalysis:
    """Every candidate of one flush of ``grads`` ((param_id, numel) in arrival order) and its modelled time.

    ``capacity``: bucket elements available; a padded ReduceScatter's regions must fit in it (default: no limit).
    ``max_padding_share``: the most padding a padded ReduceScatter may add, as a share of the flush's elements.
    ``order``: param_id -> position in the owner map (``map_order``), to skip recomputing it per flush.
    ``cost``: the model that chooses (default: the world size's named topology, bf16, ``auto``).
    Without ``reduce_to_owner`` every gradient goes to the AllReduce region in arrival order.
    """
    entries = _entries(grads)
    counted = plan_flush(entries, owner_map, reduce_to_owner)  # counters, and validates the numels
    n = owner_map.dp_world_size
    cost = default_cost(n) if cost is None else cost
    order = map_order(owner_map) if order is None else order
    # (sort key, param_id, src_offset, length) per piece, by destination.
    regions: list[list[tuple[tuple[int, int], int, int, int]]] = [[] for _ in range(n)]
    everyone: list[tuple[int, int, int]] = []
    for entry in entries:
        placement = owner_map.placement(entry.param_id)
        owned = reduce_to_owner and (placement.placement is Placement.ONE_OWNER or placement.sliced)
        if not owned:
            if entry.numel:
                everyone.append((entry.param_id, 0, entry.numel))
            continue
        for piece in placement.slices:
            if piece.length:
                regions[piece.owner].append(((order[entry.param_id], piece.offset), entry.param_id, piece.offset,
                                             piece.length))
    for region in regions:
        region.sort()
    sizes = [sum(p[3] for p in region) for region in regions]
    owner_elems = sum(sizes)
    all_elems = sum(p[2] for p in everyone)

    # The candidates and their modelled times alone, host issue included (see flush_choice): ``issue`` holds the
    # host's part, the rest is device time. Packed: regions back to back from 0 in aligned slots, the AllReduce region
    # after them; for a hand-off, after world_size equal aligned chunks covering them (its span). A ReduceScatter's
    # blocks: the largest region, aligned. The padding these reduce is costed with them.
    align = align_elems(cost.dtype_bytes)
    slotted = sum(slots(sizes, align))
    chunk = align_up(-(-slotted // n), align) if owner_elems else 0
    packed_span = n * chunk if n > 1 else slotted
    per_rank = align_up(max(sizes, default=0), align)
    everyone_call = [(ALLREDUCE, all_elems)] if all_elems else []
    native_calls = [(ALLREDUCE, e.numel) for e in entries if e.numel]
    costs: dict[str, float] = {ALLREDUCE: cost.group_us([(ALLREDUCE, owner_elems + all_elems)]),
                               NATIVE: cost.group_us(native_calls)}  # native's calls issued by this runtime
    issue: dict[str, float] = {ALLREDUCE: cost.issue_us(1), NATIVE: cost.issue_us(len(native_calls))}
    transfers: tuple[Transfer, ...] = ()
    pieces: tuple[int, ...] = ()
    if owner_elems:
        pieces, costs[REDUCE] = reduce_pieces(sizes, everyone_call, cost.group_us)
        issue[REDUCE] = cost.issue_us(sum(pieces) + len(everyone_call))
        if n > 1:
            transfers = _packed_transfers(sizes, chunk, slots(sizes, align))
            scatter = cost.calls_us([(REDUCE_SCATTER, packed_span)] + everyone_call)
            # The hand-off's round is a second group, issued while the first runs: only what its issue exceeds the
            # first group's device time by is exposed (step_plan Note (host)).
            late = max(0.0, cost.issue_us(_p2p_calls(transfers)) - scatter)
            issue[HANDOFF] = cost.issue_us(1 + len(everyone_call))
            costs[HANDOFF] = issue[HANDOFF] + scatter + late + cost.handoff_us(transfers)
            pad = n * max(sizes) - owner_elems  # the bound is on equalising the regions; alignment adds < align each
            fits = capacity is None or n * per_rank + all_elems <= capacity
            if all(sizes) and fits and pad <= max_padding_share * counted.reduced_elems:
                costs[REDUCE_SCATTER] = cost.group_us([(REDUCE_SCATTER, n * per_rank)] + everyone_call)
                issue[REDUCE_SCATTER] = cost.issue_us(1 + len(everyone_call))
    options: tuple[TwoLevelOption, ...] = ()
    everyone_us = cost.calls_us(everyone_call) if everyone_call else 0.0
    everyone_issue = cost.issue_us(len(everyone_call))
    analysis = FlushAnalysis(tuple(entries), counted, tuple(tuple(r) for r in regions), tuple(everyone), costs,
                             transfers, per_rank, chunk, packed_span, options, everyone_us, cost.force, pieces, issue,
                             everyone_issue, cost.native_parts(e.numel for e in entries), align)
    if owner_elems and n > 1:
        options = cost.two_level_options(sizes, int(TWO_LEVEL_MAX_PADDING_SHARE * counted.reduced_elems))
        if options:
            analysis = replace(analysis, two_level=options)
            costs[TWO_LEVEL] = min(analysis.times(TWO_LEVEL, o).alone_us for o in options)
    return analysis


def _p2p_calls(transfers: Sequence[Transfer]) -> int:
    """The most sends and receives one rank issues in a hand-off round of ``transfers``."""
    calls: dict[int, int] = {}
    for t in transfers:
        calls[t.src] = calls.get(t.src, 0) + 1
        calls[t.dst] = calls.get(t.dst, 0) + 1
    return max(calls.values(), default=0)


def plan_owner_layout(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, reduce_to_owner: bool = True, *,
                      capacity: int | None = None, max_padding_share: float = MAX_PADDING_SHARE,
                      order: dict[int, int] | None = None, cost: FlushCost | None = None) -> OwnerLayout:
    """Lay out one flush of ``grads`` for the candidate that runs when the flush is costed alone (``analyse_flush``'s
    arguments). A learned schedule's flushes are chosen together instead (``plan_step_layouts``)."""
    analysis = analyse_flush(grads, owner_map, reduce_to_owner, capacity=capacity,
                             max_padding_share=max_padding_share, order=order, cost=cost)
    choice = choose(analysis.costs, analysis.force, analysis.calls)
    return build_layout(analysis, choice, analysis.best_two_level() if choice == TWO_LEVEL else None)


def build_layout(analysis: FlushAnalysis, choice: str, option: TwoLevelOption | None = None) -> OwnerLayout:
    """``analysis``'s flush laid out for ``choice`` (``option``: the two-level pipeline, for ``two_level``)."""
    entries, counted, costs = analysis.entries, analysis.counted, analysis.costs
    regions, everyone, sizes = analysis.regions, analysis.everyone, analysis.sizes
    if choice == NATIVE:
        return replace(_native_layout(entries, counted, costs, analysis.align), issue_us=analysis.issue[NATIVE])
    if choice == TWO_LEVEL:
        if option is None:
            raise ValueError("owner_reduce: a two-level layout needs its pipeline (TwoLevelOption)")
        times = analysis.times(TWO_LEVEL, option)
        return replace(_two_level_layout(entries, counted, costs, regions, sizes, everyone, option, times.alone_us,
                                         analysis.everyone_us), issue_us=times.host_us)
    n = len(regions)
    per_rank, chunk, packed_span, transfers = analysis.per_rank, analysis.chunk, analysis.packed_span, \
        analysis.transfers
    all_elems = sum(p[2] for p in everyone)
    placed: dict[int, list[PlacedPiece]] = {e.param_id: [] for e in entries}
    ranges: list[FlushRange] = []
    collectives: list[Collective] = []
    padding: list[FlushRange] = []
    owner_root = choice != ALLREDUCE  # AllReduce: every rank receives the owner regions too
    align = analysis.align if owner_root else 1  # one AllReduce from 0: no region needs to start aligned
    offset = 0
    for rank, region in enumerate(regions):
        start = rank * per_rank if choice == REDUCE_SCATTER else offset
        offset = start
        for _, param_id, src_offset, length in region:
            placed[param_id].append(PlacedPiece(param_id, src_offset, length, offset, rank if owner_root else ALL))
            offset += length
        if sizes[rank]:
            ranges.append(FlushRange(start, sizes[rank], rank if owner_root else ALL))
            if choice == REDUCE:  # one Reduce per owner, or its region cut so NCCL aggregates them (``aggregation``)
                at = start
                for part in aligned_cut(sizes[rank], analysis.reduce_pieces[rank], align):
                    if part:
                        collectives.append(Collective(REDUCE, at, part, rank))
                    at += part
        if choice == REDUCE_SCATTER and sizes[rank] < per_rank:
            padding.append(FlushRange(offset, per_rank - sizes[rank], rank))
            offset = start + per_rank
        elif offset % align:  # the region's slot: the next region starts aligned
            if choice == HANDOFF:  # inside the ReduceScatter's span: reduced, so zeros
                padding.append(FlushRange(offset, align_up(offset, align) - offset, rank))
            offset = align_up(offset, align)
    if choice == REDUCE_SCATTER:
        collectives.insert(0, Collective(REDUCE_SCATTER, 0, n * per_rank, per_rank=per_rank))
    elif choice == HANDOFF:
        if offset < packed_span:  # the last chunk's tail: zeros, reduced and never read
            padding.append(FlushRange(offset, packed_span - offset, ALL))
            offset = packed_span
        collectives.insert(0, Collective(REDUCE_SCATTER, 0, packed_span, per_rank=chunk))
    if all_elems and choice != ALLREDUCE:
        collectives.append(Collective(ALLREDUCE, offset, all_elems))
    offset = _place_everyone(everyone, placed, ranges, offset)
    if choice == ALLREDUCE and offset:
        collectives.append(Collective(ALLREDUCE, 0, offset))
    if choice == HANDOFF and transfers:  # chunks that fall exactly on their owners' regions need no hand-off
        collectives.append(Collective(HANDOFF, 0, packed_span))
    plan = replace(counted, ranges=merge_ranges(ranges) if choice == ALLREDUCE else tuple(ranges))
    if choice == ALLREDUCE:
        plan = replace(plan, owner_tasks=0, owner_elems=0)
    return OwnerLayout(grads=_placed_grads(entries, placed), plan=plan, collectives=tuple(collectives),
                       padding=tuple(padding), total=offset,
                       transfers=transfers if choice == HANDOFF else (), choice=choice,
                       modelled_us=costs[choice], costs=tuple(sorted(costs.items())),
                       issue_us=analysis.issue.get(choice, 0.0))


def _two_level_layout(entries: Sequence[BucketEntry], counted: FlushPlan, costs: dict[str, float],
                      regions: Sequence[Sequence[tuple[tuple[int, int], int, int, int]]], sizes: Sequence[int],
                      everyone: Sequence[tuple[int, int, int]], option: TwoLevelOption,
                      modelled_us: float, everyone_us: float) -> OwnerLayout:
    """The two-level flush (``two_level``): owner regions in their local rank's block (each in its aligned slot),
    blocks cut into the option's stages (``TwoLevelGeometry``: ReduceScatter stages ``[stage][local rank][slice]``, the
    shorter blocks zero-padded there, then the longer blocks' tails packed), its rail step's calls; the AllReduce
    region after them."""
    geo = option.geometry
    ranks_per_node = geo.ranks_per_node
    placed: dict[int, list[PlacedPiece]] = {e.param_id: [] for e in entries}
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
    collectives, ranges, padding, transfers = two_level_calls(sizes, geo, option.rail_step, option.rail_layout)
    collectives, ranges = list(collectives), list(ranges)
    all_elems = sum(p[2] for p in everyone)
    if all_elems:
        collectives.append(Collective(ALLREDUCE, geo.span, all_elems))
    offset = _place_everyone(everyone, placed, ranges, geo.span)
    return OwnerLayout(grads=_placed_grads(entries, placed), plan=replace(counted, ranges=tuple(ranges)),
                       collectives=tuple(collectives), padding=padding, total=offset, transfers=transfers,
                       choice=TWO_LEVEL, modelled_us=modelled_us, costs=tuple(sorted(costs.items())),
                       stages=geo.stages, ranks_per_node=ranks_per_node, rail_step=option.rail_step,
                       rail_layout=option.rail_layout,
                       stage_us=option.stage_us, everyone_us=everyone_us)


def _place_balanced(regions: Sequence[Sequence[tuple[tuple[int, int], int, int, int]]], sizes: Sequence[int],
                    geo: TwoLevelGeometry, placed: dict[int, list[PlacedPiece]]) -> None:
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


def plan_step_layouts(flushes: Sequence[tuple[Any, Sequence[tuple[int, int]]]], owner_map: OwnerMap,
                      reduce_to_owner: bool, *, capacity: int, cost_of: Callable[[Any], FlushCost],
                      order: dict[int, int] | None = None, per_bucket: int = 2) -> StepLayouts:
    """A learned schedule's flushes ((dtype key, grads) in the order they happen), laid out for the step's plan
    (``step_plan``): each flush's candidates analysed (``analyse_flush``), every flush's options chosen together on
    the node and rail streams (two-level pipelines of consecutive flushes overlap), then laid out. ``cost_of(dtype)``:
    the model for a dtype's bytes; ``per_bucket``: buffers a dtype keeps (two with double buffering)."""
    order = map_order(owner_map) if order is None else order
    analyses = [analyse_flush(grads, owner_map, reduce_to_owner, order=order, cost=cost_of(dtype),
                              capacity=max([capacity] + [n for _, n in grads])) for dtype, grads in flushes]
    options: list[list[tuple[FlushTimes, str, TwoLevelOption | None]]] = []
    for a in analyses:
        two_level = sorted(((a.times(TWO_LEVEL, o), TWO_LEVEL, o) for o in a.two_level),
                           key=lambda t: t[0].alone_us)
        if a.force == TWO_LEVEL and two_level:  # forced: two-level only, the fastest alone its fallback
            options.append(two_level)
            continue
        one_level = a.one_level_choice()
        options.append([(a.times(one_level), one_level, None)] + (two_level if a.force == AUTO else []))
    keys = {dtype: i for i, dtype in enumerate(dict.fromkeys(d for d, _ in flushes))}
    plan = plan_step([[t for t, _, _ in flush] for flush in options], [a.native_times for a in analyses],
                     [keys[d] for d, _ in flushes], per_bucket)
    picked = tuple(options[i][j][1:] for i, j in enumerate(plan.picks))
    layouts = tuple(build_layout(a, *pick) for a, pick in zip(analyses, picked, strict=True))
    return StepLayouts(layouts, plan, per_bucket, picked)


def cost_step_choices(flushes: Sequence[tuple[Any, Sequence[tuple[int, int]]]], owner_map: OwnerMap,
                      step: StepLayouts, *, capacity: int, cost_of: Callable[[Any], FlushCost],
                      order: dict[int, int] | None = None) -> StepPlan:
    """``step``'s choices (each flush's candidate, a two-level flush's geometry and rail step), made under one
    model, costed under ``cost_of`` and scheduled as the runtime runs them: what a plan made at full bandwidth costs
    where the network delivers less (the sizing's hand-off sensitivity). ``flushes`` as for ``plan_step_layouts``."""
    order = map_order(owner_map) if order is None else order
    times: list[FlushTimes] = []
    native: list[FlushTimes] = []
    for (dtype, grads), (choice, option) in zip(flushes, step.choices, strict=True):
        cost = cost_of(dtype)
        a = analyse_flush(grads, owner_map, True, order=order, cost=cost,
                          capacity=max([capacity] + [n for _, n in grads]))
        native.append(a.native_times)
        if choice == TWO_LEVEL and option is not None and cost.two_level is not None:
            times.append(a.times(TWO_LEVEL, cost.two_level.recost(a.sizes, option, cost.dtype_bytes,
                                                                  cost.host_cost)))
        else:
            times.append(a.times(choice))
    keys = {dtype: i for i, dtype in enumerate(dict.fromkeys(d for d, _ in flushes))}
    steps = schedule(times, [keys[d] for d, _ in flushes], step.per_bucket)
    return StepPlan((0,) * len(times), steps, native_step_us(native), tuple(times))


@dataclass(frozen=True)
class StepLayouts:
    """A step's flushes laid out for its plan (``plan_step_layouts``), and the plan's schedule."""

    layouts: tuple[OwnerLayout, ...]
    plan: StepPlan
    per_bucket: int
    choices: tuple[tuple[str, TwoLevelOption | None], ...] = ()  # per flush: its candidate and two-level pipeline


def _place_everyone(everyone: Sequence[tuple[int, int, int]], placed: dict[int, list[PlacedPiece]],
                    ranges: list[FlushRange], offset: int) -> int:
    """Place the gradients that reach every rank back to back from ``offset`` (their range appended to ``ranges``);
    return the offset after them."""
    all_elems = sum(p[2] for p in everyone)
    if all_elems:
        ranges.append(FlushRange(offset, all_elems, ALL))
    for param_id, src_offset, length in everyone:
        placed[param_id].append(PlacedPiece(param_id, src_offset, length, offset, ALL))
        offset += length
    return offset


def _placed_grads(entries: Sequence[BucketEntry], placed: dict[int, list[PlacedPiece]]) -> tuple[PlacedGrad, ...]:
    """Every gradient of the flush with its pieces in source order."""
    return tuple(PlacedGrad(e.param_id, e.numel, tuple(sorted(placed[e.param_id], key=lambda p: p.src_offset)))
                 for e in entries)


def _native_layout(entries: Sequence[BucketEntry], counted: FlushPlan, costs: dict[str, float],
                   align: int = 1) -> OwnerLayout:
    """What DeepCompile's own runtime sends (z1.cpp / z2.cpp): every gradient whole, in arrival order, one
    AllReduce each, in one group; every rank receives everything and keeps its share. Each gradient starts aligned
    (``alignment``; DeepCompile packs them back to back); the gaps are never reduced."""
    grads, collectives, offset, end = [], [], 0, 0
    for e in entries:
        offset = align_up(end, align)
        pieces = (PlacedPiece(e.param_id, 0, e.numel, offset, ALL),) if e.numel else ()
        grads.append(PlacedGrad(e.param_id, e.numel, pieces))
        if e.numel:
            collectives.append(Collective(ALLREDUCE, offset, e.numel))
            end = offset + e.numel
    plan = replace(counted, ranges=merge_ranges(FlushRange(c.offset, c.count, ALL) for c in collectives),
                   owner_tasks=0, owner_elems=0)
    return OwnerLayout(grads=tuple(grads), plan=plan, collectives=tuple(collectives), padding=(), total=end,
                       choice=NATIVE, modelled_us=costs[NATIVE], costs=tuple(sorted(costs.items())))


def default_cost(world_size: int, dtype_bytes: int = 2) -> FlushCost:
    """The cost model of a world size's named topology (``collective_time.named_topology``, as the sizing uses);
    without one every candidate costs 0 and the fewest calls win."""
    return FlushCost(named_topology(world_size), dtype_bytes)


def map_order(owner_map: OwnerMap) -> dict[int, int]:
    """param_id -> position in the owner map (group order, then the group's parameter order: ZeRO's flat order)."""
    return {p.param_id: i for i, p in enumerate(owner_map)}


def plan_placed(grads: Sequence[PlacedGrad], owner_map: OwnerMap, reduce_to_owner: bool) -> FlushPlan:
    """The plan of a flush holding only ``grads`` of a layout (a step that left the schedule): each piece
    reduces where the layout put it; adjacent pieces with the same root merge; holes are not reduced."""
    counted = plan_flush(_entries([(g.param_id, g.numel) for g in grads]), owner_map, reduce_to_owner)
    pieces = sorted((p for g in grads for p in g.pieces), key=lambda p: p.bucket_offset)
    return replace(counted, ranges=merge_ranges(FlushRange(p.bucket_offset, p.length, p.root) for p in pieces))
