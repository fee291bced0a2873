"""Wiring the Python runtime into one DeepCompile engine, at the moment DeepCompile initializes stage 1/2.

Why at ``init_z1_and_2`` (DeepCompile's entry for ZeRO stages 1 and 2; stage 3 has its own, left untouched): it
is the one call that sees the engine (for the owner map and the process group), the compile config (for the
settings, ``planning.settings``) and the pass schedule, and it runs before DeepCompile asks for its handle.
With both flags off this module does nothing at all and DeepCompile's own function runs.
"""

from __future__ import annotations

import os
from typing import Any

from ..planning.rank_inputs import RankInputs, read_inputs, removed_variables_set
from ..planning.settings import OwnerReduceSettings, settings_of
from ..runtime.comm import ReduceComm
from ..runtime.handle import OwnerReduceRuntime
from ..runtime.monitor import MonitorSink
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


_warned: set[str] = set()  # each environment warning once per process (a process may compile several engines)


def _warn_once(message: str) -> None:
    if message not in _warned:
        from deepspeed.utils import logger

        _warned.add(message)
        logger.warning(message)


def rank_inputs(settings: OwnerReduceSettings, global_rank: int, environ: Any = None) -> RankInputs:
    """The files the settings name, read on this rank (``planning.rank_inputs``): a bad value never raises here, on
    this rank alone; init's agreement refuses it on every rank together. On rank 0, a warning for each variable that
    is set but no longer read."""
    env = os.environ if environ is None else environ
    inputs = read_inputs(settings, env)
    if global_rank == 0:
        for message in removed_variables_set(env):
            _warn_once(message)
    return inputs


def build_runtime(engine: Any, settings: OwnerReduceSettings) -> OwnerReduceRuntime:
    from .engine_tables import build_owner_map, disagreements_with_optimizer

    inputs = rank_inputs(settings, int(getattr(engine, "global_rank", 0)))
    owner_map = build_owner_map(engine)
    problems = tuple(disagreements_with_optimizer(owner_map, engine))
    runtime = OwnerReduceRuntime(settings, owner_map, make_comm, inputs=inputs, map_problems=problems)
    runtime.monitor = monitor_sink(engine)
    return runtime


def monitor_sink(engine: Any) -> MonitorSink | None:
    """The engine's monitor for the runtime (``runtime.monitor``), where the DeepSpeed config enables one (TensorBoard,
    wandb, CSV or comet) and prints every ``steps_per_print`` steps; None otherwise. On every rank alike (the config
    is): every rank joins the measured steps' exchange, rank 0 writes. Events are written at DeepSpeed's own step
    axis: the global sample count at the end of the step (``step()`` adds the train batch size after the backward)."""
    monitor = getattr(engine, "monitor", None)
    every = int(engine.steps_per_print() or 0) if monitor is not None and monitor.enabled else 0
    if every <= 0:
        return None
    return MonitorSink(write=monitor.write_events, every=every, steps_done=lambda: int(engine.global_steps),
                       x=lambda: int(engine.global_samples) + int(engine.train_batch_size()))


def wrap_init_z1_and_2(original: Any) -> Any:
    """DeepCompile's ``init_z1_and_2`` with the owner runtime put in place when a flag is on (stages 1 and 2)."""

    def init_z1_and_2(engine: Any, backend: Any, compile_config: Any, compile_kwargs: Any, schedule: Any = None,
                      use_z2: bool = False) -> Any:
        settings = settings_of(compile_config)  # the one reading of owner_reduce's keys: it travels to the runtime
        if not settings.flags.any_on:
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
        runtime = build_runtime(engine, settings)
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
