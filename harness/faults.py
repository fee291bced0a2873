"""Deliberately broken reductions: the negative controls of the tests and the acceptance script.

Why: a comparison that cannot fail proves nothing. The acceptance script's ``--inject-fault``
and the tests use these to show that a wrong root, a skipped range or a misplaced slice is caught. Never
active unless asked. Both planners the runtime uses are broken alike: ``plan_flush`` (arrival-order flushes, looked
up in ``runtime.flush`` at call time) and ``plan_owner_layout`` (the owner-ordered schedule, looked up in
``runtime.placement``). ``handoff_wrong_owner`` sends one piece of a hand-off to a rank that does not keep it;
``wrong_rail`` reduces one owner region of a two-level flush on another local rank's rail (which holds other partial
sums there). ``drop_trial_state``: a checkpoint's trials under way are dropped where the runtime reads its state
(``runtime.guard``), so a resumed run measures its trials anew (issue 40's negative control). ``no_host_cost``: the
runtime's cost model charges no host time for a call (``planning.host_cost.NONE``), as before issue 39: the cut of
Reduces, the stage count and the hand-offs are chosen on NCCL's latency and bandwidth alone (its negative control).
``monitor_every_step``: the runtime measures every step for DeepSpeed's monitor instead of every ``steps_per_print``-th
(``planning.monitor.due``, looked up in ``runtime.handle``): the monitor test's negative control.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from owner_reduce.planning.collectives import HANDOFF, RAIL, REDUCE, REDUCE_SCATTER, Collective, Transfer
from owner_reduce.planning.flush_plan import FlushRange
from owner_reduce.planning.owner_layout import OwnerLayout

FAULTS = ("wrong_root", "skip_range", "layout_off_by_one", "handoff_wrong_owner", "wrong_rail",
          "show_unoptimized_params", "drop_trial_state", "no_host_cost", "monitor_every_step")


def misroute_handoff(layout: OwnerLayout, world_size: int) -> OwnerLayout:
    """``layout`` with its first hand-off transfer sent to a rank other than its owner (one that gets nothing else
    from that sender, so that every send still meets exactly one receive); unchanged without a hand-off."""
    transfers = list(layout.transfers)
    pairs = {(t.src, t.dst) for t in transfers}
    for i, t in enumerate(transfers):
        for wrong in range(world_size):
            if wrong not in (t.src, t.dst) and (t.src, wrong) not in pairs:
                transfers[i] = Transfer(t.src, wrong, t.offset, t.count)
                return dataclasses.replace(layout, transfers=tuple(transfers))
    return layout


def wrong_rail(layout: OwnerLayout) -> OwnerLayout:
    """``layout`` with its first rail Reduce issued on the next local rank's rail instead of its own (the same on every
    rank, so every rail's members still agree on their calls); unchanged without a two-level flush."""
    calls = list(layout.collectives)
    i = next((i for i, c in enumerate(calls) if c.comm == RAIL), None)
    if not layout.ranks_per_node or i is None:
        return layout
    calls[i] = dataclasses.replace(calls[i], rail=(calls[i].rail + 1) % layout.ranks_per_node)
    return dataclasses.replace(layout, collectives=tuple(calls))


def break_step_layouts(step: Any, fault: str, world_size: int) -> Any:
    """A learned schedule's ``StepLayouts`` with every flush's layout broken as ``break_layout`` breaks one."""
    return dataclasses.replace(step, layouts=tuple(break_layout(layout, fault, world_size) for layout in step.layouts))


def break_layout(layout: OwnerLayout, fault: str, world_size: int) -> OwnerLayout:
    """``layout`` with its first owner call broken as ``fault`` says; ``layout_off_by_one`` packs the same pieces
    one slice later (the last piece first), a valid packing that disagrees with the calls and the copy-out."""
    if fault == "handoff_wrong_owner":
        return misroute_handoff(layout, world_size)
    if fault == "wrong_rail":
        return wrong_rail(layout)
    if fault == "layout_off_by_one":
        pieces = sorted((p for g in layout.grads for p in g.pieces), key=lambda p: p.bucket_offset)
        moved, offset = {}, 0
        for p in pieces[-1:] + pieces[:-1]:
            moved[(p.param_id, p.src_offset)] = dataclasses.replace(p, bucket_offset=offset)
            offset += p.length
        return dataclasses.replace(layout, grads=tuple(
            dataclasses.replace(g, pieces=tuple(moved[(p.param_id, p.src_offset)] for p in g.pieces))
            for g in layout.grads))
    calls = list(layout.collectives)
    i = next((i for i, c in enumerate(calls) if c.kind in (REDUCE, REDUCE_SCATTER)), None)
    if i is None:
        return layout
    if calls[i].kind == REDUCE_SCATTER:  # as one Reduce per block, so that one root can be wrong
        if any(c.kind == HANDOFF for c in calls):
            return misroute_handoff(layout, world_size) if fault == "wrong_root" else dataclasses.replace(
                layout, transfers=layout.transfers[1:])  # skip_range: one piece never moves
        c = calls[i]
        calls[i:i + 1] = [Collective(REDUCE, c.offset + r * c.per_rank, c.per_rank, r) for r in range(world_size)]
    if fault == "wrong_root":
        calls[i] = dataclasses.replace(calls[i], root=(calls[i].root + 1) % world_size)
    else:
        del calls[i]
    return dataclasses.replace(layout, collectives=tuple(calls))


def inject(fault: str, world_size: int) -> None:
    """From now on, in this process, every flush plan and layout is broken as ``fault`` says;
    ``show_unoptimized_params``: DeepCompile sees frozen and zero-element parameters as parameters again (the
    upstream behaviour, which fails at the first forward)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if fault == "show_unoptimized_params":
        import owner_reduce.wiring.activation as activation

        activation.hide_unoptimized_params = lambda backend_fn, optimized: backend_fn
        return
    if fault == "drop_trial_state":
        import owner_reduce.runtime.guard as guard

        parse = guard.parse_checkpoint_payload

        def without_trials(data: Any, source: str) -> Any:
            book, recordings, _ = parse(data, source)
            return book, recordings, ()

        guard.parse_checkpoint_payload = without_trials
        return
    if fault == "monitor_every_step":
        import owner_reduce.runtime.handle as handle

        handle.due = lambda steps_done, every: every > 0
        return
    if fault == "no_host_cost":
        import owner_reduce.runtime.handle as handle
        from owner_reduce.planning.flush_choice import FlushCost
        from owner_reduce.planning.host_cost import NONE

        handle.FlushCost = lambda *args, **kwargs: FlushCost(*args, **{**kwargs, "host": NONE})
        return
    import owner_reduce.runtime.flush as flush_module
    import owner_reduce.runtime.placement as placement_module

    original_layout = placement_module.plan_owner_layout
    original_step = placement_module.plan_step_layouts

    def broken_layout(*args: Any, **kwargs: Any) -> Any:
        return break_layout(original_layout(*args, **kwargs), fault, world_size)

    def broken_step(*args: Any, **kwargs: Any) -> Any:
        return break_step_layouts(original_step(*args, **kwargs), fault, world_size)

    placement_module.plan_owner_layout = broken_layout
    placement_module.plan_step_layouts = broken_step
    if fault in ("layout_off_by_one", "handoff_wrong_owner", "wrong_rail"):
        return
    original = flush_module.plan_flush

    def broken(entries: Any, owner_map: Any, reduce_to_owner: bool, **kwargs: Any) -> Any:
        plan = original(entries, owner_map, reduce_to_owner, **kwargs)
        ranges = list(plan.ranges)
        i = next((i for i, r in enumerate(ranges) if r.root is not None), None)
        if i is None:
            return plan
        if fault == "wrong_root":
            ranges[i] = FlushRange(ranges[i].offset, ranges[i].count, (ranges[i].root + 1) % world_size)
        else:
            del ranges[i]
        return dataclasses.replace(plan, ranges=tuple(ranges))

    flush_module.plan_flush = broken
