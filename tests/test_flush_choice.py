"""The per-flush algorithm choice as pure logic: never modelled slower than the native runtime, the cheapest
candidate wins (or the forced one), identical inputs give identical choices, and the agreed topology."""

from __future__ import annotations

import random

import pytest
from fakes import flat_map

from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.collectives import ALLREDUCE, HANDOFF, REDUCE, REDUCE_SCATTER
from owner_reduce.planning.flush_choice import (
    AUTO,
    FORCE_ENV_VAR,
    FlushCost,
    agreed_topology,
    choose,
    choose_arrival,
    parse_force,
)
from owner_reduce.planning.flush_plan import BucketEntry, plan_flush
from owner_reduce.planning.owner_layout import plan_owner_layout

SIZES = [int(1.6 ** k) for k in range(3, 48)]  # 4 elements to 6.5e9 bytes in bf16


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16, 64, 512, 1024])
def test_one_allreduce_is_never_modelled_slower_than_one_per_gradient(world_size):
    """What makes 'never slower than native' hold: the AllReduce model is subadditive on every size pair."""
    topo = ct.topology_of(world_size, 8)
    for a in SIZES:
        for b in SIZES:
            one = ct.call_time_us(ALLREDUCE, 2 * (a + b), topo)
            assert one <= ct.call_time_us(ALLREDUCE, 2 * a, topo) + ct.call_time_us(ALLREDUCE, 2 * b, topo) + 1e-9


@pytest.mark.parametrize("world_size", [4, 64, 512, 1024])
def test_no_flush_is_modelled_slower_than_native_and_the_cheapest_runs(world_size):
    rng = random.Random(world_size)
    cost = FlushCost(ct.topology_of(world_size, 8))
    m = flat_map([rng.choice([2048, 2048 * 2048, 8192 * 3 * 2048, 50_000 * 2048]) for _ in range(60)], world_size)
    ids = [p.param_id for p in m][::-1]
    for start in range(0, 60, 7):
        grads = [(pid, m.placement(pid).numel) for pid in ids[start:start + rng.randint(1, 20)]]
        layout = plan_owner_layout(grads, m, cost=cost)
        native = cost.calls_us((ALLREDUCE, n) for _, n in grads)
        assert layout.modelled_us <= native * (1 + 1e-12), (world_size, start, layout.choice, dict(layout.costs))
        assert layout.modelled_us == min(dict(layout.costs).values())


def test_at_scale_a_partial_flush_hands_off_or_allreduces_instead_of_one_reduce_per_owner():
    """1024 ranks, a 5e8-element bf16 flush of 7B-sized matrices touching 77 owners: one Reduce per owner is by far
    the slowest candidate (a ring latency over 1024 ranks each); ReduceScatter + hand-off wins."""
    m = flat_map([4096 * 11008] * 148, 1024)  # 6.7e9 elements, partitions of 6.5e6
    grads = [(pid, m.placement(pid).numel) for pid in range(147, 147 - 11, -1)]  # 496e6 elements
    layout = plan_owner_layout(grads, m, cost=FlushCost(ct.topology_of(1024, 8)))
    costs = dict(layout.costs)
    assert layout.choice == HANDOFF and costs[REDUCE] > 10 * costs[HANDOFF]
    assert costs[HANDOFF] < 0.9 * costs[ALLREDUCE]


def test_choose_takes_the_cheapest_then_the_fewest_calls_or_the_forced_one():
    assert choose({REDUCE: 2.0, ALLREDUCE: 1.0, HANDOFF: 3.0}) == ALLREDUCE
    assert choose({REDUCE: 1.0, ALLREDUCE: 1.0, REDUCE_SCATTER: 1.0}) == REDUCE_SCATTER
    assert choose({REDUCE: 1.0, ALLREDUCE: 1.0}) == REDUCE
    assert choose({REDUCE: 2.0, ALLREDUCE: 1.0, HANDOFF: 3.0}, HANDOFF) == HANDOFF
    assert choose({ALLREDUCE: 1.0}, HANDOFF) == ALLREDUCE  # not a candidate here (nothing owned): the model decides


def test_forced_algorithm_parses_or_names_the_variable():
    assert parse_force(None) == AUTO and parse_force("  ") == AUTO and parse_force("HandOff") == HANDOFF
    with pytest.raises(ValueError, match=f"{FORCE_ENV_VAR} must be one of auto, reduce, allreduce, handoff, "
                                         "got 'reduce_scatter'"):
        parse_force("reduce_scatter")
    with pytest.raises(ValueError, match="flush algorithm must be one of"):
        FlushCost(None, force="fast")


def test_arrival_order_flush_is_its_runs_or_one_allreduce():
    m = flat_map([1000] * 8, 4)
    entries = [BucketEntry(pid, i * 1000, 1000) for i, pid in enumerate([7, 0, 6, 1])]  # owners 3 0 3 0
    plan = plan_flush(entries, m, reduce_to_owner=True)
    tiny = choose_arrival(plan, FlushCost(ct.topology_of(4, 8)))
    assert tiny.choice == ALLREDUCE and tiny.plan.owner_elems == 0 and len(tiny.collectives) == 1
    assert tiny.plan.received_elems(1) == 4000
    forced = choose_arrival(plan, FlushCost(ct.topology_of(4, 8), force=REDUCE))
    assert forced.choice == REDUCE and [c.root for c in forced.collectives] == [3, 0, 3, 0]
    big = flat_map([50_000_000] * 8, 4)
    entries = [BucketEntry(pid, i * 50_000_000, 50_000_000) for i, pid in enumerate([7, 6])]  # one owner, 200 MB
    plan = plan_flush(entries, big, reduce_to_owner=True)
    assert choose_arrival(plan, FlushCost(ct.topology_of(4, 8))).choice == REDUCE


def test_agreed_topology_from_every_ranks_facts():
    assert agreed_topology(1, [1], [9]) is None
    one_node = agreed_topology(8, [8] * 8, [9] * 8)
    assert (one_node.nodes, one_node.gpus_per_node, one_node.generation) == (1, 8, "hopper")
    assert agreed_topology(8, [8] * 8, [8] * 8).generation == "ampere"
    nodes = agreed_topology(64, [0] * 32 + [8] * 32, [9] * 64)  # some ranks could not tell: the largest wins
    assert (nodes.nodes, nodes.gpus_per_node) == (8, 8)
    assert agreed_topology(4, [0] * 4, [0] * 4).nodes == 1  # CPU, nothing known: one node
    assert agreed_topology(4, [1] * 4, [0] * 4).nodes == 4  # one rank per node
    odd = agreed_topology(12, [8] * 12, [9] * 12)  # 12 ranks are not whole nodes of 8: one rank per node
    assert (odd.nodes, odd.gpus_per_node) == (12, 1)


def test_p2p_round_costs_latency_per_wave_and_the_busiest_ranks_bytes():
    topo = ct.topology_of(1024, 8)
    assert ct.p2p_round_us(0, 0, topo) == 0.0
    one = ct.p2p_round_us(1, 0, topo)
    assert one == pytest.approx(ct.BASE_LATENCY_RING[ct.SIMPLE] + ct.HW_LATENCY[("net", "ring")][ct.SIMPLE])
    assert ct.p2p_round_us(64, 0, topo) == one  # 8 channels x 8 per batch: one wave
    assert ct.p2p_round_us(65, 0, topo) > one
    assert ct.p2p_round_us(1, 48_000_000, topo) == pytest.approx(one + 1000.0)  # 48 MB at one NIC's 48 GB/s
