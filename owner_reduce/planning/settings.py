"""Every owner_reduce setting, from the DeepSpeed config's ``compile`` section, validated strictly; and the line that
says at init which of them are in effect.

Why the config and not the environment: DeepSpeed's multi-node launcher forwards almost no environment variables
(``launcher/runner.py``: only those starting with NCCL, PYTHON, UCX, MV2 or MLFLOW, and ``.deepspeed_env``), so a
setting there reaches no rank on another node, silently. The config travels with the job to every rank, is printed
in DeepSpeed's config dump at init and is kept in the ``ds_config`` of each checkpoint.

The keys, beside ``deepcompile`` (every error names ``compile.<key>``, with the value and its JSON type):

- ``reduce_to_owner`` (bool, false), ``reduce_probe`` (bool, false), ``reduce_probe_all_ranks`` (bool, false):
  ``planning.flags``.
- ``reduce_to_owner_algo`` (string, ``"auto"``): ``auto``, the cost model's choice per flush, then the measured guard
  (``planning.measured``); ``model``, the model's choice without the guard; ``reduce``, ``allreduce``, ``handoff``,
  ``native`` or ``two_level``: that algorithm forced wherever it applies, no guard.
- ``reduce_to_owner_calibration`` (string path or null): a cluster's measured call times (``planning.calibration``,
  written by ``scripts/calibrate.py``) in place of NCCL's tables.
- ``reduce_to_owner_verdicts`` (string path or null): the measured guard's verdicts (``planning.verdict_book``):
  replayed where the file exists, written there after each trial where it does not yet.
- ``reduce_to_owner_timeout_s`` (positive number or null): the flushes' deadline in seconds (``runtime.deadline``);
  null, the default, is the default process group's timeout (``deepspeed.init_distributed(timeout=...)``).

``settings_line`` also says what the run runs on: the transport (``transport_text``: cupy's NCCL against torch's,
``nccl_mismatch`` where their major.minor differ), the world and its nodes, the bucket, the package's version.

The files are read later, on every rank, when the runtime starts (``planning.rank_inputs``), and agreed there: a file
one rank cannot read must make every rank refuse together, not one rank raise alone at ``deepspeed.initialize``.
Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import OwnerReduceConfigError
from .algorithms import forceable
from .flags import (
    BOOL_KEYS,
    FLAG_KEYS,
    PROBE_ALL_RANKS,
    REDUCE_PROBE,
    REDUCE_TO_OWNER,
    SECTION,
    OwnerReduceFlags,
    parse_flags,
)
from .flush_choice import AUTO

ALGO = "reduce_to_owner_algo"
CALIBRATION = "reduce_to_owner_calibration"
VERDICTS = "reduce_to_owner_verdicts"
TIMEOUT = "reduce_to_owner_timeout_s"
SETTING_KEYS: tuple[str, ...] = (*BOOL_KEYS, ALGO, CALIBRATION, VERDICTS, TIMEOUT)  # every key owner_reduce adds
PATH_KEYS: tuple[str, ...] = (CALIBRATION, VERDICTS)

MODEL = "model"  # the model's choice without the measured guard
ALGO_VALUES: tuple[str, ...] = (AUTO, MODEL, *forceable())  # the registry's, as it stands at import


def key_name(key: str) -> str:
    """``compile.<key>``: how every message names a key."""
    return f"{SECTION}.{key}"


@dataclass(frozen=True)
class OwnerReduceSettings:
    """Every setting of the ``compile`` section, the boolean flags among them (``flags``); the defaults are what a
    config without the key means. The one object that travels from the config to the runtime (Note (one reading of
    the config) in ``settings_of``): what the runtime has beside it is not configuration (the owner map, the files
    read, the problems found on a rank)."""

    flags: OwnerReduceFlags = OwnerReduceFlags()
    algo: str = AUTO
    calibration: str | None = None  # a path, read on every rank when the runtime starts
    verdicts: str | None = None  # a path: replayed where the file exists, written where it does not
    timeout_s: float | None = None  # the flushes' deadline; None: the default process group's timeout

    @property
    def flush_algo(self) -> str:
        """The runtime's forced candidate (``planning.flush_choice.force_values()``): ``auto`` for ``auto`` and
        ``model`` (the model chooses), else the forced algorithm."""
        return AUTO if self.algo in (AUTO, MODEL) else self.algo

    @property
    def measure(self) -> bool:
        """Whether the measured guard may run (it never runs under a forced algorithm, whatever this says)."""
        return self.algo != MODEL

    def config_values(self) -> dict[str, Any]:
        """The values of every key, as the ``CompileConfig`` fields carry them."""
        return {**self.flags.as_dict(), ALGO: self.algo, CALIBRATION: self.calibration, VERDICTS: self.verdicts,
                TIMEOUT: self.timeout_s}

    def keys_set(self) -> tuple[str, ...]:
        """The keys whose value is not their default, in ``SETTING_KEYS`` order."""
        default = OwnerReduceSettings().config_values()
        values = self.config_values()
        return tuple(key for key in SETTING_KEYS if values[key] != default[key])


def _check_algo(value: Any) -> str:
    if type(value) is not str or value not in ALGO_VALUES:
        allowed = ", ".join(f'"{v}"' for v in ALGO_VALUES)
        raise OwnerReduceConfigError(f"DeepSpeed config: {key_name(ALGO)} must be one of {allowed}, "
                                     f"got {value!r} ({type(value).__name__})")
    return value


def _check_path(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        raise OwnerReduceConfigError(f"DeepSpeed config: {key_name(key)} must be a file path (a JSON string) or null, "
                                     f"got {value!r} ({type(value).__name__})")
    if not value.strip():
        raise OwnerReduceConfigError(f"DeepSpeed config: {key_name(key)} must be a file path or null, got an empty "
                                     f"string {value!r}")
    return value


def _check_timeout(value: Any) -> float | None:
    """Seconds, a JSON number greater than 0 and finite (``true`` is no number here), or null (the default)."""
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value < math.inf:
        raise OwnerReduceConfigError(f"DeepSpeed config: {key_name(TIMEOUT)} must be a positive number of seconds or "
                                     f"null, got {value!r} ({type(value).__name__})")
    return float(value)


def parse_settings(compile_section: Mapping[str, Any] | None) -> OwnerReduceSettings:
    """Read every setting from a raw ``compile`` dict; absent keys take their defaults; a bad value raises
    ``OwnerReduceConfigError`` naming ``compile.<key>``."""
    flags = parse_flags(compile_section)  # also checks that the section is a mapping
    section = compile_section or {}
    return OwnerReduceSettings(
        flags=flags,
        algo=_check_algo(section[ALGO]) if ALGO in section else AUTO,
        calibration=_check_path(CALIBRATION, section.get(CALIBRATION)),
        verdicts=_check_path(VERDICTS, section.get(VERDICTS)),
        timeout_s=_check_timeout(section.get(TIMEOUT)))


def settings_of(compile_config: Any) -> OwnerReduceSettings:
    """The settings a built ``CompileConfig`` carries (DeepSpeed's own class carries none: the defaults).

    Note (one reading of the config): this is the one place that reads owner_reduce's keys from DeepSpeed's installed
    ``CompileConfig`` (``wiring.install`` validated them when DeepSpeed built it, with ``parse_settings``); what it
    returns is what travels to the runtime (``wiring.activation`` -> ``runtime.handle``) and to the config-time
    warnings (``wiring.unused_flags``)."""
    flags = OwnerReduceFlags(**{key: bool(getattr(compile_config, key, False)) for key in BOOL_KEYS})
    return OwnerReduceSettings(flags=flags, algo=getattr(compile_config, ALGO, AUTO) or AUTO,
                               calibration=getattr(compile_config, CALIBRATION, None),
                               verdicts=getattr(compile_config, VERDICTS, None),
                               timeout_s=getattr(compile_config, TIMEOUT, None))


def _listed(keys: list[str]) -> str:
    names = [key_name(k) for k in keys]
    text = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{text} {'has' if len(names) == 1 else 'have'}"


def inapplicable_settings(top_level: Mapping[str, Any], settings: OwnerReduceSettings, deepcompile: bool,
                          zero_stage: int) -> tuple[str, ...]:
    """Why each key the user wrote cannot take effect, one sentence per cause (empty when all can).

    Why: a key that silently does nothing is worse than no key; the user believes it is in effect. ``top_level`` is
    the whole DeepSpeed config (DeepSpeed ignores unknown top-level keys); ``settings``, ``deepcompile`` and
    ``zero_stage`` are what DeepSpeed parsed from it.
    """
    reasons = [f"owner_reduce: '{key}' at the top level of the DeepSpeed config has no effect (DeepSpeed ignores "
               f"unknown top-level keys); it belongs under 'compile': {key_name(key)}"
               for key in SETTING_KEYS if key in top_level]
    keys_set = list(settings.keys_set())
    if not keys_set:
        return tuple(reasons)
    if not deepcompile:
        return (*reasons, f"owner_reduce: {_listed(keys_set)} no effect: {SECTION}.deepcompile is false, so "
                          "DeepCompile does not run and ZeRO reduces through its own hooks (set compile.deepcompile "
                          "true and call engine.compile())")
    if zero_stage == 0:
        return (*reasons, f"owner_reduce: {_listed(keys_set)} no effect: zero_optimization.stage is 0, where "
                          "DeepCompile falls back to the torch compiler and no gradient has one owner (use ZeRO stage "
                          "1 or 2)")
    if zero_stage == 3:
        return (*reasons, f"owner_reduce: {_listed(keys_set)} no effect: zero_optimization.stage is 3, where "
                          "DeepCompile runs its own native stage-3 runtime (owner_reduce supports ZeRO stages 1 and "
                          "2)")
    flags = settings.flags
    if settings.timeout_s is not None and not flags.any_on:
        reasons.append(f"owner_reduce: {_listed([TIMEOUT])} no effect: {key_name(REDUCE_TO_OWNER)} and "
                       f"{key_name(REDUCE_PROBE)} are false, so owner_reduce's runtime does not run")
    if flags.reduce_probe_all_ranks and not flags.reduce_probe:
        reasons.append(f"owner_reduce: {_listed([PROBE_ALL_RANKS])} no effect: {key_name(REDUCE_PROBE)} is false, so "
                       "no rank prints probe lines")
    owner_only = [k for k in keys_set if k in (ALGO, CALIBRATION, VERDICTS)]
    if owner_only and not flags.reduce_to_owner:
        reasons.append(f"owner_reduce: {_listed(owner_only)} no effect: {key_name(REDUCE_TO_OWNER)} is false, so "
                       "every flush is one AllReduce, as DeepCompile does")
    elif settings.verdicts is not None and settings.algo != AUTO:
        reasons.append(f"owner_reduce: {_listed([VERDICTS])} no effect: {key_name(ALGO)} is \"{settings.algo}\", and "
                       f"the measured guard, whose verdicts it keeps, runs only under \"{AUTO}\"")
    return tuple(reasons)


def uncompiled_settings(settings: OwnerReduceSettings, compiled: bool) -> str | None:
    """Why the flags had no effect, when an engine whose config lets them take effect reaches its first optimizer
    step with no compiled graph through owner_reduce's runtime (``compiled``: ``engine.compile()`` started the runtime,
    yet no graph reduced through it); None where no flag is on. Why at that step: DeepSpeed trains a script that never
    calls ``engine.compile()`` (or the Trainer without ``--torch_compile``) through ZeRO's own hooks, and says so only
    at INFO, which its default level hides."""
    if not settings.flags.any_on:
        return None
    keys = _listed(list(settings.keys_set()))
    if not compiled:
        return (f"owner_reduce: {keys} no effect until engine.compile() runs: this engine reached its first optimizer "
                "step uncompiled, so ZeRO reduced through its own hooks (call engine.compile() after "
                "deepspeed.initialize; the Hugging Face Trainer: --torch_compile)")
    return (f"owner_reduce: {keys} no effect: engine.compile() ran, yet by the first optimizer step no compiled graph "
            "had reduced a gradient through DeepCompile (give the model its own forward: a bare nn.Sequential "
            "compiles into no graph)")


def forgotten_install_message(keys: list[str]) -> str:
    """The error for a DeepSpeed config carrying owner_reduce's keys in a process where ``owner_reduce.install()``
    has not run (``wiring.install_guard``): in place of pydantic's "Extra inputs are not permitted"."""
    names = ", ".join(key_name(k) for k in keys)
    return (f"DeepSpeed config: {names} {'is' if len(keys) == 1 else 'are'} owner_reduce's, and owner_reduce.install() "
            "has not run in this process, so DeepSpeed does not know "
            f"{'it' if len(keys) == 1 else 'them'}: call owner_reduce.install() before deepspeed.initialize, in "
            "every process, or start the script with python -m owner_reduce.run")


NcclVersion = tuple[int, int, int]


def nccl_version_of_code(code: int) -> NcclVersion:
    """NCCL's ``ncclGetVersion`` code as (major, minor, patch): ``major * 10000 + minor * 100 + patch`` since 2.9,
    ``major * 1000 + minor * 100 + patch`` before."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def transport_text(comm: str, backend: str | None, cupy_nccl: NcclVersion | None, torch_nccl: NcclVersion | None
                   ) -> str:
    """How the flushes move bytes, for the settings line: ``cupy NCCL 2.27.7 (torch's 2.27.5)``, ``torch.distributed
    nccl (NCCL 2.27.5)``, ``torch.distributed gloo``; ``comm`` is the communicator's name (``cupy-nccl``,
    ``torch.distributed``, a test's own)."""
    def v(version: NcclVersion) -> str:
        return ".".join(map(str, version))

    if comm == "cupy-nccl":
        return f"cupy NCCL {v(cupy_nccl) if cupy_nccl else 'unknown'}" + (
            f" (torch's {v(torch_nccl)})" if torch_nccl else "")
    if comm == "torch.distributed":
        nccl = f" (NCCL {v(torch_nccl)})" if backend and "nccl" in backend and torch_nccl else ""
        return f"torch.distributed {backend or 'unknown backend'}{nccl}"
    return comm


def nccl_mismatch(cupy_nccl: NcclVersion | None, torch_nccl: NcclVersion | None) -> str | None:
    """The warning where cupy's NCCL and torch's differ in major.minor (both known), else None."""
    if cupy_nccl is None or torch_nccl is None or cupy_nccl[:2] == torch_nccl[:2]:
        return None
    ours, torchs = ".".join(map(str, cupy_nccl)), ".".join(map(str, torch_nccl))
    return (f"owner_reduce: cupy loaded NCCL {ours} but torch uses NCCL {torchs} (their major.minor differ): the "
            f"flushes run on cupy's, DeepSpeed's own collectives on torch's, so the two may differ in protocols, "
            f"tuning and fixes; install the NCCL wheel torch was built with")


@dataclass(frozen=True)
class RunSetup:
    """What the settings line says about the run beside the settings: how the flushes move bytes
    (``transport_text``), the world, the nodes (``planning.nodes.NodeLayout.describe``), the bucket, the package."""

    transport: str
    world_size: int
    nodes: str
    bucket_elems: int
    version: str


def settings_line(settings: OwnerReduceSettings, *, calibration_digest: str | None, verdicts: str,
                  timeout_s: float, timeout_source: str, setup: RunSetup) -> str:
    """What rank 0 logs once at init, after the init line: the settings in effect, then what the run runs on, e.g.
    ``owner_reduce: settings: algo=auto, calibration none, verdicts none, probe rank 0, timeout 1800 s
    (init_distributed); cupy NCCL 2.27.7 (torch's 2.27.5), 512 ranks = 64 nodes x 8 (host names = LOCAL_WORLD_SIZE),
    bucket 500000000 elements, owner_reduce 0.1.0``. ``verdicts``: ``none``, ``replay <digest> (N schedules)`` or
    ``write <path>``; ``timeout_source``: where the flushes' deadline came from (``init_distributed``, ``torch
    default`` or ``compile.reduce_to_owner_timeout_s``)."""
    flags = settings.flags
    probe = ("off" if not flags.reduce_probe else "all ranks" if flags.reduce_probe_all_ranks else "rank 0")
    owner = (f"algo={settings.algo}, calibration {calibration_digest or 'none'}, verdicts {verdicts}"
             if flags.reduce_to_owner else "owner path off (every flush AllReduces)")
    return (f"owner_reduce: settings: {owner}, probe {probe}, timeout {timeout_s:g} s ({timeout_source}); "
            f"{setup.transport}, {setup.world_size} rank{'s' if setup.world_size != 1 else ''} = {setup.nodes}, "
            f"bucket {setup.bucket_elems} elements, owner_reduce {setup.version}")


__all__ = ["ALGO", "ALGO_VALUES", "AUTO", "CALIBRATION", "FLAG_KEYS", "MODEL", "PATH_KEYS", "SETTING_KEYS",
           "TIMEOUT", "VERDICTS", "OwnerReduceSettings", "RunSetup", "forgotten_install_message",
           "inapplicable_settings", "key_name", "nccl_mismatch", "nccl_version_of_code", "parse_settings",
           "settings_line", "settings_of", "transport_text", "uncompiled_settings"]
