"""The owner-ordered bucket layout: where each gradient (or slice) of a flush goes, and which collectives run.

Why: gradients reach the bucket in backward order (partitions descending) while a straddler's slices ascend,
so in arrival order the owners interleave and a flush costs one collective per run of owners (142 at ws 64 for
GPT-2 124M in one flush). Placing every gradient, or every slice of a straddling one, into its owner's region
(regions in ascending rank order, AllReduce-only entries after them) makes a flush cost one Reduce per owner it
touches plus at most one AllReduce; and when a flush covers every rank of the group with counts that are equal
after padding the short regions with a few zeros, the owner regions are exactly a ReduceScatter's input, so the
flush is one collective. An owner-ordered bucket is ZeRO's own flat partition layout.

Pure and deterministic: the layout is a function of (the flush's gradients in arrival order, the owner map,
the bucket capacity) only, so every rank computes the same one without communicating. Within an owner region
pieces follow the owner map's parameter order (the order of ZeRO's flat buffer), then their offset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .flush_plan import ALL, BucketEntry, FlushPlan, FlushRange, merge_ranges, plan_flush
from .owner_map import OwnerMap, Placement

MAX_PADDING_SHARE = 0.01  # a ReduceScatter may pad the short regions by at most 1% of the flush's elements

REDUCE_SCATTER = "reduce_scatter"
REDUCE = "reduce"
ALLREDUCE = "allreduce"


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

    def locate(self, src_offset: int, length: int) -> int:
        """Bucket offset of the gradient's elements ``[src_offset, +length)``, which must lie in one piece."""
        for piece in self.pieces:
            if piece.src_offset <= src_offset and src_offset + length <= piece.src_offset + piece.length:
                return piece.bucket_offset + src_offset - piece.src_offset
        raise ValueError(f"param_id {self.param_id}: elements [{src_offset}, +{length}) are not in one placed piece "
                         f"({[(p.src_offset, p.length) for p in self.pieces]})")


@dataclass(frozen=True)
class Collective:
    """One call of the flush: ``kind`` over bucket elements ``[offset, offset + count)``.

    ``reduce_scatter``: ``count`` is ``world_size * per_rank``; rank r keeps ``[offset + r * per_rank, +per_rank)``.
    ``reduce``: to ``root``. ``allreduce``: to every rank.
    """

    kind: str
    offset: int
    count: int
    root: int | None = None
    per_rank: int = 0


@dataclass(frozen=True)
class OwnerLayout:
    grads: tuple[PlacedGrad, ...]  # in arrival order
    plan: FlushPlan  # counters as plan_flush counts them; ranges = the regions actually reduced (no padding)
    collectives: tuple[Collective, ...]
    padding: tuple[FlushRange, ...]  # zero-filled before the collectives (ReduceScatter only)
    total: int  # bucket elements the layout spans, padding included

    @property
    def calls(self) -> int:
        return len(self.collectives)

    @property
    def algo(self) -> str:
        return algo_of(c.kind for c in self.collectives)


def algo_of(kinds: Iterable[str]) -> str:
    """The probe's ``algo=`` value: the kinds of call a flush issued, in a fixed order, ``+``-joined."""
    present = set(kinds)
    return "+".join(k for k in (REDUCE_SCATTER, REDUCE, ALLREDUCE) if k in present) or "none"


def collectives_of(ranges: Sequence[FlushRange]) -> tuple[Collective, ...]:
    """The calls of a plain (arrival-order) flush plan: one per range."""
    return tuple(Collective(ALLREDUCE, r.offset, r.count) if r.root is ALL else Collective(REDUCE, r.offset, r.count,
                                                                                          r.root) for r in ranges)


def _entries(grads: Sequence[tuple[int, int]]) -> list[BucketEntry]:
    entries, offset = [], 0
    for param_id, numel in grads:
        entries.append(BucketEntry(int(param_id), offset, int(numel)))
        offset += int(numel)
    return entries


def plan_owner_layout(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, reduce_to_owner: bool = True, *,
                      capacity: int | None = None, max_padding_share: float = MAX_PADDING_SHARE,
                      order: dict[int, int] | None = None) -> OwnerLayout:
    """Lay out one flush of ``grads`` ((param_id, numel) in arrival order).

    ``capacity``: bucket elements available; a ReduceScatter's padding must fit in it (default: no limit).
    ``order``: param_id -> position in the owner map (``map_order``), to skip recomputing it per flush.
    Without ``reduce_to_owner`` every gradient goes to the AllReduce region in arrival order.
    """
    entries = _entries(grads)
    counted = plan_flush(entries, owner_map, reduce_to_owner)  # counters, and validates the numels
    n = owner_map.dp_world_size
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
    per_rank = max(sizes, default=0)
    pad = n * per_rank - owner_elems
    fits = capacity is None or n * per_rank + all_elems <= capacity
    scatter = (reduce_to_owner and n > 1 and all(sizes) and fits
               and pad <= max_padding_share * counted.reduced_elems)

    placed: dict[int, list[PlacedPiece]] = {e.param_id: [] for e in entries}
    ranges: list[FlushRange] = []
    collectives: list[Collective] = []
    padding: list[FlushRange] = []
    offset = 0
    for rank, region in enumerate(regions):
        start = rank * per_rank if scatter else offset
        offset = start
        for _, param_id, src_offset, length in region:
            placed[param_id].append(PlacedPiece(param_id, src_offset, length, offset, rank))
            offset += length
        if sizes[rank]:
            ranges.append(FlushRange(start, sizes[rank], rank))
            if not scatter:
                collectives.append(Collective(REDUCE, start, sizes[rank], rank))
        if scatter and sizes[rank] < per_rank:
            padding.append(FlushRange(offset, per_rank - sizes[rank], rank))
            offset = start + per_rank
    if scatter:
        collectives.insert(0, Collective(REDUCE_SCATTER, 0, n * per_rank, per_rank=per_rank))
    if all_elems:
        ranges.append(FlushRange(offset, all_elems, ALL))
        collectives.append(Collective(ALLREDUCE, offset, all_elems))
        for param_id, src_offset, length in everyone:
            placed[param_id].append(PlacedPiece(param_id, src_offset, length, offset, ALL))
            offset += length
    out = tuple(PlacedGrad(e.param_id, e.numel, tuple(sorted(placed[e.param_id], key=lambda p: p.src_offset)))
                for e in entries)
    return OwnerLayout(grads=out, plan=replace(counted, ranges=tuple(ranges)), collectives=tuple(collectives),
                       padding=tuple(padding), total=offset)


def map_order(owner_map: OwnerMap) -> dict[int, int]:
    """param_id -> position in the owner map (group order, then the group's parameter order: ZeRO's flat order)."""
    return {p.param_id: i for i, p in enumerate(owner_map)}


def plan_placed(grads: Sequence[PlacedGrad], owner_map: OwnerMap, reduce_to_owner: bool) -> FlushPlan:
    """The plan of a flush holding only ``grads`` of a layout (a step that left the schedule): each piece
    reduces where the layout put it; adjacent pieces with the same root merge; holes are not reduced."""
    counted = plan_flush(_entries([(g.param_id, g.numel) for g in grads]), owner_map, reduce_to_owner)
    pieces = sorted((p for g in grads for p in g.pieces), key=lambda p: p.bucket_offset)
    return replace(counted, ranges=merge_ranges(FlushRange(p.bucket_offset, p.length, p.root) for p in pieces))
