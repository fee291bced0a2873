"""Wiring the Python runtime into one DeepCompile engine, at the moment DeepCompile initializes stage 1/2.

Why at ``init_z1_and_2`` (DeepCompile's entry for ZeRO stages 1 and 2; stage 3 has its own, left untouched): it
is the one call that sees the engine (for the owner map and the process group), the compile config (for the
flags) and the pass schedule, and it runs before DeepCompile asks for its handle.
With both flags off this module does nothing at all and DeepCompile's own function runs.
"""

from __future__ import annotations

import os
from typing import Any

from ..planning.env_inputs import EnvInputs, read_environment
from ..planning.flags import flags_of
from ..planning.flush_choice import AUTO, FORCE_ENV_VAR
from ..runtime.comm import ReduceComm
from ..runtime.handle import OwnerReduceRuntime, RuntimeSettings
from . import cpu_compat
from .checkpoint import RUNTIME_ATTR, hand_pending_verdicts
from .compile_pass import owner_schedule, start_at_first_step
from .full_grad import keep_live_gradients
from .ops import ensure_dc_schemas, register_inductor_lowerings, release_dc_schemas, set_active_runtime
from .unreduced_params import hide_unoptimized_params, optimized_param_ids


def make_comm(process_group: Any) -> ReduceComm:
    """The communicator for the data-parallel group: cupy NCCL where every rank can build it, else
    torch.distributed (gloo on CPU), chosen alike on every rank (see ``comm_select``)."""
    from ..runtime.comm_select import select_comm

    return select_comm(process_group)


def environment_inputs(flags: Any, global_rank: int, environ: Any = None) -> EnvInputs:
    """Every ``OWNER_REDUCE_*`` variable the runtime reads (``planning.env_inputs``): a bad value never raises here, on
    this rank alone; init's agreement refuses it on every rank together. A forced algorithm that cannot take effect
    (the owner path is off) is named in a warning on rank 0."""
    inputs = read_environment(os.environ if environ is None else environ, reduce_to_owner=flags.reduce_to_owner)
    if inputs.flush_algo != AUTO and not flags.reduce_to_owner and global_rank == 0:
        from deepspeed.utils import logger

        logger.warning(f"owner_reduce: {FORCE_ENV_VAR}={inputs.flush_algo} has no effect: compile.reduce_to_owner is "
                       "false, so every flush is one AllReduce, as DeepCompile does")
    return inputs


def build_runtime(engine: Any, flags: Any) -> OwnerReduceRuntime:
    from .engine_tables import build_owner_map, disagreements_with_optimizer

    inputs = environment_inputs(flags, int(getattr(engine, "global_rank", 0)))
    owner_map = build_owner_map(engine)
    problems = tuple(disagreements_with_optimizer(owner_map, engine))
    return OwnerReduceRuntime(RuntimeSettings(flags=flags, owner_map=owner_map, map_problems=problems,
                                              flush_algo=inputs.flush_algo, measure=inputs.measure,
                                              calibration=inputs.calibration, verdicts=inputs.verdicts,
                                              verdicts_path=inputs.verdicts_path, env_problems=inputs.problems),
                              make_comm)


def wrap_init_z1_and_2(original: Any) -> Any:
    """DeepCompile's ``init_z1_and_2`` with the owner runtime put in place when a flag is on (stages 1 and 2)."""

    def init_z1_and_2(engine: Any, backend: Any, compile_config: Any, compile_kwargs: Any, schedule: Any = None,
                      use_z2: bool = False) -> Any:
        flags = flags_of(compile_config)
        if not flags.any_on:
            return original(engine, backend, compile_config, compile_kwargs, schedule, use_z2)

        import deepspeed.compile.util as dc_util

        from .ops import active_runtime_or_none

        if active_runtime_or_none() is not None:
            # DeepCompile drives one process-wide handle (start_backward, reduce_grad by graph): two live engines
            # on it would steal each other's calls, natively as here.
            raise RuntimeError("owner_reduce: another DeepCompile engine with reduce_to_owner/reduce_probe is live in "
                               "this process; destroy it (engine.destroy()) before compiling a second one")
        if cpu_compat.is_cpu_accelerator():
            cpu_compat.apply()
        defined_schemas = ensure_dc_schemas()
        register_inductor_lowerings()
        runtime = build_runtime(engine, flags)
        previous_handle = dc_util.dc_handle
        hooks_before = list(dc_util.pre_backward_hooks)

        def release() -> None:
            # Note (handle lifetime): the engine calls cleanup() when DeepCompile is deactivated; from then on
            # get_deepcompile_handle() returns what it returned before, DeepCompile's pre-backward hooks of this
            # engine are gone (DeepSpeed never removes them), and the dc schemas owner_reduce defined are too,
            # so that a later engine can load DeepCompile's native extension.
            if dc_util.dc_handle is runtime:
                dc_util.dc_handle = previous_handle
            if engine.__dict__.get(RUNTIME_ATTR) is runtime:
                del engine.__dict__[RUNTIME_ATTR]
            dc_util.pre_backward_hooks[:] = [h for h in dc_util.pre_backward_hooks if h not in added_hooks]
            if active_runtime_or_none() is runtime:
                set_active_runtime(None)
            if defined_schemas:
                release_dc_schemas()

        runtime.on_cleanup = release
        dc_util.dc_handle = runtime
        set_active_runtime(runtime)
        added_hooks: list[Any] = []
        passes = owner_schedule(schedule, use_z2)
        try:
            backend_fn = original(engine, backend, compile_config, compile_kwargs, passes, use_z2)
            start_at_first_step(engine, passes)  # a run resumed from a checkpoint starts at its step, not at 0
        except BaseException:
            added_hooks[:] = [h for h in dc_util.pre_backward_hooks if h not in hooks_before]
            if runtime.comm is None:  # init never completed, so DeepSpeed will not call cleanup(): release here
                release()
            raise
        added_hooks[:] = [h for h in dc_util.pre_backward_hooks if h not in hooks_before]
        optimizer = engine.optimizer
        keep_live_gradients(optimizer, lambda: (p for group in optimizer.bit16_groups for p in group))
        if runtime.comm is not None:  # the checkpoint's verdicts (``checkpoint``): now, and at every later load
            setattr(engine, RUNTIME_ATTR, runtime)
            hand_pending_verdicts(engine, runtime)
        # Frozen and zero-element parameters are outside ZeRO's groups: DeepCompile sees them as plain inputs.
        return hide_unoptimized_params(backend_fn, optimized_param_ids(engine.optimizer.bit16_groups))

    init_z1_and_2.__wrapped__ = original  # type: ignore[attr-defined]
    return init_z1_and_2
