"""A warning on rank 0 for every owner_reduce key that cannot take effect, when DeepSpeed reads its config.

Why at config time (``DeepSpeedConfig._do_warning_check``, where DeepSpeed puts its own config warnings): it is
the one moment that sees the whole config, top-level keys included, whether or not ``engine.compile()`` ever
reaches DeepCompile, and it comes before anything stage 3 builds (whose native init fails on a machine without
CUDA headers with an unrelated error). Warnings, not errors: the job still trains correctly without the owner
path, and one config file is often shared across stages; the warning says which key and why (see
``planning.settings.inapplicable_settings``).

A config that lets the flags take effect still needs ``engine.compile()``: without it DeepSpeed trains through ZeRO's
own hooks and says so only at INFO. That is known only later, at the engine's first optimizer step, where one check
says it on rank 0 (``arm_first_step_check``).
"""

from __future__ import annotations

import functools
from typing import Any

from ..planning.settings import inapplicable_settings, settings_of, uncompiled_settings
from .checkpoint import RUNTIME_ATTR

_warned: set[str] = set()  # DeepSpeed reads one config more than once (ZeRO-3's zero.Init reads it again)


def _warn_on_rank_0(reasons: tuple[str, ...], global_rank: int) -> None:
    if reasons and global_rank == 0:
        from deepspeed.utils import logger

        for reason in reasons:
            if reason not in _warned:
                _warned.add(reason)
                logger.warning(reason)


def warn_inapplicable_flags(ds_config: Any) -> tuple[str, ...]:
    """Log each reason on rank 0 through DeepSpeed's logger, once per process; return them (every rank)."""
    compile_config = ds_config.compile_config
    reasons = inapplicable_settings(ds_config._param_dict, settings_of(compile_config),
                                    bool(getattr(compile_config, "deepcompile", False)),
                                    int(ds_config.zero_optimization_stage))
    _warn_on_rank_0(reasons, getattr(ds_config, "global_rank", 0))
    return reasons


def first_step_problem(engine: Any) -> str | None:
    """Why the flags had no effect by this engine's first optimizer step, or None: no runtime was started
    (``engine.compile()`` never ran), or one was and no compiled graph reached it (profiling runs count)."""
    runtime = engine.__dict__.get(RUNTIME_ATTR)
    if runtime is not None and runtime.stats.reduce_grad_calls + runtime.stats.profiling_calls > 0:
        return None
    return uncompiled_settings(settings_of(engine._config.compile_config), compiled=runtime is not None)


def arm_first_step_check(engine: Any) -> bool:
    """Where the engine's config lets a flag take effect (DeepCompile on, ZeRO stage 1 or 2: the cases the config
    check passes in silence), make its first ``step()`` say, on rank 0, when no compiled graph ran through
    owner_reduce's runtime (``first_step_problem``); whether it was armed.

    Note (no per-step cost): the check is the engine's own attribute ``step``, which its first call removes before
    anything else; every later ``engine.step()`` finds DeepSpeed's method on the class, as without owner_reduce.
    """
    config = getattr(engine, "_config", None)
    compile_config = getattr(config, "compile_config", None)
    if (compile_config is None or not settings_of(compile_config).flags.any_on
            or not getattr(compile_config, "deepcompile", False) or int(config.zero_optimization_stage) not in (1, 2)):
        return False

    def step(*args: Any, **kwargs: Any) -> Any:
        engine.__dict__.pop("step", None)
        problem = first_step_problem(engine)
        if problem is not None:
            _warn_on_rank_0((problem,), int(getattr(engine, "global_rank", 0)))
        return engine.step(*args, **kwargs)

    engine.__dict__["step"] = step  # past nn.Module.__setattr__: a plain instance attribute
    return True


def wrap_engine_init(original: Any) -> Any:
    """``DeepSpeedEngine.__init__`` followed by ``arm_first_step_check`` (once per engine, never per step)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        arm_first_step_check(self)

    __init__.owner_reduce_original = original  # type: ignore[attr-defined]
    return __init__


def wrap_do_warning_check(original: Any) -> Any:
    """``DeepSpeedConfig._do_warning_check`` followed by owner_reduce's own check."""

    def _do_warning_check(self: Any) -> None:
        original(self)
        warn_inapplicable_flags(self)

    _do_warning_check.__wrapped__ = original  # type: ignore[attr-defined]
    return _do_warning_check
