"""The stage-1/2 reduce passes with owner_reduce's ops: DeepCompile's own passes, their nodes retargeted; and the
compile schedule that launches them, started at the first step the engine actually runs.

Why retarget instead of re-implementing: ``add_z1_reduce`` decides where each ``reduce_grad`` goes, moves
primals, adds ``end_backward`` with the right ``release_reduce_buckets`` and nulls the reduce outputs; all of
that stays DeepCompile's. Only the two op targets change, so the graph runs the Python runtime.
Contract: runs in place of ``zero1_compile`` / ``zero2_compile``; conflicts with ``zero3_compile``.

Why the schedule is started where training starts: DeepCompile's forward calls ``launch_compile_passes(global_steps)``,
which launches a schedule entry only when ``global_steps`` equals its step; a run resumed by ``load_checkpoint`` in a
fresh process starts at the checkpoint's step (say 3), the default schedule's only entry is at step 0, no passes are
ever set, and the first forward fails in ``run_opt_passes`` (``TypeError: 'NoneType' object is not iterable``).
``start_at_first_step`` rebases the schedule, once, at the first launch: what an uninterrupted run has in force at
that step is launched there, and every later entry at its own step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from .ops import END_BACKWARD, REDUCE_GRAD

NAME = "owner_reduce_zero1"


def retarget(gm: GraphModule) -> int:
    """Point DeepCompile's reduce nodes at owner_reduce's ops; returns how many nodes changed."""
    targets = {torch.ops.dc.reduce_grad.default: REDUCE_GRAD, torch.ops.dc.end_backward.default: END_BACKWARD}
    changed = 0
    for node in gm.graph.nodes:
        new_target = targets.get(node.target) if node.op == "call_function" else None
        if new_target is not None:
            node.target = new_target
            changed += 1
    return changed


def _retargeted(native_pass_name: str, doc: str) -> Any:
    """DeepCompile's pass ``zero_1_and_2_compile.<native_pass_name>`` with its backward nodes retargeted."""

    def owner_pass(gm: GraphModule, graph_id: int, graph_order: Any, profiling_results: Any, create_inputs_fn: Any,
                   mem_budget: float, param_manager: Any, bwd: bool) -> GraphModule:
        from deepspeed.compile.passes import zero_1_and_2_compile

        native = getattr(zero_1_and_2_compile, native_pass_name)
        gm = native(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)
        if bwd:
            retarget(gm)
        return gm

    owner_pass.__name__ = owner_pass.__qualname__ = f"add_owner_{native_pass_name.removeprefix('add_')}"
    owner_pass.__doc__ = doc
    return owner_pass


# Same signature as DeepCompile's passes (``deepspeed.compile.backend.run_opt_passes`` calls them).
add_owner_z1_reduce = _retargeted("add_z1_reduce", "Stage 1: DeepCompile's ``add_z1_reduce``, retargeted.")
add_owner_z2_reduce = _retargeted("add_z2_reduce", "Stage 2: DeepCompile's ``add_z2_reduce`` (register_graph_z2), "
                                                   "retargeted.")


def owner_schedule(schedule: list | None, use_z2: bool = False) -> list:
    """DeepCompile's schedule with its stage-1/2 reduce pass replaced by ours (default: one pass at step 0)."""
    from deepspeed.compile.passes import zero_1_and_2_compile

    ours = {zero_1_and_2_compile.add_z1_reduce: add_owner_z1_reduce,
            zero_1_and_2_compile.add_z2_reduce: add_owner_z2_reduce}
    if schedule is None:
        return [(0, [add_owner_z2_reduce if use_z2 else add_owner_z1_reduce])]
    return [(step, [ours.get(p, p) for p in passes]) for step, passes in schedule]


def schedule_from(schedule: list, first_step: int) -> list:
    """``schedule`` ([(step, passes), ...], launched in order) as it stands when training starts at ``first_step``:
    the entry in force there (the last whose step is at or before it; the first entry if none is) launches at
    ``first_step``, every later entry at its own step. Unchanged when ``first_step`` is the first entry's step."""
    entries = list(schedule)
    if not entries:
        return entries
    current = entries.pop(0)
    while entries and entries[0][0] <= first_step:
        current = entries.pop(0)
    return [(first_step, current[1]), *entries]


def start_at_first_step(engine: Any, schedule: list) -> None:
    """Make the engine's first ``launch_compile_passes(global_steps)`` start ``schedule`` (the one just handed to
    DeepCompile's ``init_schedule``) at that step: rebase it there once, then hand the engine DeepCompile's own
    launcher back (no cost per step after the first)."""
    from deepspeed.compile import backend as dc_backend

    native = getattr(engine, "launch_compile_passes", None)
    if not callable(native):
        raise RuntimeError("owner_reduce: DeepCompile's init_z1_and_2 no longer sets engine.launch_compile_passes; "
                           "this DeepSpeed's compile schedule is not the one owner_reduce knows")

    def launch_compile_passes(global_steps: int) -> None:
        engine.launch_compile_passes = native
        dc_backend.init_schedule(schedule_from(schedule, int(global_steps)))
        native(global_steps)

    engine.launch_compile_passes = launch_compile_passes
