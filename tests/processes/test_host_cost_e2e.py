"""Issue 39 on 4 gloo ranks: a cut of Reduces only where it pays for its calls.

ZeRO stage 2, small buckets (5,000 elements), the tiny transformer (dim 24), ``compile.reduce_to_owner_algo``
"reduce" (the measured guard never runs under a forced algorithm, so every flush after the first backward is the
model's layout). Before issue 39 the model cut a 4,776-element flush of two owners into 18 Reduces to save one chain's
latency (about 9 us at 4 ranks on one node); each call costs the host its issue (``planning.host_cost``), so that cut
costs more than it saves. The product must issue no more Reduces than the owners a flush touches unless the model's
saving, host cost included, is positive; the cut that does pay (a 2,808-element flush in 5 Reduces) stays. The
negative control zeroes the host cost in the product's cost model (fault ``no_host_cost``): the 18 Reduces are back,
and the healthy run's check would fail on them."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from harness.launch import run_ranks
from harness.toy_training import TrainSpec, train_each
from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.collectives import REDUCE
from owner_reduce.planning.flush_choice import FlushCost

SPEC = TrainSpec(mode="owner", zero_stage=2, steps=3, model="tiny_transformer", model_kwargs=(("dim", 24),),
                 reduce_bucket_size=5000, flush_algo="reduce", record_collectives=True)
PLAIN = TrainSpec(mode="plain", zero_stage=2, steps=3, model="tiny_transformer", model_kwargs=(("dim", 24),),
                  reduce_bucket_size=5000, reduce_to_owner=False, reduce_probe=False)
CALLS_RE = re.compile(r"flushReduceBucket #(\d+) .* calls=(\d+) ")
# What the 4 ranks agree on (one node of 4, CPU: Hopper's constants; ``flush_choice.agreed_topology``), fp32.
COST = FlushCost(ct.topology_of(4, 4), 4, force=REDUCE)


def _flushes(result: dict) -> list[tuple[int, list[tuple[int, int]]]]:
    """Per flush of rank ``result``: (elements, its Reduces as (root, count) in issue order), from the runtime's log."""
    log = iter(result["collective_log"])
    out = []
    for record in result["flush_log"]:
        calls = [next(log) for _ in range(record.calls)]
        assert all(name == "reduce" for name, *_ in calls), calls  # forced: every call a Reduce
        out.append((record.reduced_elems, [(root, count) for _, root, count, _ in calls]))
    return out


def _scheduled(result: dict) -> list[tuple[int, list[tuple[int, int]]]]:
    """The owner-ordered flushes: every backward's after the first (the first runs in arrival order, one Reduce per
    run of owners, which interleave)."""
    flushes = _flushes(result)
    per_step = len(flushes) // SPEC.steps
    assert per_step * SPEC.steps == len(flushes) and per_step >= 3
    return flushes[per_step:]


def _uncut(calls: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """One Reduce per owner: the cut pieces of each root summed (they are consecutive parts of its region)."""
    regions: dict[int, int] = {}
    for root, count in calls:
        regions[root] = regions.get(root, 0) + count
    return [(REDUCE, n) for n in regions.values()]


def _unpaid_cuts(flushes: list[tuple[int, list[tuple[int, int]]]]) -> list[tuple[int, int, int]]:
    """(elements, calls, owners) of every flush that issues more Reduces than it has owners although, host cost
    included, the cut does not save time."""
    out = []
    for elems, calls in flushes:
        uncut = _uncut(calls)
        if len(calls) > len(uncut) and COST.group_us([(REDUCE, n) for _, n in calls]) >= COST.group_us(uncut):
            out.append((elems, len(calls), len(uncut)))
    return out


@pytest.mark.timeout(420)
def test_a_flush_issues_more_reduces_than_owners_only_where_the_cut_pays_for_its_calls():
    by_rank = run_ranks(train_each, 4, args=((PLAIN, SPEC),), timeout=300)
    plain, owner = tuple(r[0] for r in by_rank), tuple(r[1] for r in by_rank)
    for rank, (o, p) in enumerate(zip(owner, plain, strict=True)):
        assert o["losses"] == p["losses"], f"rank {rank}: losses differ from plain ZeRO-2"
        assert all(torch.equal(o["params"][k], p["params"][k]) for k in p["params"]), f"rank {rank}: params differ"
        assert o["stats"].owner_elems == o["stats"].reduced_elems > 0  # the owner path ran, every element on it
    scheduled = _scheduled(owner[0])
    assert all(_scheduled(r) == scheduled for r in owner[1:]), "the ranks issued different calls"
    # The probe's calls= (rank 0's first 20 flushes) are the calls the runtime issued.
    probed = {int(m.group(1)): int(m.group(2)) for m in map(CALLS_RE.search, owner[0]["stats"].probe_lines) if m}
    flushes = _flushes(owner[0])
    assert len(probed) == min(20, len(flushes)) and all(probed[i + 1] == len(calls)
                                                         for i, (_, calls) in enumerate(flushes) if i < 20)
    assert _unpaid_cuts(scheduled) == []
    by_size = {elems: len(calls) for elems, calls in scheduled}
    assert by_size[4776] == 2  # two owners, two Reduces: 18 before issue 39
    cuts = [(elems, len(calls), len(_uncut(calls))) for elems, calls in scheduled if len(calls) > len(_uncut(calls))]
    assert (2808, 5, 2) in cuts  # the cut that pays for its calls stays


@pytest.mark.timeout(420)
def test_negative_control_without_host_cost_the_product_cuts_a_flush_into_18_reduces_again():
    spec = dataclasses.replace(SPEC, inject_fault="no_host_cost")
    (owner,) = zip(*run_ranks(train_each, 4, args=((spec,),), timeout=300), strict=True)
    scheduled = _scheduled(owner[0])
    assert (4776, 18, 2) in _unpaid_cuts(scheduled), scheduled
