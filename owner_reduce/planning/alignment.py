"""Where a flush's calls may start in the bucket: at 16-byte boundaries, so that NCCL moves 16-byte packs.

Why: NCCL's ``reduceCopy`` (src/device/common_kernel.h 221-238, NCCL v2.30.7-1), the loop every collective and every
send/recv runs on its buffers, checks that all of a step's source and destination pointers are 16-byte aligned (one
``__all_sync`` over the warp) and only then moves 16-byte packs; otherwise the whole call runs on packs of one element,
2 bytes for bf16. The bucket's buffer starts aligned (``runtime.buckets`` Note (alignment)), so a call is aligned when
its bucket offset is a multiple of 16 bytes: ``align_elems(element size)`` elements, 8 for bf16 and fp16, 4 for fp32.

The layouts (``owner_layout``, ``two_level``) therefore give each owner region a slot of its size rounded up to the
alignment (``align_up``): its elements first, then fewer than ``align`` elements of padding, zero-filled before the
calls wherever a call reduces them and never copied out. Stage slices, ReduceScatter blocks and hand-off chunks are
multiples of the alignment, and a region cut into parts is cut at multiples of it (``aligned_cut``). A padded element
that a call reduces is a byte NCCL moves, so the cost model counts it there.

Pure: integers in, integers out; the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

PACK_BYTES = 16  # NCCL's BigPackSize for plain (non-multimem) pointers: common_kernel.h 213


def align_elems(dtype_bytes: int) -> int:
    """Elements per 16-byte pack of a ``dtype_bytes`` dtype (1 for a dtype of 16 bytes or more)."""
    return max(1, PACK_BYTES // dtype_bytes)


def align_up(count: int, align: int) -> int:
    """``count`` rounded up to a multiple of ``align``."""
    return -(-count // align) * align


def slots(sizes: Sequence[int], align: int) -> list[int]:
    """Each owner region's slot: its size rounded up to the alignment (an empty region has none)."""
    return [-(-n // align) * align for n in sizes]


def aligned_cut(count: int, pieces: int, align: int) -> tuple[int, ...]:
    """``count`` elements in ``pieces`` consecutive parts, each a multiple of ``align`` but the last non-empty one: the
    count's packs of ``align`` shared out as ``cut`` shares elements (the first parts one pack longer), the last
    non-empty part short by the packs' excess over ``count`` (fewer than ``align``). With ``align`` 1 it is the even
    cut; a part may be empty when the count has fewer packs than ``pieces``."""
    packs = -(-count // align)
    q, r = divmod(packs, pieces)
    parts = [(q + (1 if i < r else 0)) * align for i in range(pieces)]
    excess = packs * align - count
    if excess:
        last = max(i for i, n in enumerate(parts) if n)
        parts[last] -= excess
    return tuple(parts)
