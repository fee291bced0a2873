"""Issue 37 finding 7: every NCCL call of a planned flush starts 16-byte aligned in the bucket (``planning.alignment``),
with fewer than ``align`` elements of padding per owner region.

NCCL's ``reduceCopy`` moves 16-byte packs only when every pointer of a step is 16-byte aligned, else packs of one
element. Checked here without processes over the layouts the sizing plans for its presets (GPT-2 124M, GPT 1B and
Llama-2 7B, partitioned by DeepSpeed's own methods on the meta device, at world sizes 8, 24 and 64 on the default
cluster of 8 GPUs per node): every flush of a step at two bucket sizes, laid out for every candidate the model
considers (the one-level ones, and every two-level pipeline: Reduce chains and rail ReduceScatter, by owner and
balanced), in bf16 and fp32. A call's element offset, a ReduceScatter's ``per_rank`` and a hand-off piece's offset
must be multiples of ``align`` (8 bf16 / 4 fp32 elements); the padding a region gets for it is under ``align``.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from harness.launch import fresh_process_context
from owner_reduce.planning.alignment import align_elems, align_up, aligned_cut
from owner_reduce.planning.collectives import ALLREDUCE, HANDOFF, NATIVE, REDUCE, REDUCE_SCATTER, TWO_LEVEL
from owner_reduce.planning.flush_plan import FlushRange
from owner_reduce.planning.owner_layout import (
    MAX_PADDING_SHARE,
    TWO_LEVEL_MAX_PADDING_SHARE,
    analyse_flush,
    build_layout,
    map_order,
    plan_step_layouts,
)
from owner_reduce.planning.owner_map import OwnerMap
from owner_reduce.planning.sizing import DEFAULT_BUCKET_SIZE, Cluster, simulate_flushes
from owner_reduce.planning.two_level import BALANCED, BY_OWNER, RAIL_REDUCE, RAIL_SCATTER
from tests.support.fakes import flat_map

MODELS = ("gpt2-124m", "1b", "llama-7b")
WORLD_SIZES = (8, 24, 64)
BUCKETS = (DEFAULT_BUCKET_SIZE, 40_000_000)  # DeepSpeed's default, and one that cuts flushes inside owner regions


def _meta_layouts(world_size: int) -> list[tuple[str, list, tuple[int, ...]]]:
    """In a fresh process (the fake process group is process-global): each model's owner map (its placements: the map
    itself does not pickle) and gradient order."""
    from owner_reduce.offline_sizing.meta_layout import build_meta_layout
    from owner_reduce.offline_sizing.model_spec import ModelSpec

    out = []
    for name in MODELS:
        built = build_meta_layout(ModelSpec(name), world_size)
        out.append((name, list(built.owner_map), built.grad_order))
    return out


@pytest.fixture(scope="module")
def presets() -> dict[int, list[tuple[str, OwnerMap, tuple[int, ...]]]]:
    out = {}
    for world_size in WORLD_SIZES:
        with ProcessPoolExecutor(max_workers=1, mp_context=fresh_process_context()) as pool:
            built = pool.submit(_meta_layouts, world_size).result()
        out[world_size] = [(name, OwnerMap(placements, world_size), order) for name, placements, order in built]
    return out


def misaligned(layout, align: int) -> list[str]:
    """Every call or hand-off piece of ``layout`` whose buffer would not start 16-byte aligned (a ReduceScatter's
    rank ``r`` writes at ``offset + r * per_rank``)."""
    calls = [f"{c}" for c in layout.collectives if c.offset % align or c.per_rank % align]
    return calls + [f"{t}" for t in layout.transfers if t.offset % align]


def padding_problems(layout, sizes: list[int], align: int, option=None) -> list[str]:
    """Where ``layout`` pads an owner region by ``align`` or more elements for alignment (beyond the padding its
    candidate had before: a ReduceScatter's equal blocks, a two-level flush's node blocks, a hand-off's equal chunks).
    """
    n = len(sizes)
    regions = sorted((r for r in layout.plan.ranges if r.root is not None), key=lambda r: r.offset)
    out = []
    if layout.choice == REDUCE_SCATTER:
        per_rank = layout.collectives[0].per_rank
        if not 0 <= per_rank - max(sizes) < align:
            out.append(f"per_rank {per_rank} for a largest region of {max(sizes)}")
    elif layout.choice in (REDUCE, HANDOFF):
        for a, b in zip(regions, regions[1:], strict=False):
            if not 0 <= b.offset - (a.offset + a.count) < align:
                out.append(f"{a} then {b}")
        if layout.choice == HANDOFF and regions:
            span = layout.collectives[0].count
            if not 0 <= span - (regions[-1].offset + regions[-1].count) < (n + 1) * align:
                out.append(f"a span of {span} after {regions[-1]}")
    elif layout.choice == TWO_LEVEL:
        geo = option.geometry
        block = sum(geo.padding(local) for local in range(geo.ranks_per_node))
        by_owner = [sum(p.count for p in layout.padding if p.root == owner) for owner in range(n)]
        out += [f"owner {o}: {pad} elements of padding" for o, pad in enumerate(by_owner) if pad >= align]
        if sum(p.count for p in layout.padding) != block + sum(by_owner):
            out.append(f"padding {sum(p.count for p in layout.padding)} != blocks' {block} + regions' {by_owner}")
    elif layout.choice == NATIVE:
        placed = sorted((p for g in layout.grads for p in g.pieces), key=lambda p: p.bucket_offset)
        out += [f"{a} then {b}" for a, b in zip(placed, placed[1:], strict=False)
                if not 0 <= b.bucket_offset - (a.bucket_offset + a.length) < align]
    return out


def growth_problems(layout, sizes: list[int], align: int, flush_elems: int, gradients: int) -> list[str]:
    """The bucket grows by the layout's padding at most, within design.md's bounds for its candidate (section 4: a
    ReduceScatter 1% of the flush plus under ``align`` per rank, a hand-off under ``2 align`` per rank, Reduces under
    ``align`` per region, a two-level flush an eighth plus under ``align`` per region, native under ``align`` per
    gradient)."""
    n = len(sizes)
    grown = layout.total - flush_elems
    bound = {REDUCE_SCATTER: MAX_PADDING_SHARE * flush_elems + n * (align - 1),
             REDUCE: n * (align - 1), HANDOFF: n * (2 * align - 1) - 1, ALLREDUCE: 0,
             TWO_LEVEL: TWO_LEVEL_MAX_PADDING_SHARE * flush_elems + n * (align - 1),
             NATIVE: gradients * (align - 1)}[layout.choice]
    return [f"{layout.choice}: the bucket grows by {grown} > {bound}"] if not 0 <= grown <= bound else []


def _check_flush(grads, owner_map, cost, order, seen) -> list[str]:
    analysis = analyse_flush(grads, owner_map, order=order, cost=cost)
    align = align_elems(cost.dtype_bytes)
    sizes = analysis.sizes
    flush_elems = sum(n for _, n in grads)
    layouts = [(build_layout(analysis, choice), None) for choice in analysis.costs if choice != TWO_LEVEL]
    layouts += [(build_layout(analysis, TWO_LEVEL, option), option) for option in analysis.two_level]
    problems = []
    for layout, option in layouts:
        key = layout.choice if option is None else (TWO_LEVEL, option.rail_step, option.rail_layout)
        seen.add(key)
        found = (misaligned(layout, align) + padding_problems(layout, sizes, align, option)
                 + growth_problems(layout, sizes, align, flush_elems, len(grads)))
        problems += [f"{key}: {p}" for p in found[:3]]
    return problems


@pytest.mark.timeout(600)
def test_every_call_of_the_presets_planned_layouts_starts_aligned(presets):
    seen: set = set()
    problems = []
    checked = 0
    for world_size, models in presets.items():
        for dtype_bytes in (2, 4):
            cost = Cluster().cost(world_size, dtype_bytes)
            for name, owner_map, grad_order in models:
                order = map_order(owner_map)
                for bucket in BUCKETS:
                    flushes = simulate_flushes(owner_map, grad_order, bucket)
                    for i, entries in enumerate(flushes):
                        grads = [(e.param_id, e.numel) for e in entries]
                        found = _check_flush(grads, owner_map, cost, order, seen)
                        problems += [f"{name} ws {world_size} {dtype_bytes}-byte bucket {bucket} flush {i}: {p}"
                                     for p in found]
                        checked += 1
                    # The step's own plan (what the runtime runs) is among the candidates checked; its layouts too.
                    step = plan_step_layouts([(0, [(e.param_id, e.numel) for e in f]) for f in flushes], owner_map,
                                             True, capacity=bucket, cost_of=lambda _, c=cost: c, order=order)
                    problems += [f"{name} ws {world_size} planned: {p}" for layout in step.layouts
                                 for p in misaligned(layout, align_elems(dtype_bytes))]
    assert not problems, f"{len(problems)} problems, the first:\n" + "\n".join(problems[:20])
    assert checked > 50
    # Every candidate and every two-level variant was laid out somewhere.
    assert {REDUCE, REDUCE_SCATTER, HANDOFF, ALLREDUCE, NATIVE} <= seen, seen
    variants = {(TWO_LEVEL, step, layout) for step in (RAIL_REDUCE, RAIL_SCATTER) for layout in (BY_OWNER, BALANCED)}
    assert variants <= seen, seen


def test_the_reviewers_ws4_flush_of_123_odd_gradients():
    """The review's case: 123 odd-sized gradients at ws 4 (regions of 3783, 3783, 3783 and 3780 elements) started its
    Reduces at elements 0, 7, 6 and 5 (mod 8) and its ReduceScatter's blocks at multiples of 3783 (7 mod 8)."""
    numels = [2 * i + 1 for i in range(123)]
    owner_map = flat_map(numels, 4)
    grads = [(pid, numels[pid]) for pid in reversed(range(len(numels)))]
    analysis = analyse_flush(grads, owner_map)
    assert analysis.sizes == (3783, 3783, 3783, 3780)
    reduce = build_layout(analysis, REDUCE)
    assert [c.offset for c in reduce.collectives] == [0, 3784, 7568, 11352]
    assert analysis.per_rank == 3784 and build_layout(analysis, REDUCE_SCATTER).total == 4 * 3784
    for choice in analysis.costs:
        layout = build_layout(analysis, choice)
        assert misaligned(layout, 8) == [] and padding_problems(layout, analysis.sizes, 8) == [], choice


@pytest.mark.parametrize("align", [1, 4, 8])
def test_an_aligned_cut_shares_packs_and_shortens_only_its_last_part(align):
    for count in range(0, 70):
        for pieces in range(1, 6):
            parts = aligned_cut(count, pieces, align)
            assert len(parts) == pieces and sum(parts) == count
            filled = [i for i, n in enumerate(parts) if n]
            assert all(parts[i] % align == 0 for i in filled[:-1])
            assert not filled or align_up(parts[filled[-1]], align) - parts[filled[-1]] < align
            assert max(parts) - min(parts) < 2 * align


@pytest.mark.parametrize("zeroed", [True, False])
def test_the_runtime_zeroes_the_padding_its_calls_reduce(zeroed, monkeypatch):
    """The runtime's flush (a mirror communicator, in process) zeroes every padding range of the layout before its
    calls: the hand-off's ReduceScatter reads zeros there on every rank, so no stale bucket contents reach a sum.
    Regions of 15 and 15 fp32 elements in slots of 16. Negative control: the flush's padding step skipped in the
    product's path, the stale contents are still there. The buckets are allocated full of a stale value (the bucket
    module's ``torch.empty`` made ``torch.full``), so that stale contents are never zeros by chance: with double
    buffering the scheduled flush runs in the bucket the learning step did not use, whose ``torch.empty`` memory held
    whatever the allocator reused (zeros after an unrelated change of the planner's allocations)."""
    from types import SimpleNamespace

    from owner_reduce.runtime import buckets
    from owner_reduce.runtime.flush import Flusher
    from tests.support.fakes import mirror_runtime

    def stale(*size, dtype=None, device=None):  # noqa: ANN001, ANN002, ANN202
        return torch.full(size, -7.0, dtype=dtype, device=device)

    monkeypatch.setattr(buckets, "torch", SimpleNamespace(**{**vars(torch), "empty": stale}))

    if not zeroed:
        prepare = Flusher._prepare
        monkeypatch.setattr(Flusher, "_prepare", lambda self, cached, buffer, pads: prepare(self, cached, buffer, []))
    owner_map = flat_map([5, 7, 3, 9, 6], 2)
    rt, comm = mirror_runtime(owner_map, rank=0, bucket=64, algo="handoff")
    for scale in (1.0, 2.0):  # learn in arrival order, then follow the schedule
        rt.start_backward(True)
        for p in reversed(list(owner_map)):
            rt.reduce_grad(torch.arange(1, p.numel + 1, dtype=torch.float32) * scale, 11, p.param_id)
        rt.end_backward(11, False)
    (flush,) = rt.placer._schedules[11].flushes[torch.float32]
    assert rt.stats.scheduled_flushes == 1 and flush.layout.choice == HANDOFF
    assert flush.layout.padding == (FlushRange(15, 1, 0), FlushRange(31, 1, 1))
    read = [comm._scattered[p.offset:p.offset + p.count] for p in flush.layout.padding]  # the ReduceScatter's input
    assert all(bool((r == 0).all()) for r in read) == zeroed, read
