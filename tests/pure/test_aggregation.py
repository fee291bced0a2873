"""Owner regions cut into consecutive Reduces so that NCCL's planner aggregates them (``planning.aggregation``)."""

from __future__ import annotations

import pytest

from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.aggregation import MAX_TASKS, cut, reduce_pieces
from owner_reduce.planning.flush_choice import FlushCost

pytestmark = pytest.mark.timeout(60)

WS64 = ct.topology_of(64, 8, nvls=False)  # 8 nodes: a ring Reduce is a chain of 64 hops (0.9 ms on Simple)


def _calls(counts, pieces, rest=()):
    return [("reduce", p) for n, k in zip(counts, pieces, strict=True) if k for p in cut(n, k)] + list(rest)


def test_cut_splits_into_consecutive_parts_that_sum_to_the_count():
    assert cut(10, 3) == (4, 3, 3) and cut(9, 3) == (3, 3, 3) and cut(5, 1) == (5,)
    assert all(sum(cut(n, k)) == n for n in (1, 7, 1000) for k in (1, 2, 7) if k <= n)


def test_a_small_region_beside_large_ones_pays_one_chain_after_the_cut():
    """Llama-13B at ws 64 has flushes like this one: a small owner region beside three of 150-200M elements. NCCL
    aggregates a group's Reduces only while each is under 4x the smallest (enqueue.cc 434-439), so uncut they run as
    two aggregates, each a whole 64-hop chain; cut, one."""
    cost = FlushCost(WS64, 2)
    counts = [15_500_000, 0, 153_000_000, 203_000_000, 0, 194_000_000]
    whole = [1 if n else 0 for n in counts]
    assert len(ct.aggregates([(k, n * 2) for k, n in _calls(counts, whole)])) == 2
    pieces, us = reduce_pieces(counts, [], cost.calls_us)
    assert [p == 0 for p in pieces] == [n == 0 for n in counts] and pieces[0] == 1
    assert sum(pieces) <= MAX_TASKS
    assert len(ct.aggregates([(k, n * 2) for k, n in _calls(counts, pieces)])) == 1
    assert us == pytest.approx(cost.calls_us(_calls(counts, pieces)))
    # One aggregate of every byte, as NCCL plans it; uncut, the small region's own call (LL128 there: a 64-hop chain of
    # 4 us hops) comes on top.
    assert us == pytest.approx(ct.best_algo(ct.REDUCE, 2 * sum(counts), WS64)[0])
    small = ct.best_algo(ct.REDUCE, 2 * counts[0], WS64)
    assert small[2] == "LL128"
    saved = cost.calls_us(_calls(counts, whole)) - us
    assert saved == pytest.approx(ct.physical_latency_us(ct.REDUCE, ct.RING, ct.LL128, WS64), rel=0.15)


def test_no_cut_where_it_does_not_pay():
    cost = FlushCost(WS64, 2)
    even = [100_000_000, 120_000_000, 90_000_000]  # within 4x: one aggregate already
    assert reduce_pieces(even, [], cost.calls_us)[0] == (1, 1, 1)
    past_channels = [8_500_000, 153_000_000, 203_000_000, 194_000_000]  # joining takes 23 Reduces: 2 pipe ops
    assert reduce_pieces(past_channels, [], cost.calls_us)[0] == (1, 1, 1, 1)
    tiny = [10, 400_000_000]  # joining 10 elements would take 64+ Reduces: not tried, and the group stays uncut
    assert reduce_pieces(tiny, [], cost.calls_us)[0] == (1, 1)
    assert reduce_pieces([3, 0, 50], [], lambda calls: 0.0)[0] == (1, 0, 1)  # no model: ties go to fewer calls


def test_the_groups_other_calls_are_costed_with_the_cut():
    """An AllReduce in the same group counts in ``numPipeOps`` (tasks / channels) and is passed through unchanged."""
    seen = []

    def time_of(calls):
        seen.append(list(calls))
        return FlushCost(WS64, 2).calls_us(calls)

    reduce_pieces([8_500_000, 200_000_000], [("allreduce", 1000)], time_of)
    assert all(calls[-1] == ("allreduce", 1000) for calls in seen) and len(seen) > 1
