"""Wiring the Python runtime into one DeepCompile engine, at the moment DeepCompile initializes stage 1/2.

Why at ``init_z1_and_2`` (DeepCompile's entry for ZeRO stages 1 and 2; stage 3 has its own, left untouched): it
is the one call that sees the engine (for the owner map and the process group), the compile config (for the
flags) and the pass schedule, and it runs before DeepCompile asks for its handle.
With both flags off this module does nothing at all and DeepCompile's own function runs.
"""

from __future__ import annotations

from typing import Any

from . import cpu_compat
from .comm import ReduceComm
from .compile_pass import owner_schedule
from .flags import flags_of
from .ops import ensure_dc_schemas, register_inductor_lowerings, set_active_runtime
from .runtime import RuntimeSettings, Z1PythonRuntime


def make_comm(process_group: Any) -> ReduceComm:
    """The communicator for the data-parallel group: cupy NCCL where every rank can build it, else
    torch.distributed (gloo on CPU), chosen alike on every rank (see ``comm_select``)."""
    from .comm_select import select_comm

    return select_comm(process_group)


def build_runtime(engine: Any, flags: Any) -> Z1PythonRuntime:
    from .engine_tables import build_owner_map, disagreements_with_optimizer

    owner_map = build_owner_map(engine)
    problems = tuple(disagreements_with_optimizer(owner_map, engine))
    return Z1PythonRuntime(RuntimeSettings(flags=flags, owner_map=owner_map, map_problems=problems), make_comm)


def wrap_init_z1_and_2(original: Any) -> Any:
    """DeepCompile's ``init_z1_and_2`` with the owner runtime put in place when a flag is on (stages 1 and 2)."""

    def init_z1_and_2(engine: Any, backend: Any, compile_config: Any, compile_kwargs: Any, schedule: Any = None,
                      use_z2: bool = False) -> Any:
        flags = flags_of(compile_config)
        if not flags.any_on:
            return original(engine, backend, compile_config, compile_kwargs, schedule, use_z2)

        import deepspeed.compile.util as dc_util

        if cpu_compat.is_cpu_accelerator():
            cpu_compat.apply()
        ensure_dc_schemas()
        register_inductor_lowerings()
        runtime = build_runtime(engine, flags)
        previous_handle = dc_util.dc_handle

        def release() -> None:
            # Note (handle lifetime): the engine calls cleanup() when DeepCompile is deactivated; from then on
            # get_deepcompile_handle() returns whatever it returned before this engine compiled.
            if dc_util.dc_handle is runtime:
                dc_util.dc_handle = previous_handle
            set_active_runtime(None)

        runtime.on_cleanup = release
        dc_util.dc_handle = runtime
        set_active_runtime(runtime)
        try:
            return original(engine, backend, compile_config, compile_kwargs, owner_schedule(schedule, use_z2), use_z2)
        except BaseException:
            release()
            raise

    init_z1_and_2.__wrapped__ = original  # type: ignore[attr-defined]
    return init_z1_and_2
