"""Owner regions cut into consecutive Reduces so that NCCL's planner runs a flush's Reduces as one aggregate.

Why: ``ncclPrepareTasks`` (src/enqueue.cc 363-470, NCCL v2.30.7-1) sorts a group's tasks of one function by traffic
and aggregates them smallest first only while the next task is under 4x the aggregate's first (enqueue.cc 434-439);
each aggregate is its own work and pays its algorithm's latency. A ring Reduce's latency is a chain's, a hop per rank
(``collective_time`` Note (Reduce latency): about 0.9 ms at 64 ranks on Simple), so a flush whose owner regions differ
by more than 4x (a layer's small matrices beside its large ones, a flush that ends inside an owner's region) pays
that chain two or three times, while the regions' chains could run side by side on the channels of one aggregate
(``numPipeOps = DIVUP(tasks, channels)``, enqueue.cc 428). Cutting each larger region into consecutive Reduces to
the same root (each a contiguous part of it) brings every task within 4x of the smallest: NCCL then aggregates them
and each chain's latency is paid once, its bytes unchanged. More tasks can cost more: past the communicator's
channels ``numPipeOps`` grows, and every call costs the host its issue before NCCL launches the group
(``host_cost``: at 4 ranks on one node a chain's latency is about 9 us, the runtime's issue about 2.5 us per call, so
a cut into 15 Reduces does not pay and one into 5 does). So the cut is the model's choice: every cut tried here is
costed as NCCL plans the group, host issue included (``flush_choice.FlushCost.group_us`` through the caller's
``time_of``), and the cheapest wins, no cut on a tie.

Identical on every rank: a function of the region sizes and the model only. Pure: numbers in, piece counts out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .collective_time import MAX_CHANNELS
from .collectives import REDUCE

CUT_FACTORS = (1, 2, 3)  # a cut's target piece: this x a region's size (under NCCL's 4x, with room for its bins)
MAX_TASKS = MAX_CHANNELS  # more Reduces than a communicator's channels only add pipelined latency


def cut(count: int, pieces: int) -> tuple[int, ...]:
    """``count`` elements in ``pieces`` consecutive parts, the first ``count % pieces`` one element longer."""
    q, r = divmod(count, pieces)
    return tuple(q + (1 if i < r else 0) for i in range(pieces))


def reduce_pieces(counts: Sequence[int], rest: Sequence[tuple[str, int]],
                  time_of: Callable[[list[tuple[str, int]]], float]) -> tuple[tuple[int, ...], float]:
    """(pieces per count, the group's modelled time) of Reduces of ``counts`` elements (zero: no call) issued in one
    group with ``rest`` ((kind, elements) of the group's other calls), each count cut into that many consecutive
    Reduces. Tried: no cut, and every cut whose pieces are at most ``f`` x some count for ``f`` in ``CUT_FACTORS``
    (within ``MAX_TASKS``); the cheapest by ``time_of`` (the group alone: its issue and its device time) wins, ties
    to fewer pieces."""
    whole = tuple(1 if n else 0 for n in counts)

    def calls(pieces: Sequence[int]) -> list[tuple[str, int]]:
        return [(REDUCE, part) for n, p in zip(counts, pieces, strict=True) if p for part in cut(n, p)] + list(rest)

    best = (time_of(calls(whole)), sum(whole), whole)
    for target in sorted({f * n for n in counts if n for f in CUT_FACTORS}):
        pieces = tuple(-(-n // target) if n else 0 for n in counts)
        if sum(pieces) > MAX_TASKS or pieces == whole:
            continue
        candidate = (time_of(calls(pieces)), sum(pieces), pieces)
        if candidate[:2] < best[:2]:
            best = candidate
    return best[2], best[0]
