"""Adding a flush algorithm is one module and one registry line (``planning.algorithms``; ``docs/design.md`` "Adding an
algorithm"): this file is the module, ``register(PER_OWNER)`` the line. The algorithm is made of a call kind that
exists: one AllReduce per owner region, which gives every rank the right sums and its owner what it keeps.

Its cost says it is free, so the cost model picks it for every owner-ordered flush: what is shown is that the registry
alone makes the product choose it, lay it out and run it. Pure checks (the registry's order, what may be forced), then
end to end on in-process exchanging ranks (``ExchangeWorld``) and on the simulated device's cupy path: the runtime ran
its calls (the collective log is the layouts' calls, and what NCCL saw), and every grad buffer holds the exact sum.
Negative controls: unregistered, no flush runs it; a variant that leaves out one owner's AllReduce is registered the
same way, and the exact sums catch it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from owner_reduce.planning import algorithms
from owner_reduce.planning.algorithms import Algorithm, Estimate, register, unregister
from owner_reduce.planning.calls import ALLREDUCE
from owner_reduce.planning.collective_time import topology_of
from owner_reduce.planning.collectives import Collective
from owner_reduce.planning.flush_choice import FlushCost, force_values
from owner_reduce.planning.flush_layout import FlushFacts, OwnerLayout, owner_regions_layout, pack_regions
from owner_reduce.planning.owner_layout import plan_owner_layout
from owner_reduce.planning.settings import ALGO_VALUES
from tests.support.fakes import ExchangeWorld, exchange_backward, flat_map, mirror_runtime

NAME = "allreduce_per_owner"
NUMELS = [3 + (5 * i) % 13 for i in range(30)]
GRAPH = 11
STEPS = 3  # learning (arrival order), then the owner-ordered schedule twice

# ---- the module: what a newcomer writes (planning/algorithms/allreduce_per_owner.py) ---------------------------


def cost(facts: FlushFacts) -> Estimate | None:
    """Applies where the flush holds owner regions; claims to cost nothing (this test's point: it is chosen)."""
    if not facts.owner_elems:
        return None
    return Estimate(us=0.0, issue_us=0.0, calls=sum(1 for n in facts.sizes if n) + bool(facts.everyone))


def layout(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    """The owner regions in rank order, each in its aligned slot, one AllReduce each; the gradients that reach every
    rank after them, one AllReduce (``owner_regions_layout``)."""
    packed = pack_regions(facts)
    calls = [Collective(ALLREDUCE, start, size) for start, size in zip(packed.starts, facts.sizes, strict=True)
             if size]
    return owner_regions_layout(facts, packed, calls, packed.end)


PER_OWNER = Algorithm(NAME, cost, layout)


def _missing_one(facts: FlushFacts, estimate: Estimate, option: Any = None) -> OwnerLayout:
    """Negative control: the same, with the last owner's AllReduce left out."""
    laid = layout(facts, estimate, option)
    calls = list(laid.collectives)
    del calls[sum(1 for n in facts.sizes if n) - 1]  # the regions' calls come first, in rank order
    return OwnerLayout(laid.grads, laid.plan, tuple(calls), laid.padding, laid.total)


@pytest.fixture
def per_owner():
    register(PER_OWNER)  # the registry line
    yield PER_OWNER
    unregister(NAME)


# ---- pure ---------------------------------------------------------------------------------------------------------

def test_registered_it_is_a_candidate_last_in_tie_order_and_may_be_forced(per_owner):
    assert algorithms.names() == ("reduce_scatter", "reduce", "allreduce", "handoff", "native", "two_level", NAME)
    assert NAME in algorithms.forceable() and force_values()[-1] == NAME
    owner_map = flat_map(NUMELS, 4)
    grads = [(p.param_id, p.numel) for p in owner_map][::-1]
    chosen = plan_owner_layout(grads, owner_map, cost=FlushCost(topology_of(4, 4)))
    assert chosen.choice == NAME and NAME in dict(chosen.costs)
    assert [c.count for c in chosen.collectives] == [r.count for r in chosen.plan.ranges]  # one call per region
    # The config's values are the registry's at import: the product's algorithms (the init agreement encodes them).
    assert NAME not in ALGO_VALUES and ALGO_VALUES == ("auto", "model", "reduce", "allreduce", "handoff", "native",
                                                       "two_level")
    with pytest.raises(ValueError, match="is registered already"):
        register(PER_OWNER)


def test_negative_control_unregistered_it_is_no_candidate():
    assert NAME not in algorithms.names()
    with pytest.raises(ValueError, match="flush algorithm must be one of auto, reduce, allreduce, handoff, native, "
                                         "two_level, got 'allreduce_per_owner'"):
        FlushCost(None, force=NAME)
    owner_map = flat_map(NUMELS, 4)
    chosen = plan_owner_layout([(p.param_id, p.numel) for p in owner_map], owner_map,
                               cost=FlushCost(topology_of(4, 4)))
    assert chosen.choice != NAME and NAME not in dict(chosen.costs)


# ---- end to end ---------------------------------------------------------------------------------------------------

def _grads(ws: int, rank: int, step: int) -> dict[int, torch.Tensor]:
    """Multiples of ``ws``, different per rank and step: every partial sum is exact (``test_two_level_exchange``)."""
    return {pid: ws * (torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1) + 100 * step + 10 * pid)
            for pid, n in enumerate(NUMELS)}


def _exchange(ws: int) -> list[Any]:
    world = ExchangeWorld(ws, timeout_s=20)
    owner_map = flat_map(NUMELS, ws)
    runtimes = world.run(lambda rank: mirror_runtime(owner_map, rank=rank, graph_id=GRAPH, comm=world.comm(rank),
                                                     bucket=64)[0])
    for rt in runtimes:
        rt.record_collectives = True

    def exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert torch.equal(got, want), what

    for step in range(STEPS):
        exchange_backward(world, runtimes, lambda rank, step=step: _grads(ws, rank, step), GRAPH,
                          list(reversed(range(len(NUMELS)))), exact)
    return runtimes


def _ran(rt: Any) -> bool:
    """Whether ``rt`` ran the test's algorithm for every owner-ordered flush: its schedule's layouts chose it, and the
    collective log of the last two steps is those layouts' calls, one AllReduce per region, step after step."""
    schedule = rt.placer._schedules[GRAPH]
    layouts = [f.layout for flushes in schedule.flushes.values() for f in flushes]
    if not layouts or not all(lay.choice == NAME for lay in layouts):
        return False
    calls = [("all_reduce", None, c.count) for lay in layouts for c in lay.collectives]
    steady = [(name, root, count) for name, root, count, _ in rt.collective_log[-2 * len(calls):]]
    return steady == 2 * calls and all(c.kind == ALLREDUCE for lay in layouts for c in lay.collectives)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ws", [3, 4])
def test_it_runs_end_to_end_between_exchanging_ranks(ws, per_owner):
    runtimes = _exchange(ws)
    assert all(rt.stats.scheduled_flushes > 0 and _ran(rt) for rt in runtimes)
    layouts = [f.layout for flushes in runtimes[0].placer._schedules[GRAPH].flushes.values() for f in flushes]
    assert any(len(lay.collectives) > 1 for lay in layouts)  # a flush of several owners: an AllReduce each


@pytest.mark.timeout(120)
def test_negative_control_unregistered_the_runtime_runs_another_algorithm():
    runtimes = _exchange(4)
    assert not any(_ran(rt) for rt in runtimes)


@pytest.mark.timeout(120)
def test_negative_control_a_variant_that_leaves_out_one_owners_call_is_caught_by_the_sums():
    register(Algorithm(NAME, cost, _missing_one))
    try:
        with pytest.raises(AssertionError, match=r"rank \d, param \d+"):
            _exchange(4)
    finally:
        unregister(NAME)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ws", [2, 4])
def test_it_runs_end_to_end_on_the_simulated_devices_cupy_path(ws, per_owner):
    from owner_reduce.runtime.nccl_comm import CupyNcclComm
    from tests.support.sim.cuda import Sim
    from tests.support.sim.runtime import check_buffers, check_collective_log, cupy_runtimes, train_step

    owner_map = flat_map(NUMELS, ws)
    with Sim(hang_bound_s=20, hb=True) as sim:
        runtimes = cupy_runtimes(sim, owner_map, bucket=64)
        for step in range(STEPS):
            train_step(sim, runtimes, NUMELS, step, 1)
            assert check_buffers(sim, runtimes, owner_map, NUMELS, step, 1) > 0  # bitwise the exact sums
            if step == 0:
                learning = sim.counters["nccl misaligned"]
        assert sim.counters["nccl misaligned"] == learning  # its calls start 16-byte aligned (``alignment``)
        check_collective_log(sim, runtimes)  # the log is what NCCL saw on each communicator
        for rt in runtimes:
            assert isinstance(rt.comm, CupyNcclComm) and _ran(rt)
        assert sim.hangs == [] and sim.nccl.mismatches == [] and not sim.races
        sim.run_ranks(lambda rank: runtimes[rank].cleanup(), ws)
