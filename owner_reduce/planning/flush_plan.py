"""The flush plan: which collective covers which range of a reduce bucket, decided before any is issued.

Why plan first: NCCL needs every rank to issue the same collectives in the same order inside a group, and
the owner map is identical on every rank, so a plan computed from (bucket entries, owner map) alone is
identical everywhere. Adjacent ranges with the same root are merged, so a flush issues one collective per
run of owners, not one per parameter. Pure: no torch.distributed, no cupy, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .owner_map import OwnerMap, Placement

ALL = None  # the root of a range that every rank receives (AllReduce)


@dataclass(frozen=True)
class BucketEntry:
    """One gradient in a bucket: elements ``[offset, offset + numel)`` of the bucket, parameter ``param_id``."""

    param_id: int
    offset: int
    numel: int


@dataclass(frozen=True)
class FlushRange:
    """Bucket elements ``[offset, offset + count)`` reduce to DP rank ``root``, or to every rank when None."""

    offset: int
    count: int
    root: int | None


@dataclass(frozen=True)
class FlushPlan:
    ranges: tuple[FlushRange, ...]
    tasks: int  # gradients in the flush
    reduced_elems: int  # elements in the flush
    owner_tasks: int  # gradients that take the owner path
    owner_elems: int
    eligible_tasks: int  # gradients that could take it (single owner), whether or not the flag is on
    eligible_elems: int

    def received_elems(self, rank: int) -> int:
        """Elements whose reduced result reaches ``rank``."""
        return sum(r.count for r in self.ranges if r.root is ALL or r.root == rank)


def _append_merged(ranges: list[FlushRange], r: FlushRange) -> None:
    """Append ``r``, merged into the last range when it continues it with the same root; empty ones vanish."""
    if r.count == 0:
        return
    if ranges and ranges[-1].root == r.root and ranges[-1].offset + ranges[-1].count == r.offset:
        last = ranges[-1]
        ranges[-1] = FlushRange(last.offset, last.count + r.count, r.root)
    else:
        ranges.append(r)


def merge_ranges(ranges: Iterable[FlushRange]) -> tuple[FlushRange, ...]:
    """Ranges in bucket order with adjacent same-root ones merged (one collective per run)."""
    out: list[FlushRange] = []
    for r in ranges:
        _append_merged(out, r)
    return tuple(out)


def plan_flush(entries: Sequence[BucketEntry], owner_map: OwnerMap, reduce_to_owner: bool,
               slice_straddlers: bool = True) -> FlushPlan:
    """Ranges in bucket order. With ``reduce_to_owner``, single-owner gradients go to their owner and (with
    ``slice_straddlers``) each partition's slice of a straddling gradient goes to that partition's owner, as
    DeepSpeed's eager stage-2 ``average_tensor`` does; everything else is AllReduced."""
    ranges: list[FlushRange] = []
    owner_tasks = owner_elems = eligible_tasks = eligible_elems = 0

    def add(offset: int, count: int, root: int | None) -> None:
        _append_merged(ranges, FlushRange(offset, count, root))
    expected_offset = entries[0].offset if entries else 0
    for entry in entries:
        if entry.offset != expected_offset:
            raise ValueError(f"bucket entries must be contiguous: param_id {entry.param_id} at {entry.offset}, "
                             f"expected {expected_offset}")
        expected_offset += entry.numel
        placement = owner_map.placement(entry.param_id)
        if placement.numel != entry.numel:
            raise ValueError(f"param_id {entry.param_id}: bucket holds {entry.numel} elements, the owner map "
                             f"{placement.numel}")
        eligible = placement.placement is Placement.ONE_OWNER or (slice_straddlers and placement.sliced)
        if eligible:
            eligible_tasks += 1
            eligible_elems += entry.numel
        if not (eligible and reduce_to_owner):
            add(entry.offset, entry.numel, ALL)
            continue
        owner_tasks += 1
        owner_elems += entry.numel
        for piece in placement.slices:
            add(entry.offset + piece.offset, piece.length, piece.owner)
    return FlushPlan(ranges=tuple(ranges),
                     tasks=len(entries),
                     reduced_elems=sum(e.numel for e in entries),
                     owner_tasks=owner_tasks,
                     owner_elems=owner_elems,
                     eligible_tasks=eligible_tasks,
                     eligible_elems=eligible_elems)
