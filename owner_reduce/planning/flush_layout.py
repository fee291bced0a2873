"""A laid-out flush as data, the facts every algorithm lays one out from, and the placement steps they share.

Why a module of its own: each algorithm (``planning.algorithms``, one module each) costs a flush from the same facts
(``FlushFacts``: its owner regions, the gradients that reach every rank, the packed geometry) and returns the same
kind of layout (``OwnerLayout``); ``owner_layout`` makes the facts and picks, the algorithms import only this, so
neither imports the other. Pure: numbers in, a layout out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .alignment import align_up
from .calls import ALLREDUCE, RAIL, CallKind
from .collectives import Collective, Transfer, algo_of_calls
from .flush_plan import ALL, BucketEntry, FlushPlan, FlushRange

if TYPE_CHECKING:
    from .host_cost import HostCost
    from .two_level import TwoLevel


class CostModel(Protocol):
    """What an algorithm reads of the flush's cost model (``flush_choice.FlushCost`` is the one there is).

    Why a protocol here: ``flush_choice`` picks among the registered algorithms, so it imports their registry; were
    the algorithms to name ``FlushCost``, even for their annotations, the two would import each other."""

    @property
    def dtype_bytes(self) -> int: ...

    @property
    def two_level(self) -> TwoLevel | None: ...

    @property
    def host_cost(self) -> HostCost: ...

    def calls_us(self, calls: Iterable[tuple[str, int]]) -> float: ...

    def group_us(self, calls: Sequence[tuple[str, int]]) -> float: ...

    def issue_us(self, calls: int, groups: int = 1, stages: int = 0) -> float: ...

    def handoff_us(self, transfers: Sequence[Transfer]) -> float: ...


class RegionPiece(NamedTuple):
    """A piece of an owner region: gradient ``param_id``'s elements ``[src_offset, +length)``. ``key`` orders a
    region's pieces: (the gradient's place in the owner map, ``src_offset``), ZeRO's flat order."""

    key: tuple[int, int]
    param_id: int
    src_offset: int
    length: int


class EveryonePiece(NamedTuple):
    """A gradient that reaches every rank (AllReduce-only: another communicator, a whole-gradient optimizer, or the
    owner path off): its elements ``[src_offset, +length)``."""

    param_id: int
    src_offset: int
    length: int


@dataclass(frozen=True)
class FlushFacts:
    """One flush before an algorithm lays it out (``owner_layout.analyse_flush`` makes it): what every algorithm's cost
    and layout read.

    ``regions[r]``: owner ``r``'s pieces in map order; ``sizes[r]`` their elements. ``align``: elements per 16 bytes of
    the dtype (``alignment``). Packed (regions back to back in aligned slots): ``chunk`` a hand-off's per-rank chunk,
    ``packed_span`` its ReduceScatter's span, ``per_rank`` a ReduceScatter's block (the largest region, aligned).
    ``everyone_call``: the AllReduce of the gradients that reach every rank (none without them); ``everyone_us`` and
    ``everyone_issue`` its device and host time. ``native``: native DeepCompile's (device, host) us, the baseline.
    ``capacity``, ``max_padding_share``, ``two_level_max_padding_share``: the bounds the caller set."""

    entries: tuple[BucketEntry, ...]
    counted: FlushPlan
    regions: tuple[tuple[RegionPiece, ...], ...]
    everyone: tuple[EveryonePiece, ...]
    sizes: tuple[int, ...]
    cost: CostModel
    align: int
    per_rank: int
    chunk: int
    packed_span: int
    everyone_call: tuple[tuple[CallKind, int], ...]
    everyone_us: float
    everyone_issue: float
    native: tuple[float, float]
    force: str
    capacity: int | None
    max_padding_share: float
    two_level_max_padding_share: float

    @property
    def world_size(self) -> int:
        return len(self.regions)

    @property
    def owner_elems(self) -> int:
        return sum(self.sizes)


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
    choice: str = ""  # the algorithm that won (its name in the registry, ``planning.algorithms``)
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


def entries_of(grads: Sequence[tuple[int, int]]) -> list[BucketEntry]:
    """(param_id, numel) in arrival order as bucket entries back to back from 0."""
    entries, offset = [], 0
    for param_id, numel in grads:
        entries.append(BucketEntry(int(param_id), offset, int(numel)))
        offset += int(numel)
    return entries


class Packed(NamedTuple):
    """Owner regions placed in the bucket (``pack_regions``): each gradient's pieces so far, the ranges each owner
    receives, the padding, where each region starts, and the offset after the last."""

    placed: dict[int, list[PlacedPiece]]
    ranges: list[FlushRange]
    padding: list[FlushRange]
    starts: list[int]
    end: int


def pack_regions(facts: FlushFacts, *, owners: bool = True, stride: int | None = None,
                 zero_slot_tails: bool = False) -> Packed:
    """The owner regions in rank order from 0, each in a slot of its size rounded up to ``facts.align`` (the next region
    starts aligned: ``alignment``). ``stride``: region ``r`` at ``r x stride`` instead, its short tail zero padding
    with ``r`` as root (a ReduceScatter's blocks). ``owners``: each piece reduces to its region's rank; else to every
    rank, unaligned (one AllReduce from 0 needs no alignment). ``zero_slot_tails``: a slot's tail lies inside a call's
    span (a hand-off's ReduceScatter), so it is padding, zero-filled."""
    align = facts.align if owners else 1
    placed: dict[int, list[PlacedPiece]] = {e.param_id: [] for e in facts.entries}
    ranges: list[FlushRange] = []
    padding: list[FlushRange] = []
    starts: list[int] = []
    offset = 0
    for rank, region in enumerate(facts.regions):
        start = rank * stride if stride is not None else offset
        offset = start
        starts.append(start)
        root = rank if owners else ALL
        for piece in region:
            placed[piece.param_id].append(PlacedPiece(piece.param_id, piece.src_offset, piece.length, offset, root))
            offset += piece.length
        size = facts.sizes[rank]
        if size:
            ranges.append(FlushRange(start, size, root))
        if stride is not None and size < stride:
            padding.append(FlushRange(offset, stride - size, rank))
            offset = start + stride
        elif offset % align:  # the region's slot: the next region starts aligned
            if zero_slot_tails:
                padding.append(FlushRange(offset, align_up(offset, align) - offset, rank))
            offset = align_up(offset, align)
    return Packed(placed, ranges, padding, starts, offset)


def place_everyone(everyone: Sequence[EveryonePiece], placed: dict[int, list[PlacedPiece]],
                   ranges: list[FlushRange], offset: int) -> int:
    """Place the gradients that reach every rank back to back from ``offset`` (their range appended to ``ranges``);
    return the offset after them."""
    all_elems = sum(p.length for p in everyone)
    if all_elems:
        ranges.append(FlushRange(offset, all_elems, ALL))
    for param_id, src_offset, length in everyone:
        placed[param_id].append(PlacedPiece(param_id, src_offset, length, offset, ALL))
        offset += length
    return offset


def placed_grads(entries: Sequence[BucketEntry], placed: dict[int, list[PlacedPiece]]) -> tuple[PlacedGrad, ...]:
    """Every gradient of the flush with its pieces in source order."""
    return tuple(PlacedGrad(e.param_id, e.numel, tuple(sorted(placed[e.param_id], key=lambda p: p.src_offset)))
                 for e in entries)


def owner_regions_layout(facts: FlushFacts, packed: Packed, calls: Sequence[Collective], end: int, *,
                         after: Sequence[Collective] = (), transfers: tuple[Transfer, ...] = ()) -> OwnerLayout:
    """A one-level layout of ``packed`` owner regions ending at ``end``, whose owner calls are ``calls``: the gradients
    that reach every rank placed after them with one AllReduce (after ``calls``, before ``after``: a hand-off's
    marker), every owner receiving its region."""
    all_elems = sum(p.length for p in facts.everyone)
    collectives = list(calls)
    if all_elems:
        collectives.append(Collective(ALLREDUCE, end, all_elems))
    collectives += after
    ranges = list(packed.ranges)
    total = place_everyone(facts.everyone, packed.placed, ranges, end)
    return OwnerLayout(grads=placed_grads(facts.entries, packed.placed), plan=replace(facts.counted,
                                                                                     ranges=tuple(ranges)),
                       collectives=tuple(collectives), padding=tuple(packed.padding), total=total, transfers=transfers)


def packed_transfers(sizes: Sequence[int], chunk: int, slot_sizes: Sequence[int] | None = None) -> tuple[Transfer, ...]:
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
