"""The owner-ordered bucket layout: where each gradient (or slice) of a flush goes, and which calls run.

Why: gradients reach the bucket in backward order (partitions descending) while a straddler's slices ascend,
so in arrival order the owners interleave and a flush costs one collective per run of owners (142 at ws 64 for
GPT-2 124M in one flush). Placing every gradient, or every slice of a straddling one, into its owner's region
(regions in ascending rank order, AllReduce-only entries after them) makes the owner regions contiguous, and
then a flush can run as any of ``flush_choice``'s candidates: one Reduce per owner it touches; one ReduceScatter
when it covers every rank with counts that are equal after padding the short regions with a few zeros (the owner
regions are then exactly a ReduceScatter's input: ZeRO's own flat partition layout); a ReduceScatter over equal
chunks followed by a hand-off of each chunk's pieces to their owners; or one AllReduce. The cheapest by NCCL's
alpha-beta model is laid out and runs (``flush_choice``). Each algorithm is one module of ``planning.algorithms``
with its cost and its layout; this module makes the facts they read (``flush_layout.FlushFacts``), costs every
registered algorithm, and lays out the one chosen, for the flush alone or for the step's plan.

Pure and deterministic: the layout is a function of (the flush's gradients in arrival order, the owner map,
the bucket capacity, the cost model) only, so every rank computes the same one without communicating. Within
an owner region pieces follow the owner map's parameter order (the order of ZeRO's flat buffer), then their
offset.

Aligned (``alignment``): every call a layout issues starts 16-byte aligned in the bucket, so NCCL moves 16-byte packs.
A region starts at a multiple of the alignment (``align``: 8 bf16 / 4 fp32 elements; the cost model's dtype) and
takes a slot of its size rounded up to it; a ReduceScatter's ``per_rank`` and a hand-off's chunk are multiples of it;
a region cut into Reduces is cut at multiples of it. The padding is zero-filled where a call reduces it (``padding``).
One AllReduce of the whole flush starts at 0 and needs none; native's gradients each start aligned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import algorithms
from .algorithms import Estimate
from .alignment import align_elems, align_up, slots
from .calls import ALLREDUCE, HANDOFF, NATIVE, REDUCE, REDUCE_SCATTER, TWO_LEVEL
from .collective_time import named_topology
from .collectives import Collective, Transfer, algo_of, collectives_of
from .flush_choice import AUTO, FlushCost, choose
from .flush_layout import (
    EveryonePiece,
    FlushFacts,
    OwnerLayout,
    PlacedGrad,
    PlacedPiece,
    RegionPiece,
    entries_of,
)
from .flush_plan import FlushPlan, FlushRange, merge_ranges, plan_flush
from .owner_map import OwnerMap, Placement
from .step_plan import FlushTimes, StepPlan, native_step_us, plan_step, schedule
from .two_level import TwoLevelOption

__all__ = ["ALLREDUCE", "HANDOFF", "NATIVE", "REDUCE", "REDUCE_SCATTER", "Collective", "OwnerLayout", "PlacedGrad",
           "PlacedPiece", "Transfer", "algo_of", "collectives_of", "default_cost", "map_order",
           "plan_owner_layout", "plan_placed"]

MAX_PADDING_SHARE = 0.01  # a padded ReduceScatter may pad the short regions by at most 1% of the flush's elements
# A two-level flush may pad the shorter node blocks (blocks hold different owners' regions); the padding grows the
# bucket and the node step's bytes (the latter costed), so it is bounded: at most an eighth of the flush. Past the
# bound the longer blocks' tails run as node Reduces instead (two_level Note (unequal blocks)).
TWO_LEVEL_MAX_PADDING_SHARE = 0.125


@dataclass(frozen=True)
class FlushAnalysis(FlushFacts):
    """One flush before an algorithm is laid out: its facts and every registered algorithm's ``Estimate`` that applies
    (``estimates``; ``costs`` their modelled times alone, host issue included; ``issue`` the host's part of each one
    that is not a pipeline). ``plan_owner_layout`` lays out the cheapest for the flush alone; the step's plan
    (``plan_step_layouts``) chooses among them, a pipeline's options (two-level) each, for the whole step."""

    estimates: dict[str, Estimate]
    costs: dict[str, float]
    issue: dict[str, float]

    def times(self, choice: str, option: Any = None) -> FlushTimes:
        """``choice`` (``option``: its pipeline) as the step's schedule sees it (``step_plan.FlushTimes``): device time
        and host issue."""
        pipeline = algorithms.get(choice).pipeline
        if pipeline is not None and option is not None:
            return pipeline.times(self, option)
        issue = self.issue.get(choice, 0.0)
        return FlushTimes(world_us=self.costs[choice] - issue, issue_us=(issue,))

    @property
    def native_times(self) -> FlushTimes:
        """Native DeepCompile's calls for this flush (the baseline), as the schedule sees them."""
        return FlushTimes(world_us=self.native[0], issue_us=(self.native[1],))

    @property
    def calls(self) -> dict[str, int]:
        """The calls each candidate issues, for ties (they go to the fewest: ``flush_choice.choose``); two-level
        counted past native's, so a tie with it goes to a one-level candidate."""
        return {name: e.calls for name, e in self.estimates.items()}

    def options(self, choice: str) -> tuple[Any, ...]:
        """A pipeline's options for this flush (none where it is no pipeline or does not apply)."""
        estimate = self.estimates.get(choice)
        pipeline = algorithms.get(choice).pipeline
        return () if estimate is None or pipeline is None else tuple(pipeline.options(estimate))

    @property
    def two_level(self) -> tuple[TwoLevelOption, ...]:
        return self.options(TWO_LEVEL)

    def one_level_choice(self) -> str:
        """The cheapest candidate that is no pipeline (or the forced one)."""
        one_level = {k: v for k, v in self.costs.items() if algorithms.get(k).pipeline is None}
        return choose(one_level, self.force, self.calls)

    def best_option(self, choice: str) -> Any:
        """A pipeline's option fastest for the flush alone (ties: the first, in its options' order), or None."""
        return min(self.options(choice), key=lambda o: self.times(choice, o).alone_us, default=None)

    def best_two_level(self) -> TwoLevelOption | None:
        return self.best_option(TWO_LEVEL)


def analyse_flush(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, reduce_to_owner: bool = True, *,
                  capacity: int | None = None, max_padding_share: float = MAX_PADDING_SHARE,
                  order: dict[int, int] | None = None, cost: FlushCost | None = None) -> FlushAnalysis:
    """Every registered algorithm's estimate for one flush of ``grads`` ((param_id, numel) in arrival order).

    ``capacity``: bucket elements available; a padded ReduceScatter's regions must fit in it (default: no limit).
    ``max_padding_share``: the most padding a padded ReduceScatter may add, as a share of the flush's elements.
    ``order``: param_id -> position in the owner map (``map_order``), to skip recomputing it per flush.
    ``cost``: the model that chooses (default: the world size's named topology, bf16, ``auto``).
    Without ``reduce_to_owner`` every gradient goes to the AllReduce region in arrival order. Under a calibration an
    algorithm it cannot time (``Algorithm.calibrated``) is costed only when forced.
    """
    entries = entries_of(grads)
    counted = plan_flush(entries, owner_map, reduce_to_owner)  # counters, and validates the numels
    n = owner_map.dp_world_size
    cost = default_cost(n) if cost is None else cost
    order = map_order(owner_map) if order is None else order
    regions: list[list[RegionPiece]] = [[] for _ in range(n)]  # by destination, sorted below
    everyone: list[EveryonePiece] = []
    for entry in entries:
        placement = owner_map.placement(entry.param_id)
        owned = reduce_to_owner and (placement.placement is Placement.ONE_OWNER or placement.sliced)
        if not owned:
            if entry.numel:
                everyone.append(EveryonePiece(entry.param_id, 0, entry.numel))
            continue
        for piece in placement.slices:
            if piece.length:
                regions[piece.owner].append(RegionPiece((order[entry.param_id], piece.offset), entry.param_id,
                                                        piece.offset, piece.length))
    for region in regions:
        region.sort()
    sizes = tuple(sum(p.length for p in region) for region in regions)
    owner_elems = sum(sizes)
    all_elems = sum(p.length for p in everyone)
    # The packed geometry (regions back to back from 0 in aligned slots, the AllReduce region after them; a hand-off's
    # world_size equal aligned chunks covering them; a ReduceScatter's blocks: the largest region, aligned) and the
    # AllReduce of the gradients that reach every rank, which the algorithms share.
    align = align_elems(cost.dtype_bytes)
    slotted = sum(slots(sizes, align))
    chunk = align_up(-(-slotted // n), align) if owner_elems else 0
    everyone_call = ((ALLREDUCE, all_elems),) if all_elems else ()
    facts = dict(entries=tuple(entries), counted=counted, regions=tuple(tuple(r) for r in regions),
                 everyone=tuple(everyone), sizes=sizes, cost=cost, align=align,
                 per_rank=align_up(max(sizes, default=0), align), chunk=chunk,
                 packed_span=n * chunk if n > 1 else slotted, everyone_call=everyone_call,
                 everyone_us=cost.calls_us(everyone_call) if everyone_call else 0.0,
                 everyone_issue=cost.issue_us(len(everyone_call)),
                 native=cost.native_parts(e.numel for e in entries), force=cost.force, capacity=capacity,
                 max_padding_share=max_padding_share, two_level_max_padding_share=TWO_LEVEL_MAX_PADDING_SHARE)
    base = FlushFacts(**facts)
    estimates: dict[str, Estimate] = {}
    for algorithm in algorithms.registered():
        if cost.calibration is not None and not algorithm.calibrated and cost.force != algorithm.name:
            continue
        estimate = algorithm.cost(base)
        if estimate is not None:
            estimates[algorithm.name] = estimate
    return FlushAnalysis(**facts, estimates=estimates, costs={k: e.us for k, e in estimates.items()},
                         issue={k: e.issue_us for k, e in estimates.items()
                                if algorithms.get(k).pipeline is None})


def plan_owner_layout(grads: Sequence[tuple[int, int]], owner_map: OwnerMap, reduce_to_owner: bool = True, *,
                      capacity: int | None = None, max_padding_share: float = MAX_PADDING_SHARE,
                      order: dict[int, int] | None = None, cost: FlushCost | None = None) -> OwnerLayout:
    """Lay out one flush of ``grads`` for the candidate that runs when the flush is costed alone (``analyse_flush``'s
    arguments). A learned schedule's flushes are chosen together instead (``plan_step_layouts``)."""
    analysis = analyse_flush(grads, owner_map, reduce_to_owner, capacity=capacity,
                             max_padding_share=max_padding_share, order=order, cost=cost)
    choice = choose(analysis.costs, analysis.force, analysis.calls)
    return build_layout(analysis, choice, analysis.best_option(choice))


def build_layout(analysis: FlushAnalysis, choice: str, option: Any = None) -> OwnerLayout:
    """``analysis``'s flush laid out for ``choice`` (``option``: its pipeline, for a pipelined algorithm): the
    algorithm's layout with the choice, its modelled time alone and its host issue, and every candidate's time."""
    algorithm = algorithms.get(choice)
    if algorithm.pipeline is not None and option is not None:
        times = algorithm.pipeline.times(analysis, option)
        modelled_us, issue_us = times.alone_us, times.host_us
    else:
        modelled_us, issue_us = analysis.costs[choice], analysis.issue.get(choice, 0.0)
    layout = algorithm.layout(analysis, analysis.estimates[choice], option)
    return replace(layout, choice=choice, modelled_us=modelled_us, costs=tuple(sorted(analysis.costs.items())),
                   issue_us=issue_us)


def plan_step_layouts(flushes: Sequence[tuple[Any, Sequence[tuple[int, int]]]], owner_map: OwnerMap,
                      reduce_to_owner: bool, *, capacity: int, cost_of: Callable[[Any], FlushCost],
                      order: dict[int, int] | None = None, per_bucket: int = 2) -> StepLayouts:
    """A learned schedule's flushes ((dtype key, grads) in the order they happen), laid out for the step's plan
    (``step_plan``): each flush's candidates analysed (``analyse_flush``), every flush's options chosen together on
    the node and rail streams (two-level pipelines of consecutive flushes overlap), then laid out. ``cost_of(dtype)``:
    the model for a dtype's bytes; ``per_bucket``: buffers a dtype keeps (two with double buffering)."""
    order = map_order(owner_map) if order is None else order
    analyses = [analyse_flush(grads, owner_map, reduce_to_owner, order=order, cost=cost_of(dtype),
                              capacity=max([capacity] + [n for _, n in grads])) for dtype, grads in flushes]
    pipelined = [algorithm.name for algorithm in algorithms.registered() if algorithm.pipeline is not None]
    options: list[list[tuple[FlushTimes, str, Any]]] = []
    for a in analyses:
        staged = sorted(((a.times(name, o), name, o) for name in pipelined for o in a.options(name)),
                        key=lambda t: t[0].alone_us)
        if a.force in pipelined and a.options(a.force):  # forced: its pipelines only, the fastest alone its fallback
            options.append([t for t in staged if t[1] == a.force])
            continue
        one_level = a.one_level_choice()
        options.append([(a.times(one_level), one_level, None)] + (staged if a.force == AUTO else []))
    keys = {dtype: i for i, dtype in enumerate(dict.fromkeys(d for d, _ in flushes))}
    plan = plan_step([[t for t, _, _ in flush] for flush in options], [a.native_times for a in analyses],
                     [keys[d] for d, _ in flushes], per_bucket)
    picked = tuple(options[i][j][1:] for i, j in enumerate(plan.picks))
    layouts = tuple(build_layout(a, *pick) for a, pick in zip(analyses, picked, strict=True))
    return StepLayouts(layouts, plan, per_bucket, picked)


def cost_step_choices(flushes: Sequence[tuple[Any, Sequence[tuple[int, int]]]], owner_map: OwnerMap,
                      step: StepLayouts, *, capacity: int, cost_of: Callable[[Any], FlushCost],
                      order: dict[int, int] | None = None) -> StepPlan:
    """``step``'s choices (each flush's candidate; a pipeline's option: a two-level flush's geometry and rail step),
    made under one model, costed under ``cost_of`` and scheduled as the runtime runs them: what a plan made at full
    bandwidth costs where the network delivers less (the sizing's hand-off sensitivity). ``flushes`` as for
    ``plan_step_layouts``."""
    order = map_order(owner_map) if order is None else order
    times: list[FlushTimes] = []
    native: list[FlushTimes] = []
    for (dtype, grads), (choice, option) in zip(flushes, step.choices, strict=True):
        cost = cost_of(dtype)
        a = analyse_flush(grads, owner_map, True, order=order, cost=cost,
                          capacity=max([capacity] + [n for _, n in grads]))
        native.append(a.native_times)
        pipeline = algorithms.get(choice).pipeline
        recosted = pipeline.recost(a, option, cost) if pipeline is not None and option is not None else None
        times.append(a.times(choice) if recosted is None else a.times(choice, recosted))
    keys = {dtype: i for i, dtype in enumerate(dict.fromkeys(d for d, _ in flushes))}
    steps = schedule(times, [keys[d] for d, _ in flushes], step.per_bucket)
    return StepPlan((0,) * len(times), steps, native_step_us(native), tuple(times))


@dataclass(frozen=True)
class StepLayouts:
    """A step's flushes laid out for its plan (``plan_step_layouts``), and the plan's schedule."""

    layouts: tuple[OwnerLayout, ...]
    plan: StepPlan
    per_bucket: int
    choices: tuple[tuple[str, Any], ...] = ()  # per flush: its candidate and its pipeline (two-level), or None


def default_cost(world_size: int, dtype_bytes: int = 2) -> FlushCost:
    """The cost model of a world size's named topology (``collective_time.named_topology``, as the sizing uses);
    without one every candidate costs 0 and the fewest calls win."""
    return FlushCost(named_topology(world_size), dtype_bytes)


def map_order(owner_map: OwnerMap) -> dict[int, int]:
    """param_id -> position in the owner map (group order, then the group's parameter order: ZeRO's flat order)."""
    return {p.param_id: i for i, p in enumerate(owner_map)}


def plan_placed(grads: Sequence[PlacedGrad], owner_map: OwnerMap, reduce_to_owner: bool) -> FlushPlan:
    """The plan of a flush holding only ``grads`` of a layout (a step that left the schedule): each piece
    reduces where the layout put it; adjacent pieces with the same root merge; holes are not reduced."""
    counted = plan_flush(entries_of([(g.param_id, g.numel) for g in grads]), owner_map, reduce_to_owner)
    pieces = sorted((p for g in grads for p in g.pieces), key=lambda p: p.bucket_offset)
    return replace(counted, ranges=merge_ranges(FlushRange(p.bucket_offset, p.length, p.root) for p in pieces))
