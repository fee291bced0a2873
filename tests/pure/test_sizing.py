"""size_the_win: the pure arithmetic on hand-built owner maps with known answers, the GPT presets, and one run
of the command in a subprocess (the fake process group it uses is process-global, so never in this process)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from owner_reduce.offline_sizing.fake_engine import ModelSpec, size_in_subprocess
from owner_reduce.offline_sizing.gpt_presets import GPT, PRESETS, build_gpt, build_uninitialized
from owner_reduce.planning.aggregation import MAX_TASKS
from owner_reduce.planning.flush_plan import ALL, BucketEntry, FlushRange, plan_flush
from owner_reduce.planning.host_cost import DEFAULT as DEFAULT_HOST
from owner_reduce.planning.owner_map import GroupTables, OwnerMap
from owner_reduce.planning.sizing import (
    DEFAULT_BUCKET_SIZE,
    Cluster,
    backward_order,
    delivered_bytes,
    element_share,
    format_report,
    report_to_dict,
    ring_time,
    simulate_flushes,
    size_buckets,
    size_the_win,
)
from research.published_check import format_published_check, published_check

REPO = Path(__file__).resolve().parents[2]
INIT_LINE = re.compile(r"^DeepCompile reduce_to_owner: (\d+)/(\d+) gradients reduce to one rank(; (\d+) straddling "
                       r"(?:gradient reduces in slices to its|gradients reduce in slices to their) owners "
                       r"\((\d+\.\d)% of elements on the owner path\))?$")


def _map() -> OwnerMap:
    # ws=2, partition size 9. Flat: p0 [0,6) p1 [6,10) p2 [10,15) p3 [15,18).
    # Rank 0 keeps p0 and p1[0:3]; rank 1 keeps p1[3:4], p2, p3. p1 straddles.
    return OwnerMap.from_group_tables([GroupTables(
        group=0, param_ids=(0, 1, 2, 3), numels=(6, 4, 5, 3), partition_count=2,
        partition_ids={0: (0,), 1: (0, 1), 2: (1,), 3: (1,)},
        start_offsets={0: {0: 0, 1: 0}, 1: {1: 3, 2: 0, 3: 0}}, same_comm_as_dp=True)], dp_world_size=2)


def _single_rank_map(numels: tuple[int, ...]) -> OwnerMap:
    ids = tuple(range(len(numels)))
    return OwnerMap.from_group_tables([GroupTables(
        group=0, param_ids=ids, numels=numels, partition_count=1, partition_ids={i: (0,) for i in ids},
        start_offsets={0: dict.fromkeys(ids, 0)}, same_comm_as_dp=True)], dp_world_size=1)


@pytest.mark.timeout(30)
def test_element_share_counts_single_owner_elements():
    s = element_share(_map())
    assert (s.params, s.elems) == (4, 18)
    assert (s.single_owner_params, s.single_owner_elems) == (3, 14)
    assert (s.straddling_params, s.straddling_elems) == (1, 4)
    assert s.other_comm_params == 0
    assert s.share == pytest.approx(14 / 18)


@pytest.mark.timeout(30)
def test_delivered_bytes_per_rank():
    d = delivered_bytes(_map(), dtype_bytes=2)
    # AllReduce: every rank receives all 18 elements.
    assert d.allreduce.per_rank == (36, 36)
    # Owner path: rank 0 gets p0 (6) + the straddler (4); rank 1 gets p2+p3 (8) + the straddler (4).
    assert d.owner.per_rank == (20, 24) and d.owner.mean == 22 and d.owner.max == 24 and d.owner.min == 20
    # Kept by the optimizer, and the sliced bound without other-communicator groups: the partitions.
    assert d.kept.per_rank == (18, 18) and d.sliced.per_rank == (18, 18)
    assert d.owner_over_allreduce == pytest.approx(22 / 36)
    assert delivered_bytes(_map(), dtype_bytes=4).owner.per_rank == (40, 48)


@pytest.mark.timeout(30)
def test_flushes_follow_deepcompile_bucket_rules():
    m = _map()
    order = backward_order([0, 1, 2, 3])
    assert order == (3, 2, 1, 0)
    # Bucket of 10: p3+p2 fill 8, p1 would overflow -> flush; p1+p0 fill exactly 10 -> flushed at the end.
    flushes = simulate_flushes(m, order, bucket_size=10)
    assert flushes == ((BucketEntry(3, 0, 3), BucketEntry(2, 3, 5)),
                       (BucketEntry(1, 0, 4), BucketEntry(0, 4, 6)))
    assert len(simulate_flushes(m, order, bucket_size=100)) == 1
    with pytest.raises(ValueError):
        simulate_flushes(m, order, bucket_size=0)


@pytest.mark.timeout(30)
def test_oversized_gradient_grows_one_of_the_double_buffers():
    m = _single_rank_map((2, 10, 3, 3, 3))  # a, b (larger than the bucket), c, d, e in arrival order
    order = (0, 1, 2, 3, 4)
    ids = [[e.param_id for e in f] for f in simulate_flushes(m, order, bucket_size=4, double_buffer=False)]
    assert ids == [[0], [1], [2, 3, 4]]  # the one buffer stays grown to 10 after b
    ids = [[e.param_id for e in f] for f in simulate_flushes(m, order, bucket_size=4, double_buffer=True)]
    assert ids == [[0], [1], [2], [3, 4]]  # c lands in the other, still 4-element buffer


@pytest.mark.timeout(30)
def test_calls_and_ring_times_small_bucket():
    b = size_buckets(_map(), backward_order([0, 1, 2, 3]), bucket_size=10)
    first, second = b.flushes
    # Flush 1 (p3, p2, both rank 1): one merged Reduce instead of two AllReduces.
    assert (first.native_calls, first.owner_calls, first.sliced_calls) == (2, 1, 1)
    # Flush 2 (p1 straddles, p0 rank 0): AllReduce + Reduce; sliced: [0,3)->0, [3,4)->1, [4,10)->0.
    assert (second.native_calls, second.owner_calls, second.sliced_calls) == (2, 2, 3)
    assert (b.native_calls, b.owner_calls, b.sliced_calls) == (4, 3, 4)
    # n=2: AllReduce costs 2(n-1)/n = 1 x S; one root S; rank 1 roots nothing in flush 2.
    assert (first.native_time, first.owner_time, first.sliced_time) == (8, 8, 8)
    assert (second.native_time, second.owner_time, second.sliced_time) == (10, 10, 9)
    assert b.owner_time_ratio == pytest.approx(1.0) and b.sliced_time_ratio == pytest.approx(17 / 18)


@pytest.mark.timeout(30)
def test_calls_and_ring_times_one_bucket():
    b = size_buckets(_map(), backward_order([0, 1, 2, 3]), bucket_size=100)
    (flush,) = b.flushes
    assert (flush.tasks, flush.elems, flush.owner_elems) == (4, 18, 14)
    assert (flush.native_calls, flush.owner_calls, flush.sliced_calls) == (4, 3, 4)
    # Owner: AllReduce of 4 (x1) + Reduces of 8 to rank 1 and 6 to rank 0: busiest rank sends 4 + 8 = 12.
    assert flush.owner_time == 12 and flush.native_time == 18 and flush.sliced_time == 9
    assert b.owner_time_ratio == pytest.approx(2 / 3) and b.sliced_time_ratio == pytest.approx(0.5)


@pytest.mark.timeout(30)
def test_ring_model_matches_the_design_numbers_at_n8():
    s = 8_000
    allreduce = ring_time([FlushRange(0, s, ALL)], 8)
    assert allreduce == pytest.approx(1.75 * s)
    # One root: S/B -> 4/7 of AllReduce; split evenly over all 8 owners: (n-1)/n -> 1/2.
    assert ring_time([FlushRange(0, s, 3)], 8) / allreduce == pytest.approx(4 / 7)
    even = [FlushRange(i * 1000, 1000, i) for i in range(8)]
    assert ring_time(even, 8) / allreduce == pytest.approx(0.5)
    assert ring_time([FlushRange(0, s, ALL)], 1) == 0.0


@pytest.mark.timeout(30)
def test_sliced_ranges_merge_adjacent_same_owner():
    entries = [BucketEntry(3, 0, 3), BucketEntry(2, 3, 5), BucketEntry(1, 8, 4), BucketEntry(0, 12, 6)]
    ranges = plan_flush(entries, _map(), reduce_to_owner=True).ranges
    assert ranges == (FlushRange(0, 8, 1), FlushRange(8, 3, 0), FlushRange(11, 1, 1),
                                              FlushRange(12, 6, 0))


@pytest.mark.timeout(30)
def test_report_text_and_json():
    m = _map()
    report = size_the_win(m, backward_order([0, 1, 2, 3]), (100, 10), model="hand-built", dtype="fp32")
    text = format_report(report)
    assert text.splitlines()[0] == ("DeepCompile reduce_to_owner: 3/4 gradients reduce to one rank; 1 straddling "
                                    "gradient reduces in slices to its owners (100.0% of elements on the owner path)")
    assert INIT_LINE.match(text.splitlines()[0])
    assert "77.8%" in text  # share of elements on the owner path
    assert "bucket 100 elements: 1 flush per step " in text and "bucket 10 elements: 2 flushes per step " in text
    assert "  straddling   1 param, 4 elements " in text
    data = json.loads(json.dumps(report_to_dict(report)))
    assert data["delivered"]["dtype_bytes"] == 4 and data["share"]["share"] == pytest.approx(14 / 18)
    assert [b["owner_calls"] for b in data["buckets"]] == [3, 3]
    with pytest.raises(ValueError):
        size_the_win(m, (3, 2, 1, 0), (10,), model="x", dtype="int3")


@pytest.mark.timeout(60)
def test_presets_shapes_and_uninitialized_build():
    assert PRESETS["gpt2-124m"].num_params() == 124_439_808  # GPT-2 small with its tied head
    for config in PRESETS.values():
        with torch.device("meta"):
            model = GPT(config)
        assert sum(p.numel() for p in model.parameters()) == config.num_params()
    assert 0.95e9 < PRESETS["1b"].num_params() < 1.1e9
    empty = build_uninitialized(lambda: GPT(PRESETS["tiny"]), dtype=torch.float32)
    assert empty.wte.weight.dtype == torch.float32 and empty.wte.weight.device.type == "cpu"
    # The preset is a real model: a forward pass of the initialized tiny one gives a finite loss.
    model = build_gpt(PRESETS["tiny"])
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 8))
    assert torch.isfinite(model(tokens, tokens))


@pytest.mark.timeout(30)
def test_uninitialized_build_keeps_tied_weights():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = build_uninitialized(Tied)
    assert model.embed.weight is model.head.weight and model.embed.weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == 1
    assert not torch.__future__.get_swap_module_params_on_conversion()  # restored


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "scripts/size_the_win.py", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.timeout(240)
def test_command_on_tiny_preset_json_two_world_sizes():
    # Two world sizes: each is sized in its own spawned process (the fake group is process-global).
    result = _run("--model", "tiny", "--world-size", "2", "4", "--bucket-size", "20000", "5e8", "--report-json",
                  timeout=200)
    data = json.loads(result.stdout)  # stdout is the JSON alone; DeepSpeed's chatter went to stderr
    assert [r["world_size"] for r in data["reports"]] == [2, 4]
    for r in data["reports"]:
        match = INIT_LINE.match(r["summary_line"])
        assert match and int(match.group(1)) == r["share"]["single_owner_params"]
        assert int(match.group(4) or 0) == r["share"]["straddling_params"]
        assert int(match.group(2)) == r["share"]["params"] == 2 + 2 * 12 + 2  # wte, wpe, 2 blocks, ln_f
        assert r["share"]["elems"] == PRESETS["tiny"].num_params()
        d = r["delivered"]
        assert d["owner"]["max"] <= d["allreduce"]["max"] and d["owner"]["mean"] <= d["allreduce"]["mean"]
        assert d["kept"]["mean"] * r["world_size"] >= d["allreduce"]["mean"]  # partitions cover everything
        assert [b["bucket_size"] for b in r["buckets"]] == [20000, 500_000_000]
        small, large = r["buckets"]
        assert small["flush_count"] > 1 and large["flush_count"] == 1
        for b in r["buckets"]:
            assert b["native_calls"] == r["share"]["params"]  # one AllReduce per gradient
            for f in b["flushes"]:
                assert f["owner_calls"] <= f["native_calls"]
                assert f["owner_time"] <= f["native_time"] + 1e-9
            assert 0 < b["owner_time_ratio"] <= 1.0


@pytest.mark.timeout(180)
def test_command_writes_the_plan_per_flush_and_sizes_a_world_of_100(tmp_path):
    """Issue 20 item 6's schema, and issue 23 item 8: a world size that is not whole nodes of 8 gets a table."""
    plan_file = tmp_path / "plan.json"
    result = _run("--model", "tiny", "--world-size", "100", "--bucket-size", "20000", "--summary",
                  "--handoff-sensitivity", "--json", str(plan_file), timeout=150)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny | 100 |")]
    assert len(rows) == 1 and "hand-off at 0.25x bw" in result.stdout and "**" in rows[0], result.stdout
    assert "chosen again" in rows[0]
    assert re.search(r"^ws 100: 13 nodes x 8 GPUs, network .*, 100 ranks \(last node partly filled\)$", result.stdout,
                     re.M), result.stdout
    plan = json.loads(plan_file.read_text())
    assert {"model", "world_size", "ranks_per_node", "gpu_generation", "dtype_bytes", "bucket_elems",
            "flushes"} <= set(plan)
    assert (plan["world_size"], plan["ranks_per_node"], plan["gpu_generation"], plan["dtype_bytes"],
            plan["bucket_elems"]) == (100, 8, "hopper", 2, 20000)
    assert "last node partly filled" in plan["topology"]
    assert sum(len(f["gradients"]) for f in plan["flushes"]) == 2 + 2 * 12 + 2
    one_call = DEFAULT_HOST.issue_us(1)  # what this runtime needs to issue one call (issue 39)
    for f in plan["flushes"]:
        assert {"index", "gradients", "groups", "algo", "modelled_us", "native_modelled_us", "host_us",
                "native_host_us"} <= set(f)
        # One AllReduce of the flush is a candidate: never slower on the device than native's calls, one call to issue.
        assert 0 < f["modelled_us"] <= (f["native_modelled_us"] - f["native_host_us"] + one_call) * (1 + 1e-12)
        assert 0 < f["host_us"] < f["modelled_us"] and f["native_host_us"] == 0.0
        for group in f["groups"]:
            for call in group:
                assert set(call) == {"kind", "elements", "root", "peer", "rank", "comm", "comm_size", "rail",
                                     "stage"}
                assert call["kind"] in {"allreduce", "reduce", "reduce_scatter", "send", "recv"}
                assert call["comm"] == "world" and call["comm_size"] == 100 and call["elements"] > 0
                assert (call["root"] is not None) == (call["kind"] == "reduce")
                assert (call["peer"] is not None) == (call["rank"] is not None) == (call["kind"] == "send")
        if f["choice"] == "native":
            (group,) = f["groups"]
            assert [c["elements"] for c in group] == [n for n in f["gradients"] if n]
        reduced = sum(c["elements"] * (100 if c["kind"] == "reduce_scatter" else 1)
                      for c in f["groups"][0])
        assert reduced >= sum(f["gradients"])  # every element reduced at least once (padding may add)


@pytest.mark.timeout(180)
def test_a_calibration_file_changes_the_sizing_and_a_wrong_world_size_is_refused(tmp_path):
    """Issue 20 item 5: ``--calibration FILE`` costs every candidate on the measured call times."""
    from owner_reduce.planning.calibration import Calibration, KindFit, P2pFit

    def write(name, world_size, rs_latency):
        fits = tuple(KindFit(k, rs_latency if k == "reduce_scatter" else 10.0, 100.0)
                     for k in ("allreduce", "reduce", "reduce_scatter"))
        cal = Calibration(world_size=world_size, backend="torch.distributed/gloo", device="cpu", fits=fits,
                          p2p=P2pFit(5.0, 2.0, 50.0), measured_at="2026-12-02T00:00:00Z")
        path = tmp_path / name
        path.write_text(cal.to_json())
        return str(path)

    base = ("--model", "tiny", "--world-size", "4", "--bucket-size", "5e8", "--summary")
    tables = _run(*base, timeout=150).stdout
    fast = _run(*base, "--calibration", write("fast.json", 4, 10.0), timeout=150).stdout
    slow = _run(*base, "--calibration", write("slow.json", 4, 1e6), timeout=150).stdout
    row = [line for line in tables.splitlines() if line.startswith("| tiny |")]
    fast_row = [line for line in fast.splitlines() if line.startswith("| tiny |")]
    slow_row = [line for line in slow.splitlines() if line.startswith("| tiny |")]
    assert "reduce_scatter" in fast_row[0] and "reduce_scatter" not in slow_row[0], (fast_row, slow_row)
    assert row != fast_row  # the step times are the calibration's, not the tables'
    refused = subprocess.run([sys.executable, "scripts/size_the_win.py", *base[:3], "8",
                              "--calibration", write("four.json", 4, 10.0)], cwd=REPO, capture_output=True,
                             text=True, timeout=150)
    assert refused.returncode == 2 and "measured on 4 ranks, this run has 8" in refused.stderr


@pytest.mark.timeout(180)
def test_command_text_report_starts_with_the_init_line():
    result = _run("--model", "tiny", "--world-size", "4", timeout=150)
    lines = result.stdout.splitlines()
    assert INIT_LINE.match(lines[0]), lines[:3]
    assert any(line.startswith("bucket 500,000,000 elements") for line in lines)
    assert any(line.startswith("bucket 50,000,000 elements") for line in lines)
    assert re.search(r"^wall time: \d+\.\d s$", result.stdout, re.M)


# ---- the owner-ordered bucket and the alpha-beta estimate ----------------------------------------------------

@pytest.mark.timeout(30)
def test_owner_ordered_calls_per_flush():
    b = size_buckets(_map(), backward_order([0, 1, 2, 3]), bucket_size=10)
    first, second = b.flushes
    assert (first.layout_calls, first.layout_algo, first.owners) == (1, "reduce", 1)
    # p1 straddles: rank 0 gets p0 and p1[0:3] (9), rank 1 p1[3:4] (1): padding 8 is too much for a
    # ReduceScatter; 10 elements are latency-bound. Two Reduces would be two aggregates in NCCL's planner (9 is not
    # under 4x 1), two latencies; cut into four Reduces (rank 0's region in three of 3, ``aggregation``) they run
    # as one aggregate and cost on the device what one AllReduce does at 2 ranks, but three more calls to issue
    # (issue 39). Cheaper still: the hand-off's chunks, 16 elements each (16-byte aligned, ``planning.alignment``),
    # start where the regions' slots do (16 and 8 elements), so nothing is handed off: one ReduceScatter of 32 elements.
    costs = dict(second.costs)
    cost = Cluster().cost(2, 2)
    assert costs["reduce"] - costs["allreduce"] == pytest.approx(cost.issue_us(4) - cost.issue_us(1))
    uncut = cost.group_us([("reduce", 9), ("reduce", 1)])
    assert uncut > costs["reduce"]
    assert (second.layout_calls, second.layout_algo, second.owners) == (1, "reduce_scatter", 2)
    assert second.layout_choice == "handoff" and costs["handoff"] == second.layout_us < costs["allreduce"]
    assert second.host_us == cost.issue_us(1) and second.native_host_us == 0.0
    (whole,) = size_buckets(_map(), backward_order([0, 1, 2, 3]), bucket_size=100).flushes
    assert (whole.sliced_calls, whole.layout_calls, whole.layout_algo) == (4, 1, "reduce_scatter")
    # ws 2: one NVLink node; 4 calls -> 1 (on the device; on the host native's C++ loop is charged nothing)
    assert 0 < whole.layout_us < whole.sliced_us and whole.device_us < whole.native_device_us


@pytest.mark.timeout(30)
def test_alpha_beta_model_reproduces_nccl_formulas():
    from owner_reduce.planning import collective_time as ct

    node = ct.topology_for(8)
    assert (node.ranks, node.nodes, node.bus_bw) == (8, 1, pytest.approx(18 * 20.6))
    # tuning.cc ring latencies, Simple: base 8.4 + nsteps x 3.4 us (NVLink); Reduce: chain of n hops x 4.0 (tree).
    assert ct.latency_us(ct.ALLREDUCE, node, ct.SIMPLE) == pytest.approx(8.4 + 14 * 3.4)
    assert ct.latency_us(ct.REDUCE_SCATTER, node, ct.SIMPLE) == pytest.approx(8.4 + 7 * 3.4)
    assert ct.latency_us(ct.REDUCE, node, ct.SIMPLE) == pytest.approx(8.4 + 8 * 4.0)
    same = dataclasses.replace(node, same_channels=True)
    assert ct.latency_us(ct.REDUCE, same, ct.SIMPLE) == pytest.approx(8.4 + 3.4)
    # Large messages: bandwidth terms in the ring ratios 2(n-1)/n : 1 : (n-1)/n of S / busBw (no NVLS here, so
    # the ring is what NCCL picks for a ReduceScatter).
    ring_only = dataclasses.replace(node, nvls=False)
    big = 2_000_000_000
    s_over_b = big / (1000 * node.bus_bw)
    lat = {kind: ct.latency_us(kind, node, ct.SIMPLE) for kind in (ct.REDUCE_SCATTER, ct.REDUCE)}
    assert ct.call_time_us(ct.REDUCE_SCATTER, big, ring_only) == pytest.approx(
        lat[ct.REDUCE_SCATTER] + 7 / 8 * s_over_b)
    assert ct.call_time_us(ct.REDUCE, big, node) == pytest.approx(lat[ct.REDUCE] + s_over_b)
    assert ct.call_time_us(ct.ALLREDUCE, big, node) <= ct.latency_us(ct.ALLREDUCE, node, ct.SIMPLE) + 14 / 8 * s_over_b
    # NVLS is costed for a ReduceScatter inside a node (tuning.cc 300-312), not across nodes (534-545).
    assert (ct.NVLS, ct.SIMPLE) in ct.table(ct.REDUCE_SCATTER, node)
    assert not any(a in (ct.NVLS, ct.NVLS_TREE) for a, _ in ct.table(ct.REDUCE_SCATTER, ct.topology_for(64)))
    # Small messages are latency: one 2 KB call costs ~ 10 us. 100 of them in one group are one aggregate
    # (enqueue.cc: same bin, under 4x the first) costed on 200 KB with ceil(100 / 24 channels) = 5 pipelined ops.
    small = ct.call_time_us(ct.REDUCE, 2048, node)
    assert 5 < small < 20
    (agg,) = ct.aggregates([(ct.REDUCE, 2048)] * 100)
    assert (agg.kind, agg.tasks, agg.nbytes) == (ct.REDUCE, 100, 204800)
    grouped = ct.flush_time_us([(ct.REDUCE, 2048)] * 100, node)
    assert grouped == pytest.approx(min(ct.algo_time_us(ct.REDUCE, ct.RING, p, 204800, node, pipe_ops=5)
                                        for p in (ct.LL, ct.LL128, ct.SIMPLE)))
    assert grouped < 100 * small / 4
    net = ct.topology_for(64)
    assert (net.nodes, net.gpus_per_node, net.bus_bw) == (8, 8, 8 * 48.0)
    # Across nodes the Simple ring pays the network hops: 2(nodes-1) of its 2(n-1) steps at 14 us.
    assert ct.latency_us(ct.ALLREDUCE, net, ct.SIMPLE) == pytest.approx(8.4 + (126 - 14) * 3.4 + 14 * 14.0)
    assert ct.call_time_us(ct.ALLREDUCE, 0, net) == 0.0 and ct.call_time_us(ct.ALLREDUCE, 8, ct.topology_for(1)) == 0
    with pytest.raises(ValueError, match="multiple of 8"):
        ct.topology_for(12)


def test_ring_graphs_follow_nccls_search_per_generation_and_nvlinks():
    """search.cc: the intra-node ring starts at the fastest speed the NVLinks carry and fits as many rings as they
    hold, then ncclTopoDupChannels; across nodes one channel per NIC at 48 GB/s where (G - 1) x 48 fits a GPU's
    NVLinks, else as many as fit, stopping once the total reaches the NVLinks'."""
    from owner_reduce.planning import collective_time as ct

    assert ct.ring_channels(18 * 20.6, "hopper") == (12, 30.0)  # 6 x 60, duplicated
    assert ct.ring_channels(12 * 20.0, "ampere") == (12, 20.0)  # A100: 6 x 40, duplicated
    assert ct.ring_channels(8 * 20.0, "ampere") == (8, 20.0)  # A800: 4 x 40, duplicated
    assert ct.network_channels(18 * 20.6, 8, 48.0, "hopper") == (8, 48.0)  # 7 x 48 <= 370.8; not duplicated
    assert ct.network_channels(12 * 20.0, 8, 48.0, "ampere") == (10, 24.0)  # 5 x 48 = 240 (the NVLinks), duplicated
    assert ct.network_channels(8 * 20.0, 8, 48.0, "ampere") == (8, 20.0)  # 3 x 48, 5 x 30, 6 x 24 < 8 x 20 = 160
    assert ct.network_channels(18 * 20.6, 8, 24.0, "hopper") == (8, 24.0)  # a 200 Gb/s NIC per GPU
    assert ct.network_channels(8 * 20.6, 8, 48.0, "hopper") == (8, 22.0)  # H800: 3 x 48, 4 x 40, then 8 x 22
    # NVLS_TREE's heads across nodes fit the NVLinks too (search.cc 1151, 1160-1168): 48 GB/s on an H100, 22 on an H800.
    assert (ct.topology_of(64, 8).nvls_bw, ct.topology_of(64, 8, links=8).nvls_bw) == (48.0, 22.0)
    # The default Hopper cluster is what it was; Ampere's NVLinks bound its ring; the A800 node keeps its 8 x 20.
    assert ct.topology_of(64, 8).bus_bw == 8 * 48.0
    a100 = ct.topology_of(64, 8, "ampere", nvls=False)
    assert (a100.channels, a100.bw_inter, a100.bus_bw, a100.n_comm_channels) == (10, 24.0, 240.0, 20)
    a800 = ct.topology_of(64, 8, "ampere", nvls=False, links=8)
    assert (a800.channels, a800.bus_bw, ct.nvlinks_of(a800)) == (8, 160.0, 8)
    assert (ct.A800_NODE.channels, ct.A800_NODE.bus_bw) == (8, 160.0)
    assert ct.nvlink_node(8, generation="ampere").bus_bw == 240.0
    # The two-level flush's node is the cluster's node.
    from owner_reduce.planning.two_level import two_level_of

    assert two_level_of(a800, 8).node.bus_bw == 160.0 and two_level_of(a100, 8).node.bus_bw == 240.0


@pytest.mark.timeout(30)
def test_published_check_shape():
    check = published_check(_map())
    assert check.tensors == 4 and check.model_bytes == 806e6
    assert 0 < check.owner_ms < check.allreduce_ms and 0 < check.ratio < 1
    assert check.measured_ratio == pytest.approx(18.43 / 22.72)
    text = format_published_check(check, "hand-built")
    assert "measured  22.72 ms" in text
    # Issue 39: each candidate cause costed on both measurements (research/published_causes.py).
    assert check.causes is not None and check.causes.calls == (4, 4) and check.causes.plans == (1, 1)
    assert all(cause in text for cause in ("(a) host issue per call", "(b) NCCL 2.30's plan", "(c) small-call"))


def _gpt_layout_sizing(model: str, world_size: int) -> dict:
    """DeepSpeed's own ZeRO-1 tables (fake process group, spawned process), sized with the default bucket."""
    report = size_in_subprocess(ModelSpec(model), world_size)
    return report_to_dict(report)


@pytest.mark.timeout(400)
def test_gpt2_124m_one_collective_per_flush_at_ws_8_and_64():
    """One flush per step (the whole model fits the bucket): one ReduceScatter at one node (ws 8) and at eight (ws 64).
    There the two-level flush alone is dearer (its rail step pays a chain's hop per node, and with one flush there is
    no next flush's node step to overlap it), so the step's plan keeps the ReduceScatter."""
    for world_size, today in ((8, 19), (64, 142)):
        (bucket,) = _gpt_layout_sizing("gpt2-124m", world_size)["buckets"]
        assert bucket["bucket_size"] == DEFAULT_BUCKET_SIZE and bucket["flush_count"] == 1
        (flush,) = bucket["flushes"]
        assert flush["sliced_calls"] == today  # arrival order: one call per run of owners
        assert flush["owners"] == world_size
        assert (flush["layout_calls"], flush["layout_algo"]) == (1, "reduce_scatter")
        if world_size == 64:
            assert dict(flush["costs"])["two_level"] > flush["layout_us"]
        assert not bucket["cross_flush_overlap"]
        assert flush["layout_us"] < min(flush["sliced_us"], flush["native_us"])


@pytest.mark.timeout(400)
def test_1b_preset_at_ws_8_one_call_per_owner_or_its_cut_regions():
    (bucket,) = _gpt_layout_sizing("1b", 8)["buckets"]
    assert bucket["flush_count"] >= 1
    for flush in bucket["flushes"]:  # an owner's region may run as several Reduces so that NCCL aggregates them
        assert flush["layout_calls"] <= min(flush["sliced_calls"], MAX_TASKS + 1), flush


@pytest.mark.timeout(60)
def test_handoff_sensitivity_costs_the_full_bandwidth_choices_at_less_and_chooses_again():
    """Issue 20 item 3: each row at 0.5x and 0.25x of the hand-off's network bandwidth, both for the choices made at
    full bandwidth (what runs before the measured guard decides) and chosen again knowing it (never worse)."""
    from owner_reduce.planning.sizing import size_the_win
    from tests.support.fakes import flat_map

    m = flat_map([4096 * 11008] * 148, 1024)  # partial flushes at 1024 ranks: the hand-off wins without NVLS
    order = backward_order(range(148))
    report = size_the_win(m, order, (500_000_000,), model="7B-like matrices",
                          cluster=Cluster(nvls=False, two_level=False), sensitivity=(0.5, 0.25))
    (b,) = report.buckets
    assert "reduce_scatter+handoff" in b.choices()
    base = b.us_ratio("layout")
    (half, half_step, half_worst, half_again), (quarter, q_step, q_worst, q_again) = b.handoff_sensitivity
    assert (half, quarter) == (0.5, 0.25)
    assert base < half_step < q_step and half_worst <= q_worst  # the hand-off's bytes get dearer
    assert half_again <= half_step and q_again <= q_step and half_again <= 1.0 and q_again <= 1.0


@pytest.mark.timeout(60)
def test_handoff_sensitivity_schedules_the_full_bandwidth_choices_as_the_runtime_runs_them():
    """Issue 32: a step whose two-level flushes overlap is costed at a scaled bandwidth as its plan's schedule, not as
    its flushes' own times added up (which counts every hidden rail step again: 1.19x for Llama-13B at ws 512 where
    the step is 0.75x), and the rail hand-off (rail step ``scatter``) is scaled with the other p2p transfers (it was
    not: every row read the same at 0.25x). At 1.0x the row is the step itself."""
    from owner_reduce.planning.sizing import size_the_win
    from tests.support.fakes import flat_map

    m = flat_map([5120 * 13824] * 40, 512)
    report = size_the_win(m, backward_order(range(40)), (500_000_000,), model="5120x13824 matrices",
                          sensitivity=(1.0, 0.25))
    (b,) = report.buckets
    assert b.cross_flush_overlap and set(b.choices()) == {"two_level"}, b.choices()
    assert {f.rail_step for f in b.flushes} == {"scatter"}
    (same, same_step, same_worst, same_again), (quarter, q_step, _, q_again) = b.handoff_sensitivity
    assert same == 1.0 and same_step == pytest.approx(b.us_ratio("layout"), rel=1e-12) == same_again
    assert same_worst is None and b.worst_flush() is None  # every flush overlaps a neighbour
    summed = sum(f.layout_us for f in b.flushes) / b.step_us("native")
    assert summed > 1.2 * same_step, (summed, same_step)  # what the old sensitivity reported
    assert q_step > 1.1 * same_step and same_step <= q_again <= q_step, (same_step, q_step, q_again)
