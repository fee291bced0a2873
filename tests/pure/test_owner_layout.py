"""The owner-ordered bucket layout as pure logic: placement, the calls per flush for each candidate algorithm
(one Reduce per owner, one ReduceScatter, ReduceScatter + hand-off, one AllReduce), and a simulated flush that
proves the layout delivers every rank exactly its partition (with negative controls: a layout off by one slice,
a hand-off piece sent to the wrong owner). The cost model here is bf16's: regions start at multiples of 8 elements
(16 bytes, ``planning.alignment``; ``tests/exchange/test_alignment.py`` checks it at scale)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from harness.faults import misroute_handoff
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.flush_plan import ALL, FlushRange
from owner_reduce.planning.owner_layout import (
    ALLREDUCE,
    HANDOFF,
    REDUCE,
    REDUCE_SCATTER,
    Collective,
    OwnerLayout,
    PlacedPiece,
    Transfer,
    algo_of,
    collectives_of,
    default_cost,
    plan_owner_layout,
    plan_placed,
)
from owner_reduce.planning.owner_map import GroupTables, OwnerMap
from tests.support.fakes import flat_map


def _map3(whole=frozenset()):
    # ws=3; 2 straddles partitions 0/1; 5 is zero-sized in partition 2 (as tests/pure/test_flush_plan.py).
    return OwnerMap.from_group_tables([GroupTables(
        group=0, param_ids=(0, 1, 2, 3, 4, 5), numels=(4, 4, 6, 5, 3, 0), partition_count=3,
        partition_ids={0: (0,), 1: (0,), 2: (0, 1), 3: (1,), 4: (2,), 5: (2,)},
        start_offsets={0: {0: 0, 1: 0, 2: 0}, 1: {2: 2, 3: 0}, 2: {4: 0, 5: 0}}, same_comm_as_dp=True,
        whole_param_ids=whole)], dp_world_size=3)


def _map2():
    # ws=2, partition size 9: rank 0 keeps p0 and p1[0:3]; rank 1 keeps p1[3:4], p2, p3 (equal partitions).
    return OwnerMap.from_group_tables([GroupTables(
        group=0, param_ids=(0, 1, 2, 3), numels=(6, 4, 5, 3), partition_count=2,
        partition_ids={0: (0,), 1: (0, 1), 2: (1,), 3: (1,)},
        start_offsets={0: {0: 0, 1: 0}, 1: {1: 3, 2: 0, 3: 0}}, same_comm_as_dp=True)], dp_world_size=2)


def _forced(m, algo):
    """The cost model of ``m``'s world size with ``algo`` forced (these test flushes are tiny: left to the model,
    most would be one AllReduce)."""
    return FlushCost(default_cost(m.dp_world_size).topology, force=algo)


def _arrival(m, ids=None):
    ids = [p.param_id for p in m] if ids is None else ids
    return [(pid, m.placement(pid).numel) for pid in reversed(ids)]


def simulate(layout: OwnerLayout, owner_map: OwnerMap, seed: int = 0) -> None:
    """Run the flush on every rank with lists: copy each gradient in as placed, run the collectives, copy out
    what each rank keeps; assert every kept element is the sum over ranks of that element."""
    n = owner_map.dp_world_size
    rng = random.Random(seed)
    grads = [{g.param_id: [rng.randint(-99, 99) for _ in range(g.numel)] for g in layout.grads} for _ in range(n)]
    size = max(layout.total, 1)
    buckets = [[None] * size for _ in range(n)]
    for rank in range(n):
        for g in layout.grads:
            for p in g.pieces:
                buckets[rank][p.bucket_offset:p.bucket_offset + p.length] = grads[rank][g.param_id][
                    p.src_offset:p.src_offset + p.length]
        for pad in layout.padding:
            buckets[rank][pad.offset:pad.offset + pad.count] = [0] * pad.count
    received = [[None] * size for _ in range(n)]
    for c in layout.collectives:
        for rank in range(n):  # alignment gaps a call covers are padding (zeros), never stale bucket contents
            assert None not in buckets[rank][c.offset:c.offset + c.count], f"{c} reduces elements nobody wrote"
        if c.kind == HANDOFF:  # last: every transfer reads what its source holds after the calls before it
            assert c is layout.collectives[-1]
            moved = [(t, received[t.src][t.offset:t.offset + t.count]) for t in layout.transfers]
            for t, values in moved:
                assert None not in values, f"{t}: rank {t.src} sends elements it does not hold"
                received[t.dst][t.offset:t.offset + t.count] = values
            continue
        sums = [sum(b[i] for b in buckets) for i in range(c.offset, c.offset + c.count)]
        for rank in range(n):
            if c.kind == ALLREDUCE or (c.kind == REDUCE and c.root == rank):
                received[rank][c.offset:c.offset + c.count] = sums
            elif c.kind == REDUCE_SCATTER:
                lo = c.offset + rank * c.per_rank
                received[rank][lo:lo + c.per_rank] = sums[lo - c.offset:lo - c.offset + c.per_rank]
    for rank in range(n):
        for g in layout.grads:
            for s in owner_map.slices(g.param_id):
                if s.owner != rank or not s.length:
                    continue
                (at, count), = g.segments(s.offset, s.length)  # one-level layouts keep a slice in one piece
                assert count == s.length
                got = received[rank][at:at + s.length]
                want = [sum(grads[r][g.param_id][i] for r in range(n)) for i in range(s.offset, s.offset + s.length)]
                assert got == want, f"rank {rank}, param {g.param_id}, slice {s}"


def test_owners_ascend_and_straddler_slices_join_their_owners():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, capacity=100, cost=_forced(m, REDUCE))
    # Regions 10 / 9 / 3: padding them to 10 would cost 8 > 1% of 22: no padded ReduceScatter.
    assert REDUCE_SCATTER not in dict(layout.costs)
    # Each region starts at a multiple of 8 elements, in a slot of its size rounded up to 8; the gaps are not reduced
    # (no padding to zero).
    assert layout.collectives == (Collective(REDUCE, 0, 10, 0), Collective(REDUCE, 16, 9, 1),
                                  Collective(REDUCE, 32, 3, 2))
    assert layout.plan.ranges == (FlushRange(0, 10, 0), FlushRange(16, 9, 1), FlushRange(32, 3, 2))
    assert layout.algo == "reduce" and layout.calls == 3 and layout.total == 40 and layout.padding == ()
    by_id = {g.param_id: g for g in layout.grads}
    assert [g.param_id for g in layout.grads] == [5, 4, 3, 2, 1, 0]  # arrival order kept
    assert by_id[0].pieces == (PlacedPiece(0, 0, 4, 0, 0),) and by_id[1].pieces == (PlacedPiece(1, 0, 4, 4, 0),)
    assert by_id[2].pieces == (PlacedPiece(2, 0, 2, 8, 0), PlacedPiece(2, 2, 4, 16, 1))
    assert by_id[5].pieces == ()
    assert (layout.plan.tasks, layout.plan.reduced_elems, layout.plan.owner_elems) == (6, 22, 22)
    simulate(layout, m)


def test_equal_partitions_take_one_reduce_scatter():
    m = _map2()
    layout = plan_owner_layout(_arrival(m), m)
    # Equal regions of 9: each rank's block of 16 (aligned), its last 7 zeros.
    assert layout.collectives == (Collective(REDUCE_SCATTER, 0, 32, per_rank=16),)
    assert layout.padding == (FlushRange(9, 7, 0), FlushRange(25, 7, 1))
    assert layout.algo == "reduce_scatter" and layout.total == 32
    simulate(layout, m)
    # The flush of only part of the model does not cover both ranks: no ReduceScatter without a hand-off.
    part = plan_owner_layout([(3, 3), (2, 5)], m)
    assert REDUCE_SCATTER not in dict(part.costs) and part.algo in ("reduce", "allreduce") and part.calls == 1


def test_padding_is_bounded_and_must_fit_the_bucket():
    m = flat_map([50, 50, 50, 49], 2)  # partitions 100 / 99: one pad element, 0.5% of the flush; blocks of 104
    layout = plan_owner_layout(_arrival(m), m, capacity=208)
    assert layout.algo == "reduce_scatter" and layout.total == 208
    assert layout.padding == (FlushRange(100, 4, 0), FlushRange(203, 5, 1))  # the one, and 4 each to align
    simulate(layout, m)
    assert REDUCE_SCATTER not in dict(plan_owner_layout(_arrival(m), m, capacity=207).costs)  # the pad won't fit
    assert REDUCE_SCATTER not in dict(plan_owner_layout(_arrival(m), m, max_padding_share=0.001).costs)


def test_allreduce_region_after_the_owner_regions():
    # Group 1 reduces over another communicator. Bandwidth-bound (64 MB): ReduceScatter + AllReduce of group 1.
    big = flat_map([8_000_000] * 4, 4, other_comm_numels=(5_000_000, 7_000_000))
    layout = plan_owner_layout(_arrival(big), big)
    assert layout.algo == "reduce_scatter+allreduce" and layout.calls == 2
    assert layout.collectives[-1] == Collective(ALLREDUCE, 32_000_000, 12_000_000)
    m = flat_map([8, 8, 8, 8], 4, other_comm_numels=(5, 7))
    layout = plan_owner_layout(_arrival(m), m)
    assert layout.algo == "allreduce" and layout.collectives == (Collective(ALLREDUCE, 0, 44),)  # latency-bound
    simulate(layout, m)
    layout = plan_owner_layout(_arrival(m, [5, 4, 2, 1]), m, cost=_forced(m, HANDOFF))
    # 16 owner elements in 4 chunks of 8 (aligned): the AllReduce region after their span of 32.
    assert layout.algo == "reduce_scatter+handoff+allreduce" and layout.collectives[1] == Collective(ALLREDUCE, 32, 12)
    simulate(layout, m)
    muon = _map3(whole=frozenset({2}))
    layout = plan_owner_layout(_arrival(muon), muon, cost=_forced(muon, REDUCE))
    assert layout.algo == "reduce+allreduce"  # regions 8 / 5 / 3 at 0, 8 and 16; the AllReduce region aligned after
    assert layout.collectives[-1] == Collective(ALLREDUCE, 24, 6) and layout.grads[3].pieces[0].root is ALL
    simulate(layout, muon)


def test_owner_path_off_is_one_allreduce_in_arrival_order():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, reduce_to_owner=False)
    assert layout.collectives == (Collective(ALLREDUCE, 0, 22),) and layout.plan.owner_elems == 0
    assert [g.pieces[0].bucket_offset for g in layout.grads if g.numel] == [0, 3, 8, 14, 18]
    simulate(layout, m)


@pytest.mark.parametrize("algo", ["auto", REDUCE, ALLREDUCE, HANDOFF])
@pytest.mark.parametrize("ws", [2, 3, 4, 7, 8])
def test_random_flat_layouts_reduce_correctly(ws, algo):
    rng = random.Random(ws)
    for trial in range(20):
        m = flat_map([rng.randint(0, 40) for _ in range(rng.randint(1, 12))], ws)
        ids = rng.sample([p.param_id for p in m], rng.randint(1, len(m)))  # part of the model, shuffled
        layout = plan_owner_layout(_arrival(m, ids), m, cost=_forced(m, algo))
        touched = {s.owner for g in layout.grads for s in m.slices(g.param_id) if s.length}
        if algo != "auto" and touched:
            assert layout.choice == algo
        expected = {REDUCE_SCATTER: 1, ALLREDUCE: 1, REDUCE: len(touched), HANDOFF: 1 + bool(layout.transfers)}
        if layout.choice == REDUCE and touched:  # one Reduce per owner, or its region cut into consecutive ones
            _assert_reduces_cover_each_region_in_order(layout)
            assert {c.root for c in layout.collectives if c.kind == REDUCE} == touched
            assert layout.calls >= len(touched)
            if layout.calls > len(touched) + any(c.kind == ALLREDUCE for c in layout.collectives):
                assert layout.modelled_us < _uncut_reduce_us(layout, m, algo)  # a cut only where it pays
        else:
            assert layout.calls == (expected[layout.choice] if touched else len(layout.collectives))
        assert layout.modelled_us == dict(layout.costs)[layout.choice]
        simulate(layout, m, seed=trial)


def _assert_reduces_cover_each_region_in_order(layout):
    """Each owner's Reduces are consecutive parts of its range, back to back, covering it exactly."""
    for r in layout.plan.ranges:
        if r.root is ALL:
            continue
        parts = [c for c in layout.collectives if c.kind == REDUCE and c.root == r.root]
        assert parts[0].offset == r.offset and sum(c.count for c in parts) == r.count
        assert all(a.offset + a.count == b.offset for a, b in zip(parts, parts[1:], strict=False))


def _uncut_reduce_us(layout, m, algo):
    """The Reduce candidate's modelled time with one Reduce per owner (no cut), as NCCL's planner costs the group, and
    its issue (issue 39: a cut's extra calls cost the host too)."""
    cost = _forced(m, algo)
    calls = [(REDUCE, r.count) for r in layout.plan.ranges if r.root is not ALL]
    calls += [(c.kind, c.count) for c in layout.collectives if c.kind == ALLREDUCE]
    return cost.group_us(calls)


def test_handoff_cuts_the_flush_into_equal_chunks_and_moves_each_piece_to_its_owner():
    m = flat_map([16] * 12, 4)  # partitions of 48: rank 0 keeps p0-p2, rank 1 p3-p5, ...
    layout = plan_owner_layout(_arrival(m, [7, 6, 5, 4]), m, cost=_forced(m, HANDOFF))  # ranks 1 and 2, 32 each
    # Regions packed: rank 1's p4 p5 at [0, 32), rank 2's p6 p7 at [32, 64); 4 chunks of 16: chunk i on rank i.
    assert layout.collectives == (Collective(REDUCE_SCATTER, 0, 64, per_rank=16), Collective(HANDOFF, 0, 64))
    assert layout.transfers == (Transfer(0, 1, 0, 16), Transfer(3, 2, 48, 16))
    assert layout.algo == "reduce_scatter+handoff" and layout.total == 64 and layout.padding == ()
    assert layout.plan.ranges == (FlushRange(0, 32, 1), FlushRange(32, 32, 2))
    simulate(layout, m)
    # Regions of 10 (rank 0: p2) and 20 (rank 1: p3 p4) in slots of 16 and 24; 40 elements in 4 chunks of 16 (each
    # a multiple of 8): each slot's tail and the last chunk's are zeros, and no hand-off piece starts unaligned.
    m = flat_map([10] * 12, 4)
    uneven = plan_owner_layout(_arrival(m, [4, 3, 2]), m, cost=_forced(m, HANDOFF))
    assert uneven.padding == (FlushRange(10, 6, 0), FlushRange(36, 4, 1), FlushRange(40, 24, ALL))
    assert uneven.total == 64 and uneven.collectives[0] == Collective(REDUCE_SCATTER, 0, 64, per_rank=16)
    assert uneven.transfers == (Transfer(2, 1, 32, 4),)  # chunks 0 and 1 lie in their own ranks' regions
    simulate(uneven, m)


@pytest.mark.parametrize("ws", [3, 4, 8])
def test_negative_control_a_handoff_piece_sent_to_the_wrong_owner_is_caught(ws):
    m = flat_map([7] * 10, ws)
    layout = plan_owner_layout(_arrival(m, [6, 5, 4, 3]), m, cost=_forced(m, HANDOFF))
    assert layout.transfers
    simulate(layout, m)
    broken = misroute_handoff(layout, ws)
    assert broken.transfers != layout.transfers
    with pytest.raises(AssertionError):
        simulate(broken, m)


def test_negative_control_layout_off_by_one_slice_is_caught():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, cost=_forced(m, REDUCE))
    # Pack the same pieces one slice later (the last one first): a valid packing that disagrees with the calls.
    pieces = sorted((p for g in layout.grads for p in g.pieces), key=lambda p: p.bucket_offset)
    rotated, offset = {}, 0
    for p in pieces[-1:] + pieces[:-1]:
        rotated[(p.param_id, p.src_offset)] = dataclasses.replace(p, bucket_offset=offset)
        offset += p.length
    broken = dataclasses.replace(layout, grads=tuple(
        dataclasses.replace(g, pieces=tuple(rotated[(p.param_id, p.src_offset)] for p in g.pieces))
        for g in layout.grads))
    with pytest.raises(AssertionError):
        simulate(broken, m)


def test_partial_flush_plans_the_pieces_present():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, cost=_forced(m, REDUCE))
    by_id = {g.param_id: g for g in layout.grads}
    plan = plan_placed([by_id[4], by_id[3], by_id[2]], m, reduce_to_owner=True)
    # p2 lies at [8, 10) -> rank 0 and [16, 20) -> rank 1, p3 at [20, 25) -> rank 1, p4 at [32, 35) -> rank 2; the
    # hole [0, 8) and the alignment gaps skipped.
    assert plan.ranges == (FlushRange(8, 2, 0), FlushRange(16, 9, 1), FlushRange(32, 3, 2))
    assert (plan.tasks, plan.reduced_elems) == (3, 14)


def test_algo_names_and_plain_collectives():
    assert algo_of([]) == "none"
    assert algo_of([ALLREDUCE, REDUCE, REDUCE_SCATTER]) == "reduce_scatter+reduce+allreduce"
    assert algo_of([HANDOFF, ALLREDUCE, REDUCE_SCATTER]) == "reduce_scatter+handoff+allreduce"
    assert collectives_of((FlushRange(0, 3, 1), FlushRange(3, 2, ALL))) == (Collective(REDUCE, 0, 3, 1),
                                                                             Collective(ALLREDUCE, 3, 2))
    with pytest.raises(ValueError, match="bucket holds 3 elements"):
        plan_owner_layout([(0, 3)], _map3())


def test_a_region_cut_into_consecutive_reduces_reduces_correctly_and_a_short_cut_is_caught():
    """Regions of 16 and 2 elements: two aggregates in NCCL's planner (16 is not under 4x 2), so the model cuts the
    larger into consecutive Reduces to the same root (``aggregation``). Negative control: the cut's last Reduce one
    element short leaves an element of rank 0's region unreduced, and the simulated flush sees it."""
    m = flat_map([16, 2, 14], 2)  # partitions of 16: p0 on rank 0, p1 and p2 on rank 1
    layout = plan_owner_layout(_arrival(m, [0, 1]), m, cost=_forced(m, REDUCE))
    cut_calls = [c for c in layout.collectives if c.root == 0]
    assert len(cut_calls) > 1 and sum(c.count for c in cut_calls) == 16
    _assert_reduces_cover_each_region_in_order(layout)
    assert layout.modelled_us < _uncut_reduce_us(layout, m, REDUCE)
    simulate(layout, m)
    last = cut_calls[-1]
    short = dataclasses.replace(layout, collectives=tuple(dataclasses.replace(c, count=c.count - 1) if c is last else c
                                                          for c in layout.collectives))
    with pytest.raises(AssertionError):
        simulate(short, m)
