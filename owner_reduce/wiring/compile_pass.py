"""The stage-1/2 reduce passes with owner_reduce's ops: DeepCompile's own passes, their nodes retargeted.

Why retarget instead of re-implementing: ``add_z1_reduce`` decides where each ``reduce_grad`` goes, moves
primals, adds ``end_backward`` with the right ``release_reduce_buckets`` and nulls the reduce outputs; all of
that stays DeepCompile's. Only the two op targets change, so the graph runs the Python runtime.
Contract: runs in place of ``zero1_compile`` / ``zero2_compile``; conflicts with ``zero3_compile``.
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
