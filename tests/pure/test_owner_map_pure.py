"""The owner map as pure logic, from hand-made partition tables (no processes)."""

import dataclasses

import pytest
import torch

from owner_reduce.planning.owner_map import GroupTables, OwnerMap, OwnerMapError, ParamSlice, Placement


def _tables(group=0, same_comm=True):
    # ws=2, partition_size=10, params: a(6) b(8) c(4) d(0) e(2) -> flat [a:0-6 b:6-14 c:14-18 d:18 e:18-20]
    return GroupTables(
        group=group,
        param_ids=(0, 1, 2, 3, 4),
        numels=(6, 8, 4, 0, 2),
        partition_count=2,
        partition_ids={0: (0,), 1: (0, 1), 2: (1,), 3: (1,), 4: (1,)},
        start_offsets={0: {0: 0, 1: 0}, 1: {1: 4, 2: 0, 3: 0, 4: 0}},
        same_comm_as_dp=same_comm,
    )


def test_placements_and_slices():
    m = OwnerMap.from_group_tables([_tables()], dp_world_size=2)
    assert m.owner(0) == 0 and m.slices(0) == (ParamSlice(0, 6, 0),)
    assert m.owner(1) is None
    assert m.placement(1).placement is Placement.STRADDLES
    assert m.slices(1) == (ParamSlice(0, 4, 0), ParamSlice(4, 4, 1))
    assert m.owner(2) == 1 and m.owner(4) == 1
    # A zero-sized parameter inside one partition has one owner and nothing to send.
    assert m.owner(3) == 1 and m.slices(3) == (ParamSlice(0, 0, 1),)
    assert m.summary() == "DeepCompile reduce_to_owner: 4/5 gradients reduce to one rank"
    assert m.owner_share() == pytest.approx(12 / 20)
    assert m.owner_share(sliced=True) == 1.0
    assert m.init_line(sliced=False) == m.summary()
    assert m.init_line(sliced=True) == ("DeepCompile reduce_to_owner: 4/5 gradients reduce to one rank; 1 straddling "
                                        "gradient reduces in slices to its owners (100.0% of elements on the owner "
                                        "path)")


def test_other_communicator_group_is_allreduce():
    m = OwnerMap.from_group_tables([_tables(0), dataclasses.replace(_tables(1), param_ids=(10, 11, 12, 13, 14),
                                    partition_ids={}, start_offsets={}, same_comm_as_dp=False)], 2)
    for pid in (10, 11, 12, 13, 14):
        assert m.placement(pid).placement is Placement.OTHER_COMM
        assert m.owner(pid) is None and m.slices(pid) == ()
    assert m.summary() == "DeepCompile reduce_to_owner: 4/10 gradients reduce to one rank"


def test_zero_sized_param_in_no_partition_is_unplaced():
    t = _tables()
    t = dataclasses.replace(t, partition_ids={k: v for k, v in t.partition_ids.items() if k != 3})
    m = OwnerMap.from_group_tables([t], 2)
    assert m.placement(3).placement is Placement.UNPLACED and m.owner(3) is None


@pytest.mark.parametrize("broken", [
    {"partition_ids": {0: (0,), 1: (0, 1), 2: (1,), 3: (1,), 4: (2,)}},  # partition out of range
    {"start_offsets": {0: {0: 0, 1: 0}, 1: {1: 9, 2: 0, 3: 0, 4: 0}}},  # slice beyond the end
    {"start_offsets": {0: {0: 1, 1: 0}, 1: {1: 4, 2: 0, 3: 0, 4: 0}}},  # does not start at 0
    {"partition_ids": {0: (0,), 1: (0, 1), 2: (), 3: (1,), 4: (1,)}},  # elements nowhere
])
def test_inconsistent_tables_are_refused(broken):
    with pytest.raises(OwnerMapError, match="group 0, param_id"):
        OwnerMap.from_group_tables([dataclasses.replace(_tables(), **broken)], 2)


def test_owner_outside_world_is_refused():
    with pytest.raises(OwnerMapError, match="owner 1 outside 0..0"):
        OwnerMap.from_group_tables([_tables()], dp_world_size=1)


def test_digest_is_stable_and_sensitive():
    a = OwnerMap.from_group_tables([_tables()], 2)
    b = OwnerMap.from_group_tables([_tables()], 2)
    assert a.digest() == b.digest() and len(a.digest()) == 64
    moved = dataclasses.replace(_tables(), start_offsets={0: {0: 0, 1: 0}, 1: {1: 5, 2: 0, 3: 0, 4: 0}})
    assert OwnerMap.from_group_tables([moved], 2).digest() != a.digest()
    assert OwnerMap.from_group_tables([_tables()], 3).digest() != a.digest()


def test_lookup_by_tensor_and_immutability():
    weight = torch.nn.Parameter(torch.zeros(6))
    other = torch.nn.Parameter(torch.zeros(2))
    other.param_id = 4  # what DeepCompile's init sets on every parameter
    m = OwnerMap.from_group_tables([_tables()], 2, tensor_ids={id(weight): 0})
    assert m.owner(weight) == 0 and m.owner(other) == 1 and weight in m
    with pytest.raises(KeyError, match="not in the owner map"):
        m.owner(torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.placement(0).numel = 7
    with pytest.raises(TypeError):
        m._placements[0] = None


def test_duplicate_param_ids_are_refused():
    with pytest.raises(OwnerMapError, match="appears twice"):
        OwnerMap.from_group_tables([_tables(0), _tables(1)], 2)


def test_init_line_plural_forms_and_the_contract():
    def shifted(tables, by, group):
        return dataclasses.replace(
            tables, group=group, param_ids=tuple(p + by for p in tables.param_ids),
            partition_ids={p + by: v for p, v in tables.partition_ids.items()},
            start_offsets={part: {p + by: o for p, o in offs.items()} for part, offs in tables.start_offsets.items()})

    two = OwnerMap.from_group_tables([_tables(), shifted(_tables(), 5, 1)], dp_world_size=2)
    assert two.init_line(sliced=True) == ("DeepCompile reduce_to_owner: 8/10 gradients reduce to one rank; "
                                          "2 straddling gradients reduce in slices to their owners (100.0% of "
                                          "elements on the owner path)")
    # DESIGN.md's contract: the line starts with "DeepCompile reduce_to_owner: X/Y gradients reduce to one rank".
    for m in (two, OwnerMap.from_group_tables([_tables()], dp_world_size=2)):
        assert m.init_line(sliced=True).startswith(m.summary())
