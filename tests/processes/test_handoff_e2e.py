"""ReduceScatter + owner hand-off end to end: DeepCompile + owner_reduce vs plain ZeRO on identical data, real gloo
ranks at ws 3 and 4, ZeRO stages 1 and 2, gradient accumulation 1 and 2.

Forced (``reduce_to_owner_algo: "handoff"``): every owner-ordered flush is a ReduceScatter over equal chunks, then
one send/recv round. (The model itself no longer picks the hand-off on these small worlds: its Reduces, cut so that
NCCL aggregates them, are cheaper; ``test_owner_layout_e2e.py`` runs that choice.) On gloo a ReduceScatter is
one Reduce per block (``TorchDistComm.reduce_scatter``) and a hand-off moves reduced values unchanged, so the sums
are gloo's and the comparison is bitwise. The negative control sends one piece to a rank that does not keep it.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from harness.toy_training import TrainSpec
from tests.processes.test_runtime_e2e import (
    _assert_bitwise,
    _max_param_diff,
    _run,
    _run_with_reference,
    _scheduled_run_matching_plain,
)

ALGO_RE = re.compile(r" calls=(\d+) .* algo=(\S+)$")
BIG = (("dim", 550), ("layers", 13))  # 13 matrices of 302,500 elements: partition boundaries inside them

CASES = {
    # forced: several flushes per step (400-element bucket), tied embedding/head, two optimizer groups
    "ws3-eager-z1-ga2-forced": (3, TrainSpec(
        mode="owner", backend="eager", model="tied_lm", param_groups=2, grad_accum=2, steps=3,
        reduce_bucket_size=400, record_collectives=True, flush_algo="handoff")),
    # forced: each 2025-element matrix its own flush, straddling partitions of 1519 (eager: the hand-off is the
    # runtime's, whatever compiled the graph; inductor's stage 2 runs in tests/processes/test_owner_layout_e2e.py)
    "ws4-eager-z2-ga1-forced": (4, TrainSpec(
        mode="owner", backend="eager", model="few_big_tensors", zero_stage=2, steps=3, reduce_bucket_size=2500,
        record_collectives=True, flush_algo="handoff")),
    "ws3-eager-z2-ga2-forced-big": (3, TrainSpec(
        mode="owner", backend="eager", model="few_big_tensors", model_kwargs=BIG, zero_stage=2, grad_accum=2,
        steps=2, reduce_bucket_size=1_900_000, record_collectives=True, flush_algo="handoff")),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(CASES))
def test_handoff_trains_bitwise_equal_to_plain_zero(case):
    world_size, spec = CASES[case]
    owner = _scheduled_run_matching_plain(world_size, spec)
    for rank, r in enumerate(owner):
        s = r["stats"]
        assert s.handoff_rounds > 0 and s.sends + s.recvs > 0, (rank, s)
        algos = [ALGO_RE.search(line).group(2) for line in s.probe_lines]
        assert any("handoff" in a for a in algos), algos


@pytest.mark.timeout(300)
def test_negative_control_a_handoff_piece_sent_to_the_wrong_owner_is_caught():
    """The same run without the fault is bitwise equal to plain ZeRO; with one piece sent to a rank that does not
    keep it, it is not. SGD: the owner that misses a piece keeps its own share of it (identical data: the sum / 3),
    which Adam's update would nearly normalize away; SGD's does not."""
    spec = TrainSpec(mode="owner", backend="eager", model="few_big_tensors", steps=3, flush_algo="handoff",
                     reduce_bucket_size=2500, record_collectives=True, optimizer="SGD")
    owner, plain = _run_with_reference(3, spec)
    _assert_bitwise(owner, plain)
    broken = _run(3, dataclasses.replace(spec, inject_fault="handoff_wrong_owner"))
    assert all(r["stats"].handoff_rounds > 0 for r in broken)
    differs = any(_max_param_diff(b["params"], p["params"]) > 0 for b, p in zip(broken, plain, strict=True))
    assert differs, "a hand-off piece sent to the wrong owner went unnoticed by the comparison"
