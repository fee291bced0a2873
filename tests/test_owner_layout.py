"""The owner-ordered bucket layout as pure logic: placement, the collective per flush, and a simulated flush
that proves the layout delivers every rank exactly its partition (with a negative control)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from owner_reduce.planning.flush_plan import ALL, FlushRange
from owner_reduce.planning.owner_layout import (
    ALLREDUCE,
    REDUCE,
    REDUCE_SCATTER,
    Collective,
    OwnerLayout,
    PlacedPiece,
    algo_of,
    collectives_of,
    plan_owner_layout,
    plan_placed,
)
from owner_reduce.planning.owner_map import GroupTables, OwnerMap


def _map3(whole=frozenset()):
    # ws=3; 2 straddles partitions 0/1; 5 is zero-sized in partition 2 (as tests/test_flush_plan.py).
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


def _flat_map(numels, ws, other_comm_numels=()):
    """ZeRO-1-like tables: parameters laid flat, cut into ``ws`` partitions of ceil(total/ws); optionally a
    second group on another communicator (MoE experts)."""
    total = sum(numels)
    size = max(1, -(-total // ws))
    ids = tuple(range(len(numels)))
    parts, starts = {}, {r: {} for r in range(ws)}
    flat = 0
    for pid, numel in zip(ids, numels, strict=True):
        first = min(flat // size, ws - 1)
        last = min(max(flat, flat + numel - 1) // size, ws - 1)
        parts[pid] = tuple(range(first, last + 1))
        for r in parts[pid]:
            starts[r][pid] = max(0, r * size - flat)
        flat += numel
    groups = [GroupTables(group=0, param_ids=ids, numels=tuple(numels), partition_count=ws, partition_ids=parts,
                          start_offsets=starts, same_comm_as_dp=True)]
    if other_comm_numels:
        oids = tuple(range(len(numels), len(numels) + len(other_comm_numels)))
        groups.append(GroupTables(group=1, param_ids=oids, numels=tuple(other_comm_numels), partition_count=1,
                                  partition_ids={i: (0,) for i in oids}, start_offsets={0: dict.fromkeys(oids, 0)},
                                  same_comm_as_dp=False))
    return OwnerMap.from_group_tables(groups, dp_world_size=ws)


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
                at = g.locate(s.offset, s.length)
                got = received[rank][at:at + s.length]
                want = [sum(grads[r][g.param_id][i] for r in range(n)) for i in range(s.offset, s.offset + s.length)]
                assert got == want, f"rank {rank}, param {g.param_id}, slice {s}"


def test_owners_ascend_and_straddler_slices_join_their_owners():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, capacity=100)
    # Regions 10 / 9 / 3: padding them to 10 would cost 8 > 1% of 22, so one Reduce per owner.
    assert layout.collectives == (Collective(REDUCE, 0, 10, 0), Collective(REDUCE, 10, 9, 1),
                                  Collective(REDUCE, 19, 3, 2))
    assert layout.plan.ranges == (FlushRange(0, 10, 0), FlushRange(10, 9, 1), FlushRange(19, 3, 2))
    assert layout.algo == "reduce" and layout.calls == 3 and layout.total == 22 and layout.padding == ()
    by_id = {g.param_id: g for g in layout.grads}
    assert [g.param_id for g in layout.grads] == [5, 4, 3, 2, 1, 0]  # arrival order kept
    assert by_id[0].pieces == (PlacedPiece(0, 0, 4, 0, 0),) and by_id[1].pieces == (PlacedPiece(1, 0, 4, 4, 0),)
    assert by_id[2].pieces == (PlacedPiece(2, 0, 2, 8, 0), PlacedPiece(2, 2, 4, 10, 1))
    assert by_id[5].pieces == ()
    assert (layout.plan.tasks, layout.plan.reduced_elems, layout.plan.owner_elems) == (6, 22, 22)
    simulate(layout, m)


def test_equal_partitions_take_one_reduce_scatter():
    m = _map2()
    layout = plan_owner_layout(_arrival(m), m)
    assert layout.collectives == (Collective(REDUCE_SCATTER, 0, 18, per_rank=9),)
    assert layout.algo == "reduce_scatter" and layout.total == 18
    simulate(layout, m)
    # The flush of only part of the model does not cover both ranks: Reduces.
    part = plan_owner_layout([(3, 3), (2, 5)], m)
    assert part.algo == "reduce" and part.calls == 1


def test_padding_is_bounded_and_must_fit_the_bucket():
    m = _flat_map([50, 50, 50, 49], 2)  # partitions 100 / 99: one pad element, 0.5% of the flush
    layout = plan_owner_layout(_arrival(m), m, capacity=200)
    assert layout.algo == "reduce_scatter" and layout.padding == (FlushRange(199, 1, 1),) and layout.total == 200
    simulate(layout, m)
    assert plan_owner_layout(_arrival(m), m, capacity=199).algo == "reduce"  # the pad would not fit
    assert plan_owner_layout(_arrival(m), m, max_padding_share=0.001).algo == "reduce"


def test_allreduce_region_after_the_owner_regions():
    m = _flat_map([8, 8, 8, 8], 4, other_comm_numels=(5, 7))  # group 1 reduces over another communicator
    layout = plan_owner_layout(_arrival(m), m)
    assert layout.algo == "reduce_scatter+allreduce" and layout.calls == 2
    assert layout.collectives[-1] == Collective(ALLREDUCE, 32, 12)
    simulate(layout, m)
    muon = _map3(whole=frozenset({2}))
    layout = plan_owner_layout(_arrival(muon), muon)
    assert layout.algo == "reduce+allreduce"
    assert layout.collectives[-1] == Collective(ALLREDUCE, 16, 6) and layout.grads[3].pieces[0].root is ALL
    simulate(layout, muon)


def test_owner_path_off_is_one_allreduce_in_arrival_order():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m, reduce_to_owner=False)
    assert layout.collectives == (Collective(ALLREDUCE, 0, 22),) and layout.plan.owner_elems == 0
    assert [g.pieces[0].bucket_offset for g in layout.grads if g.numel] == [0, 3, 8, 14, 18]
    simulate(layout, m)


@pytest.mark.parametrize("ws", [2, 3, 4, 7, 8])
def test_random_flat_layouts_reduce_correctly(ws):
    rng = random.Random(ws)
    for trial in range(20):
        m = _flat_map([rng.randint(0, 40) for _ in range(rng.randint(1, 12))], ws)
        ids = [p.param_id for p in m]
        rng.shuffle(ids)
        layout = plan_owner_layout(_arrival(m, ids), m)
        touched = {s.owner for g in layout.grads for s in m.slices(g.param_id) if s.length}
        assert layout.calls == (1 if layout.algo == REDUCE_SCATTER else len(touched))
        simulate(layout, m, seed=trial)


def test_negative_control_layout_off_by_one_slice_is_caught():
    m = _map3()
    layout = plan_owner_layout(_arrival(m), m)
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
    layout = plan_owner_layout(_arrival(m), m)
    by_id = {g.param_id: g for g in layout.grads}
    plan = plan_placed([by_id[4], by_id[3], by_id[2]], m, reduce_to_owner=True)
    # p2 lies at [8, 14) split 0 | 1, p3 at [14, 19) -> rank 1, p4 at [19, 22) -> rank 2; the hole [0, 8) skipped.
    assert plan.ranges == (FlushRange(8, 2, 0), FlushRange(10, 9, 1), FlushRange(19, 3, 2))
    assert (plan.tasks, plan.reduced_elems) == (3, 14)


def test_algo_names_and_plain_collectives():
    assert algo_of([]) == "none"
    assert algo_of([ALLREDUCE, REDUCE, REDUCE_SCATTER]) == "reduce_scatter+reduce+allreduce"
    assert collectives_of((FlushRange(0, 3, 1), FlushRange(3, 2, ALL))) == (Collective(REDUCE, 0, 3, 1),
                                                                             Collective(ALLREDUCE, 3, 2))
    with pytest.raises(ValueError, match="bucket holds 3 elements"):
        plan_owner_layout([(0, 3)], _map3())
