"""A warning on rank 0 for every owner_reduce key that cannot take effect, when DeepSpeed reads its config.

Why at config time (``DeepSpeedConfig._do_warning_check``, where DeepSpeed puts its own config warnings): it is
the one moment that sees the whole config, top-level keys included, whether or not ``engine.compile()`` ever
reaches DeepCompile, and it comes before anything stage 3 builds (whose native init fails on a machine without
CUDA headers with an unrelated error). Warnings, not errors: the job still trains correctly without the owner
path, and one config file is often shared across stages; the warning says which key and why (see
``planning.settings.inapplicable_settings``).
"""

from __future__ import annotations

from typing import Any

from ..planning.settings import inapplicable_settings, settings_of

_warned: set[str] = set()  # DeepSpeed reads one config more than once (ZeRO-3's zero.Init reads it again)


def warn_inapplicable_flags(ds_config: Any) -> tuple[str, ...]:
    """Log each reason on rank 0 through DeepSpeed's logger, once per process; return them (every rank)."""
    compile_config = ds_config.compile_config
    reasons = inapplicable_settings(ds_config._param_dict, settings_of(compile_config),
                                    bool(getattr(compile_config, "deepcompile", False)),
                                    int(ds_config.zero_optimization_stage))
    if reasons and getattr(ds_config, "global_rank", 0) == 0:
        from deepspeed.utils import logger

        for reason in reasons:
            if reason not in _warned:
                _warned.add(reason)
                logger.warning(reason)
    return reasons


def wrap_do_warning_check(original: Any) -> Any:
    """``DeepSpeedConfig._do_warning_check`` followed by owner_reduce's own check."""

    def _do_warning_check(self: Any) -> None:
        original(self)
        warn_inapplicable_flags(self)

    _do_warning_check.__wrapped__ = original  # type: ignore[attr-defined]
    return _do_warning_check
