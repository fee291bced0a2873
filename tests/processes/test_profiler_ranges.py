"""Every flush inside one ``torch.profiler.record_function`` range named ``owner_reduce flush #<n> <algo> <bytes> B``,
each stage of a two-level flush with a range per level, nothing per gradient (``runtime.flush`` Note (profiler
ranges)): in process on a mirror communicator (one level, two levels, and the negative control with the ranges
removed), and on two gloo ranks of a DeepSpeed training run under ``torch.profiler.profile``, its exported Chrome
trace read back."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from harness.launch import run_ranks
from harness.toy_training import TrainSpec, train_each
from owner_reduce.runtime import flush as flush_module
from tests.support.fakes import MirrorComm, flat_map, mirror_runtime, rows_in_nodes

RANGE = re.compile(r"^owner_reduce flush #(\d+) (\S+) (\d+) B$")
LEVEL = re.compile(r"^owner_reduce flush #(\d+) stage (\d+) (node|rail) (\S+) (\d+) B$")
NUMELS = [24, 40, 16, 56, 8, 32]
PREFIX = "owner_reduce flush"  # the flush's ranges (the trace also has the ops' own, ``owner_reduce::reduce_grad``)


def assert_one_range_per_flush(names: list[str], flushes: int, reduce_grads: int) -> list[re.Match]:
    """``names``: every profiler event whose name starts with ``PREFIX``. One flush range per flush, numbered
    consecutively, each with its algorithm and a positive byte count; the others a two-level stage's levels; nothing
    per gradient."""
    matches = [m for m in map(RANGE.match, names) if m]
    levels = [n for n in names if LEVEL.match(n)]
    assert len(matches) + len(levels) == len(names), f"unexpected owner_reduce ranges: {names}"
    assert len(matches) == flushes, f"{len(matches)} flush ranges for {flushes} flushes: {names[:8]}"
    numbers = [int(m.group(1)) for m in matches]
    assert sorted(numbers) == list(range(min(numbers), min(numbers) + flushes)), numbers
    assert all(int(m.group(3)) > 0 for m in matches), names
    assert reduce_grads > flushes, "a range per gradient"  # more gradients than flushes, and a range per flush
    return matches


def _profiled(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith(PREFIX)]


def _backwards(rt, steps: int, numels=NUMELS) -> None:
    grads = {pid: torch.arange(1.0, n + 1) for pid, n in enumerate(numels)}
    for _ in range(steps):
        rt.start_backward(True)
        for pid in reversed(range(len(numels))):
            rt.reduce_grad(grads[pid], 11, pid)
        rt.end_backward(11, False)


def _one_level_names() -> tuple[list[str], int, int]:
    rt, _ = mirror_runtime(flat_map(NUMELS, 2), bucket=64, algo="reduce")
    _backwards(rt, 1)  # learning: outside the profiler
    before, grads_before = rt.stats.flushes, rt.stats.reduce_grad_calls
    names = _profiled(lambda: _backwards(rt, 3))
    return names, rt.stats.flushes - before, rt.stats.reduce_grad_calls - grads_before


def test_each_flush_is_one_range_naming_its_number_algorithm_and_bytes():
    names, flushes, grads = _one_level_names()
    matches = assert_one_range_per_flush(names, flushes, grads)
    assert {m.group(2) for m in matches} == {"reduce"}  # the forced algorithm, as the probe's algo= names it
    assert sum(int(m.group(3)) for m in matches) == 3 * sum(NUMELS) * 4  # every float32 element, once per step


def test_negative_control_a_flush_without_its_range_is_caught(monkeypatch):
    monkeypatch.setattr(flush_module, "_profiler_enabled", lambda: False)  # the product's check: no range made
    names, flushes, grads = _one_level_names()
    with pytest.raises(AssertionError, match=f"0 flush ranges for {flushes} flushes"):
        assert_one_range_per_flush(names, flushes, grads)


def test_no_profiler_no_range_and_no_name_formatted(monkeypatch):
    """Without a profiler (and without CUDA) a flush makes no range object at all: the host cost stays one check."""
    made = []
    monkeypatch.setattr(flush_module, "_Range", lambda *args: made.append(args))
    rt, _ = mirror_runtime(flat_map(NUMELS, 2), bucket=64, algo="reduce")
    _backwards(rt, 2)
    assert rt.stats.flushes > 0 and made == []


class _NodesOfTwo(MirrorComm):
    """Rank 0 of 4 in nodes of two (``fakes.rows_in_nodes``): ``split`` makes the node and rail communicators."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return rows_in_nodes(values, self.world_size, 2)

    def _split(self, groups):
        members = list(next(g for g in groups if self.rank in g))
        return MirrorComm(rank=members.index(self.rank), world_size=len(members))


def test_each_stage_of_a_two_level_flush_has_a_range_per_level():
    rt, _ = mirror_runtime(flat_map(NUMELS, 4), bucket=96, algo="two_level", comm=_NodesOfTwo(rank=0, world_size=4))
    _backwards(rt, 1)
    before, grads_before, stages_before = rt.stats.flushes, rt.stats.reduce_grad_calls, rt.stats.two_level_stages
    names = _profiled(lambda: _backwards(rt, 2))
    flushes, stages = rt.stats.flushes - before, rt.stats.two_level_stages - stages_before
    matches = assert_one_range_per_flush(names, flushes, rt.stats.reduce_grad_calls - grads_before)
    assert stages > 0 and {m.group(2) for m in matches} == {"two_level"}
    levels = [LEVEL.match(n) for n in names if LEVEL.match(n)]
    assert sum(m.group(3) == "node" for m in levels) == stages  # one node range per stage
    assert 0 < sum(m.group(3) == "rail" for m in levels) <= stages  # a rail range per stage this rank's rail reduces
    flush_numbers = {m.group(1) for m in matches}
    assert {m.group(1) for m in levels} <= flush_numbers


@pytest.mark.timeout(240)
def test_a_profiled_gloo_training_run_shows_one_range_per_flush_in_its_trace(tmp_path):
    """Two gloo ranks, DeepSpeed ZeRO-1 with DeepCompile and the owner path, three steps under the profiler, the
    trace exported as a user would (``export_chrome_trace``) and read back; then plain ZeRO-1 on the same data in the
    same launch: the profiled run trains as it does."""
    owner = TrainSpec(steps=3, reduce_probe=False, reduce_bucket_size=400, profile_trace=str(tmp_path / "r{rank}.json"))
    plain = dataclasses.replace(owner, mode="plain", profile_trace=None)
    by_rank = run_ranks(train_each, 2, args=((owner, plain),), timeout=200)
    for rank, (run, reference) in enumerate(by_rank):
        assert run["losses"] == reference["losses"], f"rank {rank}: the profiled run differs from plain ZeRO-1"
        stats = run["stats"]
        events = json.loads((tmp_path / f"r{rank}.json").read_text())["traceEvents"]
        names = [e["name"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PREFIX)]
        assert_one_range_per_flush(names, stats.flushes, stats.reduce_grad_calls)
        assert stats.flushes >= 3 * 2, stats  # several flushes per step: the bucket holds a part of the model


def test_on_the_simulated_device_each_flush_and_level_is_one_nvtx_range(monkeypatch):
    """CUDA buffers (the simulated device's): every flush, and each two-level stage's node and rail step, pushes one
    NVTX range and pops it, with no torch profiler running (Nsight's view). The CPU torch build here has no NVTX: the
    product's push and pop are replaced by recorders, as a CUDA build's would be called."""
    from owner_reduce.planning import two_level
    from tests.support.sim.cuda import Sim
    from tests.support.sim.runtime import cupy_runtimes, group_ranks_as_nodes, train_step

    pushed: list[str] = []
    depth = [0]

    def push(name: str) -> None:
        pushed.append(name)
        depth[0] += 1

    def pop() -> None:
        depth[0] -= 1

    monkeypatch.setattr(flush_module, "_nvtx_push", push)
    monkeypatch.setattr(flush_module, "_nvtx_pop", pop)
    monkeypatch.setattr(two_level, "RAIL_STEPS", (two_level.RAIL_REDUCE,))
    numels = [3 + (5 * i) % 13 for i in range(12)]
    with Sim() as sim:
        group_ranks_as_nodes(monkeypatch, sim, 2)
        runtimes = cupy_runtimes(sim, flat_map(numels, 4), algo="two_level", bucket=64)
        for step in range(2):
            train_step(sim, runtimes, numels, step, 1)
        stats = [rt.stats for rt in runtimes]
        sim.run_ranks(lambda rank: runtimes[rank].cleanup(), 4)  # each rank's on its own thread (its own device)
    # The settings line of the cupy path: the NCCL cupy loaded (the sim's 2.30.3; this CPU torch has none of its own),
    # the nodes from the host names the harness gives each node (and LOCAL_WORLD_SIZE agreeing).
    assert stats[0].settings_line.endswith("; cupy NCCL 2.30.3, 4 ranks = 2 nodes x 2 (host names = LOCAL_WORLD_SIZE), "
                                           "bucket 64 elements, owner_reduce 0.1.0"), stats[0].settings_line
    assert depth[0] == 0, "every range pushed was popped"
    flushes = [n for n in pushed if RANGE.match(n)]
    assert len(flushes) == sum(s.flushes for s in stats) > 0
    node = [n for n in pushed if (m := LEVEL.match(n)) and m.group(3) == "node"]
    assert len(node) == sum(s.two_level_stages for s in stats) > 0
    assert any(" rail reduce " in n for n in pushed)
