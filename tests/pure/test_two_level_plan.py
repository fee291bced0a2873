"""The two-level flush's plan, without processes: its layout and calls carry every owner's sum to the owner (a
numeric simulation of both levels on every rank), its cost and choice, and the plan's listing in the sizing."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from harness.faults import wrong_rail
from owner_reduce.planning import owner_layout, two_level
from owner_reduce.planning.collective_time import rail, topology_of
from owner_reduce.planning.collectives import NODE, NODE_HANDOFF, RAIL, TWO_LEVEL, WORLD
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.owner_layout import map_order, plan_owner_layout
from owner_reduce.planning.settings import parse_settings
from owner_reduce.planning.sizing import issued_groups
from owner_reduce.planning.step_plan import FlushTimes, plan_step
from owner_reduce.planning.two_level import (
    BALANCED,
    TwoLevelGeometry,
    balanced_parts,
    balanced_sizes,
    rail_blocks,
    two_level_calls,
    two_level_of,
)
from tests.support.fakes import flat_map


def _cost(world_size: int, per_node: int, force: str = TWO_LEVEL) -> FlushCost:
    topology = topology_of(world_size, per_node)
    return FlushCost(topology, 4, force=force, two_level=two_level_of(topology, per_node))


def _simulate(layout, world_size: int, per_node: int) -> list[torch.Tensor]:
    """Every rank's bucket after the layout's calls: rank r's input is ``(r + 1) * base``; node ReduceScatters sum
    within each node into each local rank's block, rail Reduces sum across nodes into the root node's rank on that
    rail; whatever a call leaves undefined becomes NaN. Returns the buckets."""
    base = torch.arange(1, layout.total + 1, dtype=torch.float64)
    bufs = [base * (r + 1) for r in range(world_size)]
    for p in layout.padding:
        for b in bufs:
            b[p.offset:p.offset + p.count] = 0
    nodes = world_size // per_node
    for c in layout.collectives:
        if c.comm == NODE and c.root is not None:  # a tail stage's node Reduce: to local rank ``root``
            for m in range(nodes):
                members = range(m * per_node, (m + 1) * per_node)
                total = sum(bufs[r][c.offset:c.offset + c.count] for r in members)
                for r in members:
                    bufs[r][c.offset:c.offset + c.count] = total if r % per_node == c.root else float("nan")
        elif c.comm == NODE:
            for m in range(nodes):
                members = range(m * per_node, (m + 1) * per_node)
                total = sum(bufs[r][c.offset:c.offset + c.count] for r in members)
                for r in members:
                    local = r % per_node
                    keep = total[local * c.per_rank:(local + 1) * c.per_rank].clone()
                    bufs[r][c.offset:c.offset + c.count] = float("nan")
                    bufs[r][c.offset + local * c.per_rank:c.offset + (local + 1) * c.per_rank] = keep
        elif c.comm == RAIL and c.kind == "reduce_scatter":  # rail rank (node) m keeps part m of the slice
            members = [m * per_node + c.rail for m in range(nodes)]
            total = sum(bufs[r][c.offset:c.offset + c.count] for r in members)
            for m, r in enumerate(members):
                keep = total[m * c.per_rank:(m + 1) * c.per_rank].clone()
                bufs[r][c.offset:c.offset + c.count] = float("nan")
                bufs[r][c.offset + m * c.per_rank:c.offset + (m + 1) * c.per_rank] = keep
        elif c.comm == RAIL and c.kind == "handoff":  # the rail's hand-off round of that stage
            for t in layout.transfers:
                if t.comm == RAIL and t.stage == c.stage and t.src % per_node == c.rail:
                    bufs[t.dst][t.offset:t.offset + t.count] = bufs[t.src][t.offset:t.offset + t.count]
        elif c.comm == NODE_HANDOFF:  # a balanced layout's hand-off round inside every node, that stage's
            moved = [(t, bufs[t.src][t.offset:t.offset + t.count].clone()) for t in layout.transfers
                     if t.comm == NODE_HANDOFF and t.stage == c.stage]
            for t, values in moved:
                bufs[t.dst][t.offset:t.offset + t.count] = values
        elif c.comm == RAIL:
            members = [m * per_node + c.rail for m in range(nodes)]
            total = sum(bufs[r][c.offset:c.offset + c.count] for r in members)
            for r in members:
                bufs[r][c.offset:c.offset + c.count] = total if r // per_node == c.root else float("nan")
        else:
            assert c.comm == WORLD
            total = sum(b[c.offset:c.offset + c.count] for b in bufs)
            for b in bufs:
                b[c.offset:c.offset + c.count] = total
    return bufs, base * sum(range(1, world_size + 1))


@pytest.mark.parametrize(("world_size", "per_node"), [(4, 2), (6, 2), (8, 4), (16, 4)])
def test_every_owner_receives_the_full_sum_of_its_pieces(world_size, per_node):
    owner_map = flat_map([37, 5, 64, 3, 90, 11, 26, 8, 55], world_size)
    grads = [(p.param_id, p.numel) for p in owner_map][::-1]
    layout = plan_owner_layout(grads, owner_map, cost=_cost(world_size, per_node))
    assert layout.choice == TWO_LEVEL and layout.stages >= 1 and layout.algo == TWO_LEVEL
    bufs, want = _simulate(layout, world_size, per_node)
    checked = 0
    for g in layout.grads:
        for p in g.pieces:
            ranks = range(world_size) if p.root is None else [p.root]
            for r in ranks:
                got = bufs[r][p.bucket_offset:p.bucket_offset + p.length]
                assert torch.equal(got, want[p.bucket_offset:p.bucket_offset + p.length]), (g.param_id, p, r)
                checked += p.length
    assert checked >= sum(n for _, n in grads)
    # The negative control: one region reduced on the wrong rail leaves its owner without the sum.
    broken = wrong_rail(layout)
    bufs, want = _simulate(broken, world_size, per_node)
    assert any(not torch.equal(bufs[p.root][p.bucket_offset:p.bucket_offset + p.length],
                               want[p.bucket_offset:p.bucket_offset + p.length])
               for g in broken.grads for p in g.pieces if p.root is not None)


def test_stages_cut_owner_regions_and_copy_out_segments_cover_each_piece():
    owner_map = flat_map([1000, 24, 600], 4)
    layout = plan_owner_layout([(p.param_id, p.numel) for p in owner_map], owner_map, cost=_cost(4, 2))
    sizes = [sum(p.length for g in layout.grads for p in g.pieces if p.root == r) for r in range(4)]
    _, option = _cost(4, 2).two_level.time_us(sizes, 4)
    geo = option.geometry
    assert geo.stages == layout.stages and geo.span <= layout.total
    for g in layout.grads:
        segments = g.segments(0, g.numel)
        assert sum(n for _, n in segments) == g.numel
    nodes = [c for c in layout.collectives if c.comm == NODE]
    assert len(nodes) == layout.stages and all(c.count == 2 * c.per_rank for c in nodes)
    assert {c.rail for c in layout.collectives if c.comm == RAIL} == {0, 1}


def test_the_model_prefers_two_level_at_scale_and_never_where_it_cannot_apply():
    assert two_level_of(topology_of(8, 8), 8) is None  # one node
    assert two_level_of(topology_of(100, 8), 8) is None  # a last node partly filled
    assert two_level_of(topology_of(64, 1), 1) is None  # one rank per node
    levels = two_level_of(topology_of(1024, 8), 8)
    assert levels.nodes == 128 and levels.rail.ranks == 128 and levels.node.ranks == 8
    assert levels.rail_groups()[3] == tuple(m * 8 + 3 for m in range(128))
    # A 1 GB bf16 flush over 76 consecutive owners at ws 1024. Alone, a two-level flush loses to NVLS_TREE's
    # AllReduce by physics (each rail Reduce pays a hop per node): the step's plan keeps the AllReduce for it. Eight
    # of them in a step overlap their levels (the next node step during this rail step) and beat it.
    per = 6_500_000
    sizes = [per if 300 <= o < 376 else 0 for o in range(1024)]
    t, option = levels.time_us(sizes, 2)
    allreduce = FlushCost(topology_of(1024, 8)).calls_us([("allreduce", sum(sizes))])
    assert t > allreduce
    flush = [FlushTimes(world_us=allreduce)] + [FlushTimes(o.stage_us) for o in levels.options(sizes, 2)]
    assert plan_step([flush], [allreduce], [0]).picks == (0,)
    step = plan_step([flush] * 8, [allreduce] * 8, [0] * 8)
    assert all(step.picks) and step.overlapped and step.end_us < 0.85 * 8 * allreduce
    # The time is physical whatever NCCL's table says (a rail Reduce pays a hop per rank): a rail graph without
    # sameChannels only lets NCCL's table pick the protocol the chain favours, never a dearer time.
    other = dataclasses.replace(levels, rail=rail(128, same_channels=False))
    assert other.time_us(sizes, 2)[0] <= t
    assert parse_settings({"reduce_to_owner_algo": "two_level"}).flush_algo == TWO_LEVEL


def test_the_json_plan_lists_node_and_rail_calls_on_their_communicators():
    owner_map = flat_map([37, 5, 64, 3, 90, 11, 26, 8, 55], 8)
    layout = plan_owner_layout([(p.param_id, p.numel) for p in owner_map], owner_map, order=map_order(owner_map),
                               cost=_cost(8, 4))
    groups = issued_groups(layout, 8)
    calls = [c for g in groups for c in g]
    node = [c for c in calls if c.comm == NODE]
    rails = [c for c in calls if c.comm == RAIL and c.kind != "send"]
    assert node and all(c.comm_size == 4 and c.kind == "reduce_scatter" for c in node)
    assert rails and all(c.comm_size == 2 and 0 <= c.rail < 4 and c.stage is not None for c in rails)
    assert all(c.root in (0, 1) if c.kind == "reduce" else c.kind == "reduce_scatter" for c in rails)
    assert len(groups) >= 2 * layout.stages
    # The calls per flush the sizing reports are one rank's: its node's, its rail's (the busiest), the world's.
    per_rail = [sum(c.rail == r for c in rails) for r in range(4)]
    world = sum(c.comm == WORLD for c in calls)
    assert layout.calls == len(node) + max(per_rail) + world < len(calls)


@pytest.mark.parametrize("scattered", [0, 1, 2, 3])
def test_unequal_blocks_reduce_their_tails_in_the_node_and_every_owner_gets_its_sum(scattered):
    """10 owners over 4 local ranks (blocks of 3, 3, 2 and 2 regions): the first ``scattered`` stages run a node
    ReduceScatter (the short blocks padded), the rest node Reduces of the blocks that reach them (no padding)."""
    world_size, per_node, width = 16, 4, 700
    sizes = [0] * 3 + [(1000, 900, 1100)[o % 3] for o in range(10)] + [0] * 3
    lengths = tuple(sum(b) for b in rail_blocks(sizes, per_node))
    stages = -(-max(lengths) // width)
    geo = TwoLevelGeometry(per_node, stages, width, scattered, lengths)
    calls, received, padding, _ = two_level_calls(sizes, geo)
    assert sum(p.count for p in padding) == sum(geo.padding(local) for local in range(per_node))
    assert geo.span == sum(lengths) + sum(p.count for p in padding)
    node = [c for c in calls if c.comm == NODE]
    assert [c.stage for c in node if c.kind == "reduce_scatter"] == list(range(scattered))
    tail = [c for c in node if c.kind == "reduce"]
    assert {c.stage for c in tail} == set(range(scattered, stages))
    assert all(c.count <= width and 0 <= c.root < per_node for c in tail)
    bufs, want = _simulate(SimpleNamespace(collectives=calls, padding=padding, total=geo.span), world_size, per_node)
    assert sum(r.count for r in received) == sum(sizes)
    for r in received:
        assert torch.equal(bufs[r.root][r.offset:r.offset + r.count], want[r.offset:r.offset + r.count]), r


def test_a_flush_whose_padding_would_pass_the_bound_runs_its_tails_as_node_reduces():
    """Llama-13B's 5e8 bf16 flushes at ws 512: about 20 owners of 25.4M elements over 8 local ranks. Padded to the
    longest block they need about a quarter more; within the bound (an eighth) the Reduce chains' layout runs the
    longer blocks' tails as node Reduces instead, and no option pads past the bound."""
    levels = two_level_of(topology_of(512, 8), 8)
    per = 13_015_864_320 // 512
    sizes = [0] * 512
    for owner in range(3, 23):
        sizes[owner] = per
    sizes[3], sizes[22] = per // 3, per // 2  # the flush starts and ends inside an owner's region
    bound = sum(sizes) // 8
    options = levels.options(sizes, 2, max_padding=bound)
    assert options and all(sum(o.geometry.padding(local) for local in range(8)) <= bound for o in options)
    chains = [o for o in options if o.rail_step == "reduce" and o.rail_layout != BALANCED]
    assert chains and all(o.geometry.scattered < o.geometry.stages for o in chains)
    geo = chains[0].geometry  # every stage a ReduceScatter would pad past the bound
    padded = TwoLevelGeometry(8, geo.stages, geo.width, geo.stages, geo.lengths)
    assert sum(padded.padding(local) for local in range(8)) > bound


def test_recost_gives_an_option_its_own_times_and_other_ones_at_another_bandwidth():
    """``TwoLevel.recost`` (the sizing's hand-off sensitivity): an option costed again under its own model has its own
    stage times; under a rail hand-off at a quarter of its bandwidth a rail ReduceScatter step gets dearer and a Reduce
    chain does not (it sends nothing point to point across nodes; a balanced layout's NVLink hand-off is not the
    network's); the geometry and rail step stay."""
    topo = topology_of(512, 8, "hopper", nvls=True)
    full, quarter = two_level_of(topo, 8), two_level_of(topo, 8, p2p_bw_scale=0.25)
    sizes = [0] * 512
    for owner in range(100, 140):
        sizes[owner] = 5_000_000 + 1000 * owner
    options = full.options(sizes, 2)
    assert {o.rail_step for o in options} == {"reduce", "scatter"}
    for option in options:
        assert full.recost(sizes, option, 2) == option
        again = quarter.recost(sizes, option, 2)
        assert (again.geometry, again.rail_step) == (option.geometry, option.rail_step)
        nodes_same = all(a[0] == b[0] for a, b in zip(again.stage_us, option.stage_us, strict=True))
        rails = [(a[1], b[1]) for a, b in zip(again.stage_us, option.stage_us, strict=True)]
        if option.rail_step == "scatter":
            assert nodes_same and all(a > b for a, b in rails), (option, again)
        else:
            assert again == option


def _assert_every_owner_has_its_sum(layout, world_size, per_node):
    bufs, want = _simulate(layout, world_size, per_node)
    checked = 0
    for g in layout.grads:
        for p in g.pieces:
            for r in range(world_size) if p.root is None else [p.root]:
                got = bufs[r][p.bucket_offset:p.bucket_offset + p.length]
                assert torch.equal(got, want[p.bucket_offset:p.bucket_offset + p.length]), (g.param_id, p, r)
                checked += p.length
    return checked


@pytest.mark.parametrize("rail_step", ["reduce", "scatter"])
@pytest.mark.parametrize(("world_size", "per_node"), [(4, 2), (6, 2), (8, 4), (16, 4)])
def test_balanced_rails_carry_every_region_on_every_rail_and_hand_each_part_to_its_owner(world_size, per_node,
                                                                                         rail_step, monkeypatch):
    """Note (balanced rails): every owner region cut into ``per_node`` parts, part ``j`` reduced across nodes on
    rail ``j`` to local rank ``j`` of the owner's node, then handed to the owner over the node: every owner gets its
    sum, every rail carries a part of every region. Negative control: one part handed to the wrong local rank."""
    monkeypatch.setattr(two_level, "RAIL_LAYOUTS", (BALANCED,))
    monkeypatch.setattr(two_level, "RAIL_STEPS", (rail_step,))
    if rail_step == "scatter":  # a flush of 299 elements: slices of nodes x 4 (aligned) pad past an eighth of it
        monkeypatch.setattr(owner_layout, "TWO_LEVEL_MAX_PADDING_SHARE", 4.0)
    owner_map = flat_map([37, 5, 64, 3, 90, 11, 26, 8, 55], world_size)
    grads = [(p.param_id, p.numel) for p in owner_map][::-1]
    layout = plan_owner_layout(grads, owner_map, cost=_cost(world_size, per_node))
    assert layout.choice == TWO_LEVEL and layout.rail_step == rail_step
    assert _assert_every_owner_has_its_sum(layout, world_size, per_node) >= sum(n for _, n in grads)
    moves = [t for t in layout.transfers if t.comm == NODE_HANDOFF]
    assert moves and all(t.src // per_node == t.dst // per_node and t.src != t.dst for t in moves)
    assert {c.stage for c in layout.collectives if c.comm == NODE_HANDOFF} == {t.stage for t in moves}
    sizes = [sum(p.length for g in layout.grads for p in g.pieces if p.root == r) for r in range(world_size)]
    blocks = rail_blocks(balanced_sizes(sizes, per_node), per_node)
    assert max(map(sum, blocks)) - min(map(sum, blocks)) <= len([s for s in sizes if s])  # even to an element each
    wrong = moves[0]
    broken = dataclasses.replace(layout, transfers=tuple(
        dataclasses.replace(t, dst=t.dst - t.dst % per_node + (t.dst + 1) % per_node) if t is wrong else t
        for t in layout.transfers))
    bufs, want = _simulate(broken, world_size, per_node)
    assert not torch.equal(bufs[wrong.dst][wrong.offset:wrong.offset + wrong.count],
                           want[wrong.offset:wrong.offset + wrong.count])


def test_balanced_parts_follow_each_block_node_by_node_and_owner_by_owner():
    sizes = [10, 0, 7, 3, 0, 5, 0, 0]  # two nodes of 4: node 0 owners 0, 2, 3; node 1 owner 5
    parts = balanced_parts(sizes, 4)
    assert balanced_sizes(sizes, 4) == [3 + 2 + 1, 3 + 2 + 1, 2 + 2 + 1, 2 + 1 + 0, 2, 1, 1, 1]
    block0 = [(o, n, at) for o, _, j, at, n in parts if j == 0]
    assert block0 == [(0, 3, 0), (2, 2, 3), (3, 1, 5), (5, 2, 6)]
    for owner, size in enumerate(sizes):
        assert sum(n for o, _, _, _, n in parts if o == owner) == size


def test_the_balanced_hand_off_is_costed_on_both_streams_and_chosen_where_rails_are_uneven():
    """ws 64 in nodes of 8, a flush of 3 large owners on local ranks 6, 7 and 0: by owner, 3 of 8 rails carry it;
    balanced, all 8 carry an eighth, and the NVLink hand-off is charged to both streams."""
    cost = _cost(64, 8, force="auto")
    sizes = [0] * 64
    sizes[54], sizes[55], sizes[56] = 61_079_600, 203_372_880, 194_309_760
    options = cost.two_level.options(sizes, cost.dtype_bytes, host=cost.host_cost)
    by_owner = min((o for o in options if o.rail_layout != BALANCED), key=lambda o: o.alone_us)
    balanced = min((o for o in options if o.rail_layout == BALANCED), key=lambda o: o.alone_us)
    assert balanced.alone_us < 0.6 * by_owner.alone_us  # 3 of 8 rails carried it
    again = cost.two_level.recost(sizes, balanced, cost.dtype_bytes)
    assert again.stage_us == balanced.stage_us
    align = balanced.geometry.align  # 4 fp32 elements: these regions' slots are their sizes, cut at multiples of 4
    bare = cost.two_level._stage_costs(balanced.rail_step, rail_blocks(balanced_sizes(sizes, 8, align), 8),
                                       balanced.geometry.lengths, balanced.geometry.width, balanced.geometry.stages,
                                       cost.dtype_bytes)
    handoff, handoff_calls = cost.two_level._node_handoff_us(sizes, balanced.geometry.width, balanced.geometry.stages,
                                                             cost.dtype_bytes)
    (node, rail_), = balanced.stage_us[:1]
    assert handoff[0] > 0 and node == pytest.approx(bare[0] + handoff[0]) and rail_ == pytest.approx(
        bare[2][0] + handoff[0])
    # Its issue too (issue 39): the node ReduceScatter, the busiest rail's Reduces, the hand-off's sends and receives,
    # three groups.
    rail_calls, rail_groups = bare[3][0]
    assert handoff_calls[0] > 0 and balanced.stage_issue[0] == pytest.approx(
        cost.host_cost.issue_us(1 + rail_calls + handoff_calls[0], 1 + rail_groups + 1, stages=1))
