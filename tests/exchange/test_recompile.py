"""A recompile (DeepCompile's ``reset()``, then every graph registered again) on ranks whose graph ids differ, with an
``ExchangeWorld``: two in-process ranks whose collectives really sum each other's buffers and must match call by call.

DeepCompile names a graph ``id(gm.graph)``: per rank a different address, and after the reset a new graph may land on
an old graph's address on one rank and not on another. Whatever the runtime learned under a graph id must not
outlive the reset (or a new registration of that id), or the ranks run different schedules.
"""

from __future__ import annotations

import pytest
import torch

from owner_reduce.planning.owner_map import OwnerMap
from tests.support.fakes import NUMELS, TABLES, ExchangeWorld, exchange_runtimes

ORDER = (2, 1, 0)  # backward order: c, b, a (arrival order differs from owner order: a schedule reorders the bucket)


def _grads(rank: int, step: int) -> dict[int, torch.Tensor]:
    """Integer-valued and different per rank and step: a sum over the wrong elements cannot come out right."""
    return {pid: torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1) + 100 * step + 10 * pid
            for pid, n in NUMELS.items()}


def _step(world: ExchangeWorld, runtimes: list, graph_ids: list[int], step: int) -> None:
    """One backward on every rank, then each rank's grad buffers checked against the true reduced gradient."""

    def backward(rank: int) -> None:
        rt, grads = runtimes[rank], _grads(rank, step)
        rt.start_backward(True)
        for pid in ORDER:
            rt.reduce_grad(grads[pid], graph_ids[rank], pid)
        rt.end_backward(graph_ids[rank], False)

    world.run(backward)
    expected = {pid: _grads(0, step)[pid] / 2 + _grads(1, step)[pid] / 2 for pid in NUMELS}  # pre-divided, summed
    for rank, rt in enumerate(runtimes):
        for pid, p in rt._params.items():
            kept = p.grad_buffer
            if kept.numel():
                assert torch.equal(kept, expected[pid][p.offset:p.offset + kept.numel()]), \
                    f"step {step}, rank {rank}, param {pid}: {kept.tolist()}"


def _register(world: ExchangeWorld, runtimes: list, graph_ids: list[int], reset: bool) -> None:
    def register(rank: int) -> None:
        if reset:
            runtimes[rank].reset()
        runtimes[rank].register_graph_z1(graph_ids[rank], list(NUMELS))

    world.run(register)


@pytest.mark.parametrize("algo", ["allreduce", "auto"])
def test_a_reset_gives_every_rank_a_fresh_start_when_a_graph_id_is_reused(algo):
    """Rank 0's recompiled graph lands on its old graph's address, rank 1's on a new one. Before the fix, rank 0
    followed the old owner-ordered schedule while rank 1 recorded in arrival order: with ``allreduce`` forced both
    issued all_reduce(16) over differently laid out buckets (wrong grad buffers on both ranks, and NCCL would not
    notice); with ``auto`` rank 0 issued a ReduceScatter and rank 1 an AllReduce (the world reports the mismatch)."""
    world = ExchangeWorld(2, timeout_s=10)
    ids = [1000, 2000]
    runtimes = exchange_runtimes(world, OwnerMap.from_group_tables([TABLES], 2), ids, algo=algo, bucket=64)
    for step in (1, 2):  # learn the schedule, then follow it
        _step(world, runtimes, ids, step)
    assert [rt.stats.scheduled_flushes for rt in runtimes] == [1, 1]

    ids = [1000, 3000]  # the recompile: rank 0's address reused, rank 1's not
    _register(world, runtimes, ids, reset=True)
    calls_before = [len(c.calls) for c in world.comms]
    for step in (3, 4):  # every rank learns again (arrival order), then follows the new schedule
        _step(world, runtimes, ids, step)
    after = [c.calls[n:] for c, n in zip(world.comms, calls_before, strict=True)]
    assert after[0] == after[1]
    for rt in runtimes:
        s = rt.stats
        assert (s.resets, s.schedules_learned, s.scheduled_flushes, s.schedule_fallbacks) == (1, 2, 2, 0), s
    # Rank 0 numbers graphs afresh after the reset: its new graph is graph #1 again.
    lines = runtimes[0].stats.schedule_lines
    assert len(lines) == 2 and all(line.startswith("[dc-schedule][r0] graph #1: ") for line in lines)


def test_a_new_registration_of_an_id_forgets_what_was_learned_under_it():
    """Without a reset: rank 0 registers a graph under an id that named a graph already learned (its address reused),
    rank 1 under a fresh id. Both learn the new graph from its first backward, alike."""
    world = ExchangeWorld(2, timeout_s=10)
    ids = [1000, 2000]
    runtimes = exchange_runtimes(world, OwnerMap.from_group_tables([TABLES], 2), ids, algo="allreduce", bucket=64)
    for step in (1, 2):
        _step(world, runtimes, ids, step)
    ids = [1000, 3000]
    _register(world, runtimes, ids, reset=False)
    for step in (3, 4):
        _step(world, runtimes, ids, step)
    for rt in runtimes:
        assert (rt.stats.resets, rt.stats.schedules_learned, rt.stats.scheduled_flushes) == (0, 2, 2), rt.stats
    assert [line.split(":")[0] for line in runtimes[0].stats.schedule_lines] == \
        ["[dc-schedule][r0] graph #1", "[dc-schedule][r0] graph #2"]
