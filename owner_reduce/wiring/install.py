"""``install()`` / ``uninstall()``: teach DeepSpeed owner_reduce's config keys and the runtime, and take them back
exactly.

Why a factory in place of ``CompileConfig``: DeepSpeed builds its compile config with
``CompileConfig(**param_dict.get('compile', {}))`` inside ``deepspeed.runtime.config`` and the model forbids
unknown keys. Swapping that one module-level name lets owner_reduce's keys (``planning.settings``) through, validated
strictly, into a subclass whose fields carry them (so they appear in DeepSpeed's config dump at init and reach the
runtime), while a config that does not mention them still gets DeepSpeed's own class, built by DeepSpeed's own code:
keys absent, nothing changes. A key that cannot take effect is named in a warning when DeepSpeed reads the
config, or at the engine's first optimizer step where no compiled graph ran by then (see ``unused_flags``). Before
``install()``, a config with the keys fails naming ``install()`` (``install_guard``, armed at the package's import).
The runtime is wired in through ``deepspeed.compile.init_z1_and_2.init_z1_and_2`` (see ``activation``), which
likewise calls straight through when both flags are off.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import OwnerReduceInstallError, OwnerReduceInUseError
from ..planning.settings import SETTING_KEYS, parse_settings
from .install_guard import unguarded

_lock = threading.Lock()
_installed: dict[str, Any] = {}


def _check_surface() -> None:
    from .surface import dc_schema_problems, surface_problems

    problems = surface_problems()
    if not problems:
        import deepspeed.runtime.config as ds_config

        fields = getattr(unguarded(ds_config.CompileConfig), "model_fields", None)
        if fields is None or "deepcompile" not in fields:
            problems.append("deepspeed.runtime.config.CompileConfig is not a pydantic model with a 'deepcompile' field")
        problems += dc_schema_problems()
    if problems:
        raise OwnerReduceInstallError("owner_reduce: refusing to install, DeepSpeed's private surface is not the one "
                                      "it was built for (deepspeed 0.19.8): " + "; ".join(problems))


def _make_compile_config_factory(original: type) -> tuple[type, Any]:
    class OwnerReduceCompileConfig(original):  # type: ignore[misc, valid-type]
        """DeepSpeed's CompileConfig plus owner_reduce's keys (``planning.settings``)."""

        reduce_to_owner: bool = False
        """Reduce each single-owner gradient to the rank that keeps it (ncclReduce) instead of AllReduce."""

        reduce_probe: bool = False
        """Log one line per reduce-bucket flush (the first 20) with what it delivered and dropped; rank 0's."""

        reduce_probe_all_ranks: bool = False
        """The probe's lines from every rank, not rank 0's only."""

        reduce_to_owner_algo: str = "auto"
        """auto (the cost model's choice, then the measured guard), model (no guard), or a forced algorithm."""

        reduce_to_owner_calibration: str | None = None
        """A calibration file (scripts/calibrate.py): the cluster's call times in place of NCCL's tables."""

        reduce_to_owner_verdicts: str | None = None
        """The measured guard's verdicts: replayed where the file exists, written there where it does not."""

        reduce_to_owner_timeout_s: float | None = None
        """The flushes' deadline in seconds; null: the default process group's timeout."""

    def compile_config(**data: Any) -> Any:
        if not any(key in data for key in SETTING_KEYS):
            return original(**data)
        parse_settings(data)  # strict: raises OwnerReduceConfigError naming compile.<key>
        # The values as written (parse_settings accepts only exact JSON types, so they are already what they mean).
        return OwnerReduceCompileConfig(**data)

    compile_config.owner_reduce_original = original  # type: ignore[attr-defined]
    return OwnerReduceCompileConfig, compile_config


def warn_about_cupy(environ: dict[str, str] | None = None) -> str | None:
    """Log, once per node (``LOCAL_RANK`` 0 or unset), the installation message of ``cuda_extra`` when cupy does not
    fit torch's CUDA, and one for torch or DeepSpeed outside the tested ranges (``version_problems``: a
    ``--no-deps`` install); return the first (every rank). A check that fails is itself the message: it never stops
    install()."""
    from deepspeed.utils import logger

    from .cuda_extra import PREFIX, environment_problem, environment_version_problems

    try:
        problem = environment_problem()
    except Exception as error:  # noqa: BLE001 - an odd environment must not stop install()
        problem = f"{PREFIX}: could not compare cupy with torch's CUDA ({type(error).__name__}: {error})"
    try:
        versions = environment_version_problems()
    except Exception as error:  # noqa: BLE001 - likewise
        versions = [f"{PREFIX}: could not compare torch and DeepSpeed with the tested ranges ({error})"]
    if (os.environ if environ is None else environ).get("LOCAL_RANK", "0") == "0":
        for message in ([problem] if problem is not None else []) + versions:
            logger.warning(message)
    return problem


def is_installed() -> bool:
    return bool(_installed)


def install() -> None:
    """Make ``deepspeed.initialize`` accept owner_reduce's keys under ``compile`` (``planning.settings``). Idempotent.

    Also says, as a warning, when cupy does not fit torch's CUDA (missing, another CUDA major, two cupy wheels):
    ``warn_about_cupy``."""
    with _lock:
        if _installed:
            return
        _check_surface()
        import deepspeed.compile.init_z1_and_2 as init_module
        import deepspeed.runtime.config as ds_config
        from deepspeed.runtime.engine import DeepSpeedEngine

        from .activation import wrap_init_z1_and_2
        from .checkpoint import wrap_load_checkpoint, wrap_save_checkpoint
        from .unused_flags import wrap_do_warning_check, wrap_engine_init

        guarded = ds_config.CompileConfig  # the forgotten-install check's wrapper (``install_guard``), put back later
        original = unguarded(guarded)
        if (hasattr(original, "owner_reduce_original") or hasattr(init_module.init_z1_and_2, "__wrapped__")
                or hasattr(DeepSpeedEngine.save_checkpoint, "owner_reduce_original")
                or hasattr(DeepSpeedEngine.__init__, "owner_reduce_original")):
            raise OwnerReduceInstallError("owner_reduce: DeepSpeed is already patched by another copy of "
                                          "owner_reduce; uninstall that one first")
        config_cls, factory = _make_compile_config_factory(original)
        original_init = init_module.init_z1_and_2
        original_warning_check = ds_config.DeepSpeedConfig.__dict__["_do_warning_check"]
        original_save = DeepSpeedEngine.__dict__["save_checkpoint"]
        original_load = DeepSpeedEngine.__dict__["load_checkpoint"]
        original_engine_init = DeepSpeedEngine.__dict__["__init__"]
        ds_config.CompileConfig = factory
        init_module.init_z1_and_2 = wrap_init_z1_and_2(original_init)
        ds_config.DeepSpeedConfig._do_warning_check = wrap_do_warning_check(original_warning_check)
        DeepSpeedEngine.save_checkpoint = wrap_save_checkpoint(original_save)  # the measured guard's verdicts
        DeepSpeedEngine.load_checkpoint = wrap_load_checkpoint(original_load)
        DeepSpeedEngine.__init__ = wrap_engine_init(original_engine_init)  # the first step's check (``unused_flags``)
        _installed.update(compile_config=guarded, config_cls=config_cls, init_z1_and_2=original_init,
                          do_warning_check=original_warning_check, save_checkpoint=original_save,
                          load_checkpoint=original_load, engine_init=original_engine_init)
    warn_about_cupy()


def uninstall() -> None:
    """Restore every DeepSpeed name ``install()`` replaced. Idempotent.

    Refused (``OwnerReduceInUseError``, nothing changed) while an engine compiled with the flags is live: its
    compiled graphs still call owner_reduce's runtime, and on CPU DeepCompile needs the fixes ``install`` made
    (undoing them fails the engine's next forward with ``Invalid device string``). ``engine.destroy()`` first.
    """
    with _lock:
        if not _installed:
            return
        import deepspeed.compile.init_z1_and_2 as init_module
        import deepspeed.runtime.config as ds_config

        from . import cpu_compat
        from .ops import active_runtime_or_none, release_dc_schemas

        if active_runtime_or_none() is not None:
            raise OwnerReduceInUseError(
                "owner_reduce.uninstall(): refused, an engine compiled with compile.reduce_to_owner/reduce_probe "
                "is still live in this process and its compiled graphs use owner_reduce's runtime; call "
                "engine.destroy() first (owner_reduce stays installed, the engine keeps training)")

        from deepspeed.runtime.engine import DeepSpeedEngine

        ds_config.CompileConfig = _installed["compile_config"]
        init_module.init_z1_and_2 = _installed["init_z1_and_2"]
        ds_config.DeepSpeedConfig._do_warning_check = _installed["do_warning_check"]
        DeepSpeedEngine.save_checkpoint = _installed["save_checkpoint"]
        DeepSpeedEngine.load_checkpoint = _installed["load_checkpoint"]
        DeepSpeedEngine.__init__ = _installed["engine_init"]
        cpu_compat.restore()
        release_dc_schemas()
        _installed.clear()
