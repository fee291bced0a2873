"""A check of the private DeepSpeed surface owner_reduce relies on, run before anything is patched.

Why: DeepCompile's Python surface moved several times in 2026. Finding out mid-training (an AttributeError
inside a backward graph, or a silently skipped reduction) is the worst outcome; refusing at install time
with the list of what moved is the best one.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# module -> names it must define (deepspeed 0.19.8)
REQUIRED_NAMES: dict[str, tuple[str, ...]] = {
    "deepspeed.runtime.config": ("CompileConfig", "DeepSpeedConfig"),
    "deepspeed.compile.util": ("get_deepcompile_handle", "dc_handle"),
    "deepspeed.compile.init_z1_and_2": ("init_z1_and_2",),
    "deepspeed.compile.passes.zero_1_and_2_compile": ("add_z1_reduce",),
    "deepspeed.compile.fx": ("add_end_backward", "replace_reduce_outputs_with_none"),
    "deepspeed.compile.backend": ("run_opt_passes", "get_accelerator", "make_backend", "init_schedule",
                                  "launch_compile_passes"),
    "deepspeed.compile.profilers.graph_profile": ("get_accelerator",),
    "deepspeed.runtime.engine": ("DeepSpeedEngine",),
}
ENGINE_METHODS = ("_initialize_deepcompile_native", "zero_reduce_bucket_size", "get_deepcompile_backend",
                  "zero_optimization_stage")
CONFIG_METHODS = ("_do_warning_check",)  # wrapped to warn about flags that cannot take effect
# Wrapped to keep the measured guard's verdicts with each checkpoint (``checkpoint``): the client state in, out.
CHECKPOINT_PARAMS = {"save_checkpoint": "client_state", "load_checkpoint": "load_dir"}
OPTIMIZER_RELINK = "_link_all_hp_params"  # ZeRO 1/2's re-link of the gradient fragments (``full_grad``)
INIT_Z1_PARAMS = ("engine", "backend", "compile_config", "compile_kwargs", "schedule", "use_z2")
PASS_PARAMS = ("gm", "graph_id", "graph_order", "profiling_results", "create_inputs_fn", "mem_budget",
               "param_manager", "bwd")
# The compile schedule (compile_pass.start_at_first_step): init_schedule replaces what launch_compile_passes pops.
SCHEDULE_PARAMS = {"init_schedule": ("schedule",), "launch_compile_passes": ("global_steps", "owned_frames")}


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def surface_problems() -> list[str]:
    """Everything that moved, as readable lines; empty when the surface is as expected."""
    problems: list[str] = []
    modules: dict[str, Any] = {}
    for module_name, names in REQUIRED_NAMES.items():
        try:
            modules[module_name] = module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - report any import failure by name
            problems.append(f"module {module_name} does not import ({type(e).__name__}: {e})")
            continue
        problems += [f"{module_name}.{name} is missing" for name in names if not hasattr(module, name)]
    if problems:
        return problems
    init_fn = modules["deepspeed.compile.init_z1_and_2"].init_z1_and_2
    init_fn = getattr(init_fn, "__wrapped__", init_fn)
    if _params(init_fn) != INIT_Z1_PARAMS:
        problems.append(f"init_z1_and_2{_params(init_fn)} is not init_z1_and_2{INIT_Z1_PARAMS}")
    pass_fn = modules["deepspeed.compile.passes.zero_1_and_2_compile"].add_z1_reduce
    if _params(pass_fn) != PASS_PARAMS:
        problems.append(f"add_z1_reduce{_params(pass_fn)} is not add_z1_reduce{PASS_PARAMS}")
    backend = modules["deepspeed.compile.backend"]
    for name, params in SCHEDULE_PARAMS.items():
        if _params(getattr(backend, name)) != params:
            problems.append(f"deepspeed.compile.backend.{name}{_params(getattr(backend, name))} is not {name}{params}")
    config_cls = modules["deepspeed.runtime.config"].DeepSpeedConfig
    problems += [f"DeepSpeedConfig.{m} is missing" for m in CONFIG_METHODS if m not in vars(config_cls)]
    engine_cls = modules["deepspeed.runtime.engine"].DeepSpeedEngine
    problems += [f"DeepSpeedEngine.{m} is missing" for m in ENGINE_METHODS if not hasattr(engine_cls, m)]
    for method, param in CHECKPOINT_PARAMS.items():
        fn = vars(engine_cls).get(method)
        fn = getattr(fn, "owner_reduce_original", fn)
        if fn is None or param not in _params(fn):
            problems.append(f"DeepSpeedEngine.{method} is missing or has no '{param}' parameter")
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except Exception as e:  # noqa: BLE001 - report any import failure by name
        problems.append(f"deepspeed.runtime.zero.stage_1_and_2 does not import ({type(e).__name__}: {e})")
    else:
        if not hasattr(DeepSpeedZeroOptimizer, OPTIMIZER_RELINK):
            problems.append(f"DeepSpeedZeroOptimizer.{OPTIMIZER_RELINK} is missing")
    return problems


def dc_schema_problems() -> list[str]:
    """Where an already loaded ``dc`` library's schemas differ from the ones owner_reduce expects."""
    import torch

    from .ops import DC_SCHEMAS

    if not hasattr(torch.ops.dc, "reduce_grad"):
        return []
    problems = []
    for name in ("reduce_grad", "end_backward"):
        op = getattr(torch.ops.dc, name, None)
        schema = str(op.default._schema) if op is not None else "<missing>"
        if schema.removeprefix("dc::") != DC_SCHEMAS[name]:
            problems.append(f"dc.{name} has schema {schema}, expected dc::{DC_SCHEMAS[name]}")
    return problems
