"""The per-flush algorithm choice as pure logic: never modelled slower than the native runtime, the cheapest
candidate wins (or the forced one), identical inputs give identical choices, and the agreed topology."""

from __future__ import annotations

import pytest

from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.collectives import ALLREDUCE, HANDOFF, NATIVE, REDUCE, REDUCE_SCATTER
from owner_reduce.planning.flush_choice import (
    FlushCost,
    agreed_topology,
    choose,
    choose_arrival,
)
from owner_reduce.planning.flush_plan import BucketEntry, FlushRange, plan_flush
from owner_reduce.planning.host_cost import NONE as NO_HOST_COST
from owner_reduce.planning.owner_layout import map_order, plan_owner_layout, plan_placed
from owner_reduce.planning.owner_map import GroupTables, OwnerMap
from owner_reduce.planning.sizing import backward_order, simulate_flushes
from tests.support.fakes import flat_map

SIZES = [int(1.6 ** k) for k in range(3, 48)]  # 4 elements to 6.5e9 bytes in bf16


def _group(group, ids, numels, ws):
    """One ZeRO optimizer group's tables: its parameters laid flat and cut into ``ws`` equal partitions."""
    total = sum(numels)
    size = max(1, -(-total // ws))
    parts, starts, flat = {}, {r: {} for r in range(ws)}, 0
    for pid, numel in zip(ids, numels, strict=True):
        first, last = min(flat // size, ws - 1), min(max(flat, flat + numel - 1) // size, ws - 1)
        parts[pid] = tuple(range(first, last + 1))
        for r in parts[pid]:
            starts[r][pid] = max(0, r * size - flat)
        flat += numel
    return GroupTables(group=group, param_ids=tuple(ids), numels=tuple(numels), partition_count=ws,
                       partition_ids=parts, start_offsets=starts, same_comm_as_dp=True)


def llama_two_groups(ws, layers=32, hidden=4096, ffn=11008, vocab=32000):
    """Llama-7B's shapes split as a weight-decay optimizer would: matrices in group 0, norms in group 1; the
    parameter ids follow the model's order (norms between matrices), so a flush mixes both groups."""
    order, decay, no_decay = [], [], []
    pid = 0

    def add(numel, group):
        nonlocal pid
        order.append(pid)
        (decay if group == 0 else no_decay).append((pid, numel))
        pid += 1

    add(vocab * hidden, 0)
    for _ in range(layers):
        add(hidden, 1)
        for _ in range(4):
            add(hidden * hidden, 0)
        add(hidden, 1)
        for _ in range(3):
            add(hidden * ffn, 0)
    add(hidden, 1)
    add(vocab * hidden, 0)
    groups = [_group(0, [p for p, _ in decay], [n for _, n in decay], ws),
              _group(1, [p for p, _ in no_decay], [n for _, n in no_decay], ws)]
    return OwnerMap.from_group_tables(groups, dp_world_size=ws), order


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nvls", [True, False])
def test_no_flush_is_modelled_slower_than_native_on_schedule_or_off(nvls):
    """Issue 20's sweep: Llama-7B in two optimizer groups, ws 2-1024, buckets 2e7-1e9. On schedule native's calls are a
    candidate, so the chosen flush costs at most native's calls issued by this runtime; off schedule (a step where
    only some of the flush's gradients arrived, holes between them) the fallback never costs more than those for what
    is present either (issue 23 item 7: the span AllReduce over the holes cost up to 4.3x). Against native
    DeepCompile's own issue (its C++ loop: no host cost charged, ``host_cost``) every flush alone is within one call's
    issue by this runtime: one AllReduce of the flush is always a candidate, never slower on the device than native's
    calls (issue 39: the Python runtime's issue is real; it is what a flush that saves nothing costs more)."""
    worst = {}
    for ws in (2, 3, 8, 64, 100, 512, 1024):
        m, order = llama_two_groups(ws)
        cost = FlushCost(ct.topology_of(ws, 8, nvls=nvls))
        mo = map_order(m)
        for bucket in (int(2e7), int(5e7), int(5e8), int(1e9)):
            for entries in simulate_flushes(m, backward_order(order), bucket):
                grads = [(e.param_id, e.numel) for e in entries]
                capacity = max([bucket] + [n for _, n in grads])
                layout = plan_owner_layout(grads, m, order=mo, cost=cost, capacity=capacity)
                native = cost.native_us(n for _, n in grads)
                assert layout.modelled_us <= dict(layout.costs)[NATIVE] * (1 + 1e-12), (ws, bucket, layout.choice)
                assert layout.modelled_us <= (native + cost.issue_us(1)) * (1 + 1e-12), (ws, bucket, layout.choice)
                assert layout.modelled_us == min(dict(layout.costs).values())
                if len(layout.grads) < 3:
                    continue
                present = layout.grads[::2]  # every other gradient arrived: holes between the pieces
                packed = [FlushRange(0, g.numel, None) for g in present if g.numel]  # staged: offsets unused here
                off = choose_arrival(plan_placed(present, m, True), cost, packed)
                ratio = off_costs(off, cost) / cost.group_us([(ALLREDUCE, g.numel) for g in present if g.numel])
                worst[(ws, bucket)] = max(worst.get((ws, bucket), 0.0), ratio)
    assert max(worst.values()) <= 1.0 + 1e-9, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


def off_costs(choice, cost):
    """The modelled time of what an off-schedule flush runs, alone: its issue, then its calls."""
    return cost.group_us([(c.kind, c.count) for c in choice.collectives])


def test_at_scale_a_partial_flush_hands_off_without_nvls_and_allreduces_with_it():
    """1024 ranks, a 5e8-element bf16 flush of 7B-sized matrices touching 77 owners: one Reduce per owner is by far
    the slowest candidate (a ring latency over 1024 ranks each). Without NVLS the ReduceScatter + hand-off wins;
    against NVLS_TREE's AllReduce it does not, and the flush runs as one AllReduce (native's aggregate)."""
    m = flat_map([4096 * 11008] * 148, 1024)  # 6.7e9 elements, partitions of 6.5e6
    grads = [(pid, m.placement(pid).numel) for pid in range(147, 147 - 11, -1)]  # 496e6 elements
    ring = plan_owner_layout(grads, m, cost=FlushCost(ct.topology_of(1024, 8, nvls=False)))
    costs = dict(ring.costs)
    assert ring.choice == HANDOFF and costs[REDUCE] > 5 * costs[HANDOFF]
    assert costs[HANDOFF] < 0.9 * costs[NATIVE]
    cost = FlushCost(ct.topology_of(1024, 8))
    nvls = plan_owner_layout(grads, m, cost=cost)
    # The same device time as native's 11 calls (NCCL aggregates them into one NVLS_TREE call), one call to issue.
    costs = dict(nvls.costs)
    assert nvls.choice == ALLREDUCE and costs[ALLREDUCE] - cost.issue_us(1) == pytest.approx(
        costs[NATIVE] - cost.issue_us(11), rel=1e-12)
    assert costs[ALLREDUCE] < costs[NATIVE]


def test_a_flush_that_loses_to_native_is_laid_out_as_native():
    """Tiny gradients at 1024 ranks: every owner-path candidate pays ring latencies over 1024 ranks; native's
    AllReduces aggregate into one NVLS_TREE / tree call. The layout is then exactly z1.cpp's: every gradient
    whole, in arrival order, one AllReduce each, every rank receiving everything."""
    m = flat_map([4096] * 2048, 1024)
    grads = [(pid, 4096) for pid in (2047, 5, 1000, 3)]
    cost = FlushCost(ct.topology_of(1024, 8), force=NATIVE)
    layout = plan_owner_layout(grads, m, cost=cost)
    assert layout.choice == NATIVE and layout.plan.owner_elems == 0
    assert [(c.kind, c.offset, c.count) for c in layout.collectives] == [(ALLREDUCE, i * 4096, 4096) for i in range(4)]
    assert [g.pieces[0].bucket_offset for g in layout.grads] == [0, 4096, 8192, 12288]
    assert all(p.root is None for g in layout.grads for p in g.pieces)


def test_choose_takes_the_cheapest_then_the_fewest_calls_or_the_forced_one():
    assert choose({REDUCE: 2.0, ALLREDUCE: 1.0, HANDOFF: 3.0}) == ALLREDUCE
    assert choose({REDUCE: 1.0, ALLREDUCE: 1.0, REDUCE_SCATTER: 1.0}) == REDUCE_SCATTER
    assert choose({REDUCE: 1.0, ALLREDUCE: 1.0}) == REDUCE
    assert choose({REDUCE: 2.0, ALLREDUCE: 1.0, HANDOFF: 3.0}, HANDOFF) == HANDOFF
    assert choose({ALLREDUCE: 1.0}, HANDOFF) == ALLREDUCE  # not a candidate here (nothing owned): the model decides


def test_a_forced_algorithm_the_cost_model_does_not_know_is_refused():
    # (compile.reduce_to_owner_algo's values are checked at config time: tests/pure/test_settings.py)
    with pytest.raises(ValueError, match="flush algorithm must be one of"):
        FlushCost(None, force="fast")


def test_arrival_order_flush_is_its_runs_one_allreduce_or_native():
    m = flat_map([1000] * 8, 4)
    entries = [BucketEntry(pid, i * 1000, 1000) for i, pid in enumerate([7, 0, 6, 1])]  # owners 3 0 3 0
    plan = plan_flush(entries, m, reduce_to_owner=True)
    # NCCL aggregates the four small Reduces into one task: one latency, half an AllReduce's bytes, about 1 us less
    # device time than one AllReduce; but three more calls to issue (issue 39, ``host_cost``): one AllReduce wins.
    # Without the host's cost the Reduces did.
    tiny = choose_arrival(plan, FlushCost(ct.topology_of(4, 8)))
    assert tiny.choice == ALLREDUCE and len(tiny.collectives) == 1
    free = choose_arrival(plan, FlushCost(ct.topology_of(4, 8), host=NO_HOST_COST))
    assert free.choice == REDUCE and len(free.collectives) == 4
    whole = choose_arrival(plan, FlushCost(ct.topology_of(4, 8), force=ALLREDUCE))
    assert whole.choice == ALLREDUCE and whole.plan.owner_elems == 0 and len(whole.collectives) == 1
    assert whole.plan.received_elems(1) == 4000
    per_grad = [FlushRange(e.offset, e.numel, None) for e in entries]
    native = choose_arrival(plan, FlushCost(ct.topology_of(4, 8), force=NATIVE), per_grad)
    assert native.choice == NATIVE and [(c.kind, c.offset) for c in native.collectives] == [
        (ALLREDUCE, 0), (ALLREDUCE, 1000), (ALLREDUCE, 2000), (ALLREDUCE, 3000)]
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
    odd = agreed_topology(12, [8] * 12, [9] * 12)  # 12 ranks are not whole nodes of 8: the last node part-filled
    assert (odd.nodes, odd.gpus_per_node, odd.ranks) == (2, 8, 12)
    # NVLinks: the generation's unless a rank reports fewer; the fewest reported bounds every ring.
    assert ct.nvlinks_of(agreed_topology(64, [8] * 64, [9] * 64)) == 18
    assert ct.nvlinks_of(agreed_topology(64, [8] * 64, [8] * 64, [0] * 64)) == 12
    h800 = agreed_topology(64, [8] * 64, [9] * 64, [0] * 32 + [8] * 32)
    assert ct.nvlinks_of(h800) == 8 and h800.bus_bw < agreed_topology(64, [8] * 64, [9] * 64).bus_bw
    a800 = agreed_topology(8, [8] * 8, [8] * 8, [8] * 8)
    assert (a800.bus_bw, a800.channels) == (ct.A800_NODE.bus_bw, ct.A800_NODE.channels)


def test_p2p_round_costs_latency_per_wave_and_the_busiest_ranks_bytes():
    topo = ct.topology_of(1024, 8)
    assert ct.p2p_channels(topo) == (16, 1)  # paths.cc: pow2Up(16 channels); 4 per net peer halved to fit 1024
    assert ct.p2p_channels(ct.topology_of(64, 8)) == (16, 2)
    assert ct.p2p_channels(ct.topology_of(8, 8)) == (32, 32)  # one node: 2 x 18 NVLinks, capped by the channels
    load = ct.P2pLoad(peers=1, remote_bytes=0, local_bytes=0)
    one = ct.p2p_round_us(ct.P2pLoad(1, 1, 0, 1), topo)
    assert ct.p2p_round_us(ct.P2pLoad(0, 0, 0), topo) == 0.0
    assert ct.p2p_round_parts(ct.P2pLoad(1, 1, 0, 1), topo)[0] == pytest.approx(8.4 + 14.0)
    assert ct.p2p_round_us(ct.P2pLoad(128, 1, 0, 1), topo) == pytest.approx(one)  # 16 channels x 8: one wave
    assert ct.p2p_round_us(ct.P2pLoad(129, 1, 0, 1), topo) == pytest.approx(one + 14.0)
    assert ct.p2p_round_us(load, topo) == pytest.approx(8.4 + 3.4)  # nothing across nodes: an NVLink hop
    # 48 MB through one NIC at 48 GB/s from 4 peers (12 MB each, under one channel's 14 GB/s x 1 ms): 1 ms.
    assert ct.p2p_round_parts(ct.P2pLoad(4, 48_000_000, 0, 12_000_000), topo)[1] == pytest.approx(1000.0)
    # One peer sending all 48 MB is held to its one p2p channel's 14 GB/s.
    assert ct.p2p_round_parts(ct.P2pLoad(1, 48_000_000, 0, 48_000_000), topo)[1] == pytest.approx(48e6 / 14e3)
    # Half the bandwidth: the transfer doubles.
    half = ct.p2p_round_parts(ct.P2pLoad(4, 48_000_000, 0, 12_000_000), topo, bw_scale=0.5)[1]
    assert half == pytest.approx(2000.0)
    # The receiver's incast: eight senders into one rank count on that rank.
    incast = ct.p2p_load([(s, 0, 1000) for s in range(8, 16)], ranks_per_node=8, world_size=16)
    assert (incast.peers, incast.remote_bytes, incast.local_bytes) == (8, 8000, 0)


def test_the_json_plan_lists_a_handoffs_reduce_scatter_then_every_ranks_sends():
    """``size_the_win.py --json``: the hand-off flush above is two NCCL groups, the ReduceScatter (NCCL's count:
    the per-rank chunk) then the send/recv round with every rank's sends; the sends move exactly what each owner
    keeps and no rank sends to itself."""
    from owner_reduce.planning.sizing import issued_groups

    m = flat_map([4096 * 11008] * 148, 1024)
    grads = [(pid, m.placement(pid).numel) for pid in range(147, 147 - 11, -1)]
    layout = plan_owner_layout(grads, m, cost=FlushCost(ct.topology_of(1024, 8, nvls=False)))
    collective, sends = issued_groups(layout, 1024)
    (rs,) = collective
    assert (rs.kind, rs.elements, rs.comm, rs.comm_size) == (REDUCE_SCATTER, layout.collectives[0].per_rank,
                                                              "world", 1024)
    assert len(sends) == len(layout.transfers) > 0
    assert all(s.kind == "send" and s.rank != s.peer and s.elements > 0 for s in sends)
    received: dict[int, int] = {}
    for s in sends:
        received[s.peer] = received.get(s.peer, 0) + s.elements
    kept = {r.root: r.count for r in layout.plan.ranges}
    assert all(received[dst] <= kept[dst] for dst in received)  # what arrives is part of what the owner keeps
    native = plan_owner_layout(grads, m, cost=FlushCost(ct.topology_of(1024, 8), force=NATIVE))
    (group,) = issued_groups(native, 1024)
    assert [(c.kind, c.elements) for c in group] == [(ALLREDUCE, n) for _, n in grads]
