"""The flush plan as pure logic."""

import pytest

from owner_reduce.planning.flush_plan import ALL, BucketEntry, FlushRange, plan_flush
from owner_reduce.planning.owner_map import GroupTables, OwnerMap


def _map():
    # ws=3; params 0..5 with numels; 2 straddles partitions 0/1; 5 is zero-sized in partition 2.
    tables = GroupTables(group=0, param_ids=(0, 1, 2, 3, 4, 5), numels=(4, 4, 6, 5, 3, 0), partition_count=3,
                         partition_ids={0: (0,), 1: (0,), 2: (0, 1), 3: (1,), 4: (2,), 5: (2,)},
                         start_offsets={0: {0: 0, 1: 0, 2: 0}, 1: {2: 2, 3: 0}, 2: {4: 0, 5: 0}},
                         same_comm_as_dp=True)
    return OwnerMap.from_group_tables([tables], dp_world_size=3)


def _entries(order, m):
    out, offset = [], 0
    for pid in order:
        numel = m.placement(pid).numel
        out.append(BucketEntry(pid, offset, numel))
        offset += numel
    return out


def test_straddlers_on_allreduce_when_not_sliced():
    m = _map()
    plan = plan_flush(_entries([0, 1, 2, 3, 4, 5], m), m, reduce_to_owner=True, slice_straddlers=False)
    assert plan.ranges == (FlushRange(0, 8, 0), FlushRange(8, 6, ALL), FlushRange(14, 5, 1), FlushRange(19, 3, 2))
    assert (plan.tasks, plan.reduced_elems) == (6, 22)
    assert (plan.owner_tasks, plan.owner_elems) == (5, 16)  # the zero-sized param counts as a task, 0 elements
    assert (plan.eligible_tasks, plan.eligible_elems) == (5, 16)
    assert [plan.received_elems(r) for r in range(3)] == [14, 11, 9]


def test_owner_path_off_is_one_allreduce_and_still_counts_eligible():
    m = _map()
    plan = plan_flush(_entries([4, 3, 2, 1, 0], m), m, reduce_to_owner=False)
    assert plan.ranges == (FlushRange(0, 22, ALL),)
    assert plan.owner_tasks == plan.owner_elems == 0
    assert (plan.eligible_tasks, plan.eligible_elems) == (5, 22)
    unsliced = plan_flush(_entries([4, 3, 2, 1, 0], m), m, reduce_to_owner=False, slice_straddlers=False)
    assert (unsliced.eligible_tasks, unsliced.eligible_elems) == (4, 16)


def test_straddlers_reduce_in_slices_merged_with_their_neighbours():
    m = _map()
    plan = plan_flush(_entries([0, 1, 2, 3, 4, 5], m), m, reduce_to_owner=True)
    # param 2 = [8, 14): its [0, 2) joins rank 0's run, its [2, 6) starts rank 1's run.
    assert plan.ranges == (FlushRange(0, 10, 0), FlushRange(10, 9, 1), FlushRange(19, 3, 2))
    assert (plan.owner_tasks, plan.owner_elems) == (6, 22)
    assert [plan.received_elems(r) for r in range(3)] == [10, 9, 3]


def test_whole_gradient_params_stay_on_allreduce():
    import dataclasses

    m = _map()
    tables = GroupTables(group=0, param_ids=(0, 1, 2, 3, 4, 5), numels=(4, 4, 6, 5, 3, 0), partition_count=3,
                         partition_ids={0: (0,), 1: (0,), 2: (0, 1), 3: (1,), 4: (2,), 5: (2,)},
                         start_offsets={0: {0: 0, 1: 0, 2: 0}, 1: {2: 2, 3: 0}, 2: {4: 0, 5: 0}},
                         same_comm_as_dp=True, whole_param_ids=frozenset({2}))
    muon = OwnerMap.from_group_tables([tables], dp_world_size=3)
    assert not muon.placement(2).sliced and m.placement(2).sliced
    assert muon.digest() != m.digest()
    plan = plan_flush(_entries([0, 1, 2, 3, 4, 5], muon), muon, reduce_to_owner=True)
    assert plan.ranges[1] == FlushRange(8, 6, ALL)
    assert dataclasses.replace(muon.placement(2), sliceable=True).sliced


def test_interleaved_owners_are_not_merged():
    m = _map()
    plan = plan_flush(_entries([0, 3, 1, 4], m), m, reduce_to_owner=True)
    assert [r.root for r in plan.ranges] == [0, 1, 0, 2]


def test_empty_flush():
    plan = plan_flush([], _map(), reduce_to_owner=True)
    assert plan.ranges == () and plan.reduced_elems == 0


def test_entries_must_be_contiguous_and_match_the_map():
    m = _map()
    with pytest.raises(ValueError, match="contiguous"):
        plan_flush([BucketEntry(0, 0, 4), BucketEntry(1, 5, 4)], m, True)
    with pytest.raises(ValueError, match="bucket holds 3 elements, the owner map 4"):
        plan_flush([BucketEntry(0, 0, 3)], m, True)
    with pytest.raises(KeyError):
        plan_flush([BucketEntry(99, 0, 3)], m, True)
