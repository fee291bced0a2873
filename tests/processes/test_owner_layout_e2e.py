"""Owner-ordered buckets end to end: DeepCompile + owner_reduce vs plain ZeRO on identical data, real gloo ranks.

From the second backward on, every flush is laid out by owner (learned schedule) and issues one Reduce per
owner region, or one ReduceScatter when it covers every rank. gloo's ReduceScatter sums the ranks in the same
order as its Reduce and AllReduce here: the comparison is bitwise. Cases are combined so that few runs cover
ws 2/3/4, eager and inductor, ZeRO stages 1 and 2, gradient accumulation, several flushes per step and one
flush holding the whole model, straddling parameters, two parameter groups and tied weights; each asserts that the
runtime ran (``test_runtime_e2e._assert_runtime_ran``): the ws-4 inductor case is the suite's stage-2 inductor run.
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.toy_training import TrainSpec
from owner_reduce.planning.alignment import align_elems, aligned_cut
from tests.processes.test_runtime_e2e import (
    _assert_runtime_ran,
    _max_param_diff,
    _run_with_reference,
    _scheduled_run_matching_plain,
)

ALGO_RE = re.compile(r" calls=(\d+) .* algo=(\S+)$")

CASES = {
    # several flushes per step (400-element bucket), tied embedding/head, two optimizer groups, GA 2
    "ws3-eager-z1-ga2-small-bucket-tied-2groups": (3, TrainSpec(
        mode="owner", backend="eager", model="tied_lm", param_groups=2, grad_accum=2, steps=3,
        reduce_bucket_size=400, record_collectives=True), None),
    # one flush holds the whole model: one ReduceScatter per step from the second on; straddlers; ZeRO-2
    "ws4-inductor-z2-ga2-whole-bucket": (4, TrainSpec(
        mode="owner", backend="inductor", zero_stage=2, grad_accum=2, steps=3, record_collectives=True),
        "reduce_scatter"),
    # eager: inductor's stage 1 runs in tests/processes/test_frozen_and_empty_params.py, its stage 2 in the case above
    "ws2-eager-z1-whole-bucket-straddlers": (2, TrainSpec(
        mode="owner", backend="eager", model="few_big_tensors", steps=3, record_collectives=True),
        "reduce_scatter"),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_owner_ordered_flushes_bitwise_equal_to_plain_zero(case):
    world_size, spec, whole_model_algo = CASES[case]
    owner = _scheduled_run_matching_plain(world_size, spec)
    _assert_runtime_ran(owner, spec, owner_path=True, n_params=len(owner[0]["params"]))
    micro_steps = spec.steps * spec.grad_accum
    for rank, r in enumerate(owner):
        s = r["stats"]
        # Only the first reducing backward runs in arrival order; every later flush follows the schedule.
        first_step_flushes = s.flushes - s.scheduled_flushes
        assert s.scheduled_flushes > 0 and s.scheduled_flushes >= first_step_flushes, (rank, s)
        algos = [ALGO_RE.search(line) for line in s.probe_lines]
        assert all(algos), s.probe_lines
        if whole_model_algo is not None:
            assert s.flushes == s.scheduled_flushes + 1  # one flush per reducing backward
            # The measured guard's trial alternates the model's choice (one call) and native's calls (one AllReduce
            # per gradient) from the first scheduled backward on; these runs end within the trial.
            assert s.trial_steps == s.scheduled_flushes <= 6 and s.trial_native_flushes == s.scheduled_flushes // 2
            model, native = algos[1::2], algos[2::2]
            assert [m.group(2) for m in model] == [whole_model_algo] * len(model), s.probe_lines
            assert all(m.group(1) == "1" for m in model) and s.reduce_scatter_calls == len(model)
            assert all(m.group(2) == "allreduce" and int(m.group(1)) > 1 for m in native), s.probe_lines
        else:
            assert s.flushes >= 2 * (micro_steps if spec.zero_stage == 2 else spec.steps)  # several per step
            assert s.reduce_calls > 0


@pytest.mark.timeout(300)
def test_negative_control_layout_off_by_one_slice_is_caught():
    spec = TrainSpec(mode="owner", backend="eager", model="few_big_tensors", steps=3, inject_fault="layout_off_by_one")
    broken, plain = _run_with_reference(2, spec)
    assert all(r["stats"].scheduled_flushes > 0 for r in broken)
    differs = any(_max_param_diff(b["params"], p["params"]) > 0 for b, p in zip(broken, plain, strict=True))
    assert differs, "a layout off by one slice went unnoticed by the comparison"


BIG = (("dim", 550), ("layers", 13))  # 13 matrices of 302,500 elements: partition boundaries inside them


@pytest.mark.timeout(420)
def test_reduces_cut_so_that_nccl_aggregates_them_train_bitwise_equal_to_plain_zero():
    """ws 4 in one node, 13 matrices of 302,500 elements, buckets of 1.9M: the middle flush of a step touches ranks 0,
    1 and 2 with regions of 680,625, 983,125 and 151,250 elements. One Reduce each would be two aggregates in NCCL's
    planner (983,125 is not under 4x 151,250), two latencies; the model cuts the larger regions into 2 and 3
    consecutive Reduces (``planning.aggregation``; each starting 16-byte aligned, ``planning.alignment``) and the six
    run as one aggregate: 3 more calls to issue, one latency saved (issue 39: the cut pays for its calls). Reduce is
    forced (``compile.reduce_to_owner_algo: "reduce"``, the guard off): with the calls' issue charged, the model's own
    choice for this flush is another candidate, and this test is about the cut Reduces running end to end."""
    spec = TrainSpec(mode="owner", backend="eager", model="few_big_tensors", model_kwargs=BIG, steps=2,
                     reduce_bucket_size=1_900_000, record_collectives=True, flush_algo="reduce")
    owner = _scheduled_run_matching_plain(4, spec)
    for rank, r in enumerate(owner):
        calls = [(name, root, count) for name, root, count, _ in r["collective_log"]]
        roots = [root for name, root, _ in calls]
        found = [i for i in range(len(calls)) if roots[i:i + 6] == [0, 0, 1, 1, 1, 2]]
        assert len(found) == spec.steps - 1, (rank, calls)  # every scheduled step's middle flush (the first: arrival)
        middle = calls[found[0]:found[0] + 6]
        assert all(name == "reduce" for name, _, _ in middle), middle
        dtype = {d for _, _, _, d in r["collective_log"]}.pop()
        align = align_elems(getattr(torch, dtype.removeprefix("torch.")).itemsize)
        for root, pieces in ((0, 2), (1, 3)):  # consecutive parts of the root's region, cut as ``aligned_cut``
            counts = tuple(count for _, at, count in middle if at == root)
            assert counts == aligned_cut(sum(counts), pieces, align), middle
        s = r["stats"]
        assert s.schedules_learned >= 1 and s.trial_steps == 0, (rank, s)
        lines = [ALGO_RE.search(line) for line in s.probe_lines]
        scheduled = lines[len(lines) // spec.steps:]  # forced Reduce: the arrival-order step has 6 runs of owners too
        assert [m.group(1) for m in scheduled if m.group(2) == "reduce"].count("6") == spec.steps - 1, s.probe_lines
