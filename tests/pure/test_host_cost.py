"""The host's cost of a call (issue 39), as pure logic: the constants, the schedule with the host as a resource, the
alone bound with the issue on both sides, the cut of Reduces, stage counts and hand-offs paying their calls, and a
calibration's measured per-call cost. Each with a negative control: without host cost the old choice comes back."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.toy_models import TinyTransformer
from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.aggregation import reduce_pieces
from owner_reduce.planning.calibration import FORMAT, FORMAT_V1, Calibration, KindFit, fit_host, format_fits
from owner_reduce.planning.collectives import REDUCE
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.host_cost import DEFAULT, NONE, HostCost
from owner_reduce.planning.owner_layout import plan_step_layouts
from owner_reduce.planning.sizing import backward_order, simulate_flushes
from owner_reduce.planning.step_plan import FlushTimes, native_step_us, plan_step, schedule
from owner_reduce.planning.two_level import pipelined_us
from tests.support.fakes import flat_map

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
WS4 = ct.topology_of(4, 4)  # what 4 ranks of one node agree on (flush_choice.agreed_topology)
WS64 = ct.topology_of(64, 8, nvls=False)


# ---- the constants ------------------------------------------------------------------------------------------------

def test_the_defaults_charge_the_owner_runtime_and_not_native():
    assert DEFAULT.issue_us(1) == pytest.approx(2.5 + 3.9) and DEFAULT.issue_us(4, groups=2) == pytest.approx(
        4 * 2.5 + 2 * 3.9)
    assert DEFAULT.issue_us(0) == 0.0 and DEFAULT.native_issue_us(300) == 0.0  # no number for NCCL or z1.cpp
    both = HostCost(owner_call_us=1.0, owner_group_us=2.0, owner_stage_us=3.0, nccl_call_us=0.5, nccl_group_us=4.0,
                    native_call_us=0.25)
    assert both.issue_us(2, groups=1, stages=1) == pytest.approx(2 * 1.5 + 6.0 + 3.0)
    assert both.native_issue_us(2) == pytest.approx(2 * 0.75 + 4.0)  # NCCL's enqueue and group end on both sides
    with pytest.raises(ValueError, match="owner_call_us must be a finite number >= 0"):
        HostCost(owner_call_us=-1.0)
    assert "2.5 us per call" in DEFAULT.describe() and NONE.issue_us(16) == 0.0


# ---- the schedule: the host as a resource ---------------------------------------------------------------------------

def test_a_flush_alone_pays_its_issue_and_one_queued_behind_a_long_one_hides_it():
    long, short = FlushTimes(world_us=1000.0, issue_us=(5.0,)), FlushTimes(world_us=10.0, issue_us=(20.0,))
    assert long.alone_us == 1005.0 and short.alone_us == 30.0
    steps = schedule([long, short], [0, 0], 2)
    assert steps[0].node_start == 5.0 and steps[1].node_start == steps[0].end == 1005.0  # issued by t=25: hidden
    assert steps[1].end == 1015.0 and (steps[1].issue_start, steps[1].issue_end) == (5.0, 25.0)
    # A short flush first: the next one's issue is exposed where it outlasts the first's device time.
    first = FlushTimes(world_us=4.0, issue_us=(5.0,))
    assert schedule([first, short], [0, 0], 2)[1].node_start == 25.0
    # Negative control: without issue times the schedule is the device's alone.
    assert schedule([FlushTimes(world_us=1000.0), FlushTimes(world_us=10.0)], [0, 0], 2)[1].end == 1010.0


def test_a_two_level_stage_starts_only_once_the_host_has_issued_it():
    stages = ((10.0, 50.0), (10.0, 50.0))
    quick = FlushTimes(stages, issue_us=(1.0, 1.0))
    slow = FlushTimes(stages, issue_us=(30.0, 30.0))
    assert quick.alone_us == pytest.approx(1 + 10 + 50 + 50) == pipelined_us(stages, (1.0, 1.0))
    # Stage 2's node step waits for its issue (t=60) though the node stream is free at t=40; the rail is the bound.
    assert slow.alone_us == pytest.approx(30 + 10 + 50 + 50) and pipelined_us(stages) == 110.0
    (step,) = schedule([FlushTimes(stages, 5.0, (30.0, 30.0, 7.0))], [0], 2)
    assert (step.node_start, step.node_end, step.rail_end) == (30.0, 70.0, 140.0)
    assert step.end == 145.0 and step.issue_end == 67.0  # its data-parallel calls after both streams


def test_native_step_is_its_flushes_in_turn_each_behind_its_issue():
    native = [FlushTimes(world_us=100.0, issue_us=(50.0,)), FlushTimes(world_us=10.0, issue_us=(200.0,))]
    assert native_step_us(native) == pytest.approx(50 + 100 + (250 - 150) + 10)
    assert native_step_us([100.0, 10.0]) == 110.0  # plain numbers: device time, no issue


def test_the_alone_bound_counts_the_issue_on_both_sides():
    """A two-level option that runs alone may not be slower than native alone, issue included: here it is faster on
    the device (80 against 100 us) but its 8 stages' issue makes it slower alone, so the one-level option runs."""
    one_level = FlushTimes(world_us=100.0, issue_us=(6.4,))
    staged = FlushTimes(tuple((2.0, 8.0) for _ in range(8)), issue_us=(12.0,) * 8)
    native = FlushTimes(world_us=100.0)
    assert staged.device_us < native.device_us < staged.alone_us
    assert plan_step([[one_level, staged]], [native], [0]).picks == (0,)
    assert plan_step([[one_level, dataclasses.replace(staged, issue_us=())]], [native], [0]).picks == (1,)  # control


# ---- the choice: calls pay for themselves ---------------------------------------------------------------------------

def test_at_4_ranks_a_cut_that_saves_one_chains_latency_for_13_more_calls_is_not_made():
    """The 4,776-element flush of issue 39's gloo run, and the 984-element one of its report: one Reduce per owner
    costs two chains (about 9 us each at 4 ranks); the cut into one aggregate saves one chain and costs 13-16 calls."""
    cost = FlushCost(WS4, 4)
    for counts in ([24, 960, 0, 0], [0, 4682, 94, 0]):
        assert reduce_pieces(counts, [], cost.group_us)[0] == tuple(1 if n else 0 for n in counts)
        free, _ = reduce_pieces(counts, [], FlushCost(WS4, 4, host=NONE).group_us)  # negative control: cut again
        assert sum(free) > 12
    # Where three more calls buy a chain's latency the cut stays: 9 us saved, 3 x 2.5 us spent.
    assert reduce_pieces([100, 948, 0, 0], [], cost.group_us)[0] == (1, 4, 0, 0)


def test_at_64_ranks_the_cut_beside_a_large_region_still_pays_for_its_calls():
    """Llama-13B's flush at ws 64: a small owner region beside three of 150-200M elements; uncut, a second 64-hop chain
    (0.27 ms on LL128); the cut's extra Reduces cost the host microseconds."""
    cost = FlushCost(WS64, 2)
    counts = [15_500_000, 0, 153_000_000, 203_000_000, 0, 194_000_000]
    pieces, us = reduce_pieces(counts, [], cost.group_us)
    assert sum(pieces) > 4 and us < cost.group_us([(REDUCE, n) for n in counts if n]) - 200.0
    assert us == pytest.approx(cost.calls_us([(REDUCE, p) for n, k in zip(counts, pieces, strict=True) if k
                                              for p in _cut(n, k)]) + cost.issue_us(sum(pieces)))


def _cut(n: int, k: int) -> list[int]:
    q, r = divmod(n, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def test_the_runtimes_step_layouts_cut_only_where_the_cut_pays_host_included():
    """The layouts the runtime lays out (``plan_step_layouts``) for the gloo run of ``test_host_cost_e2e``, on ZeRO's
    flat partitions of the same model: a flush issues more Reduces than its owners only where the cut's issue and
    device time are below one Reduce per owner; without host cost (control) some flush is cut where it does not pay."""
    numels = [p.numel() for p in TinyTransformer(dim=24).parameters()]
    m = flat_map(numels, 4)
    flushes = [(0, [(e.param_id, e.numel) for e in f])
               for f in simulate_flushes(m, backward_order(range(len(numels))), 5000)]

    def unpaid(host: HostCost) -> list[tuple[int, int]]:
        cost = FlushCost(WS4, 4, force=REDUCE, host=host)
        step = plan_step_layouts(flushes, m, True, capacity=5000, cost_of=lambda _: cost)
        judge = FlushCost(WS4, 4, force=REDUCE)
        out = []
        for layout in step.layouts:
            calls = [(REDUCE, c.count) for c in layout.collectives if c.kind == REDUCE]
            uncut = [(REDUCE, r.count) for r in layout.plan.ranges if r.root is not None]
            if len(calls) > len(uncut) and judge.group_us(calls) >= judge.group_us(uncut):
                out.append((len(calls), len(uncut)))
        return out

    assert unpaid(DEFAULT) == []
    assert any(calls >= 2 * owners + 4 for calls, owners in unpaid(NONE))


def test_a_hand_off_round_is_issued_while_its_reduce_scatter_runs():
    """The hand-off's second group: its issue is charged only where it outlasts the first group's device time."""
    m = flat_map([40, 30, 20, 10], 4)
    from owner_reduce.planning.owner_layout import analyse_flush

    cost = FlushCost(WS4, 2, force="handoff")
    a = analyse_flush([(1, 30), (0, 40)], m, cost=cost)
    scatter = cost.calls_us([("reduce_scatter", a.packed_span)])
    late = max(0.0, cost.issue_us(2) - scatter)  # the busiest rank's sends and receives: 1 -> 0, 2 -> 1
    transfers = a.estimates["handoff"].detail  # the hand-off's cost keeps its round's transfers for its layout
    assert transfers and a.costs["handoff"] == pytest.approx(
        cost.issue_us(1) + scatter + late + cost.handoff_us(transfers))
    assert a.times("handoff").host_us == cost.issue_us(1)


# ---- a calibration's measured per-call cost -------------------------------------------------------------------------

def _calibration(per_call: float, per_group: float, fmt: str = FORMAT) -> Calibration:
    allreduce = KindFit("allreduce", 20.0, 100.0)
    points = tuple((n, 65536, per_group + allreduce.call_us(65536) + per_call * n) for n in (1, 2, 4, 8, 16))
    host = fit_host(points, allreduce) if fmt == FORMAT else None
    return Calibration(4, "cupy-nccl", "GPU", (allreduce, KindFit("reduce", 9.0, 100.0),
                                                KindFit("reduce_scatter", 10.0, 100.0)), None, "2026-12-03T00:00:00Z",
                       host=host, format=fmt)


def test_the_per_call_fit_recovers_the_slope_and_the_groups_own_cost():
    cal = _calibration(per_call=7.0, per_group=12.0)
    assert cal.host.per_call_us == pytest.approx(7.0) and cal.host.per_group_us == pytest.approx(12.0)
    two = fit_host([(1, 4096, 30.0), (9, 4096, 70.0)], KindFit("allreduce", 10.0, 1e4))
    assert two.per_call_us == pytest.approx((70.0 - 30.0) / 8)  # (T_N - T_1) / (N - 1)
    with pytest.raises(ValueError, match="two call counts over one byte count"):
        fit_host([(4, 4096, 30.0), (4, 4096, 31.0)], KindFit("allreduce", 10.0, 1e4))


def test_calibration_files_round_trip_in_both_formats_and_a_v1_file_keeps_the_defaults():
    v2 = _calibration(7.0, 12.0)
    back = Calibration.from_json(v2.to_json())
    assert back == v2 and json.loads(v2.to_json())["format"] == FORMAT
    assert back.host_cost(DEFAULT).call_us == pytest.approx(7.0)
    v1_text = json.dumps({k: v for k, v in {**json.loads(v2.to_json()), "format": FORMAT_V1}.items() if k != "host"})
    v1 = Calibration.from_json(v1_text)
    assert v1.format == FORMAT_V1 and v1.host is None and v1.host_cost(DEFAULT) is DEFAULT
    assert Calibration.from_json(v1.to_json()) == v1 and json.loads(v1.to_json()) == json.loads(v1_text)
    assert any("a format /1 file, written before per-call costs were measured" in line for line in format_fits(v1))
    with pytest.raises(ValueError, match="key 'host'"):  # /1 has no host key
        Calibration.from_json(json.dumps({**json.loads(v1_text), "host": None}))
    with pytest.raises(ValueError, match="must be 'owner_reduce.calibration/2'"):
        Calibration.from_json(json.dumps({**json.loads(v1_text), "format": "owner_reduce.calibration/9"}))


def test_under_a_calibration_the_model_charges_the_measured_per_call_cost():
    """A cluster whose calls cost 20 us each to issue: four Reduces no longer pay for one latency that one AllReduce
    of the same bytes pays; where the measured cost is 0 (control) the Reduces win again, as before issue 39."""
    regions = [(REDUCE, 1000)] * 4
    for per_call, cheaper in ((20.0, "allreduce"), (0.0, "reduce")):
        cost = FlushCost(WS4, 4, calibration=_calibration(per_call, 0.0))
        assert cost.host_cost.source.startswith("calibration ") and cost.issue_us(4) == pytest.approx(4 * per_call)
        costs = {"reduce": cost.group_us(regions), "allreduce": cost.group_us([("allreduce", 4000)])}
        assert min(costs, key=costs.get) == cheaper
    assert FlushCost(WS4, 4, calibration=_calibration(20.0, 0.0, FORMAT_V1)).host_cost is DEFAULT


def test_calibrate_dry_run_prints_the_per_call_groups_without_a_launcher():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "calibrate.py"), "--out", "x.json", "--dry-run",
                          "--world-size", "16"], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    groups = [line for line in out.stdout.splitlines() if line.strip().startswith("host")]
    assert [line.split("one group of ")[1].split(" ")[0] for line in groups] == ["1", "2", "4", "8", "16"]
    assert all("65,536 bytes" in line and "timed alone" in line for line in groups)
    assert "16 ranks, cupy NCCL on GPUs" in out.stdout
