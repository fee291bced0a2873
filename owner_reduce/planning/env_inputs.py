"""Every environment variable the runtime reads, read in one place, each failure kept as a reason instead of raised.

Why not raise: each rank reads its own environment and its own files. A rank that raised here alone (a calibration
file its node cannot read, a typo in one rank's launcher line) would leave every other rank waiting for it in the
first collective of init, on DeepSpeed's group, for DeepSpeed's timeout, never learning why. So each variable that
fails is kept as (variable, reason) with the default in its place; the runtime's init-time agreement gathers every
rank's reasons within the package's deadline and every rank refuses together, naming the ranks, the variable and the
reason (``runtime.handle``). What may differ across ranks without failing here (another calibration, another forced
algorithm) is compared there too.
Pure: a mapping in, values and reasons out (the named files are read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import verdict_book
from .calibration import ENV_VAR as CALIBRATION_ENV_VAR
from .calibration import Calibration, calibration_from_environment
from .flush_choice import AUTO, FORCE_ENV_VAR, parse_force
from .measured import MEASURE_ENV_VAR, parse_measure
from .verdict_book import VerdictBook, load_verdicts

TIMEOUT_ENV_VAR = "OWNER_REDUCE_TIMEOUT_S"
VERDICTS_ENV_VAR = verdict_book.ENV_VAR
NCCL_BLOCKING_ENV_VAR = "NCCL_COMM_BLOCKING"  # NCCL's own variable, read here only to refuse what cupy cannot handle


def check_nccl_blocking(value: str | None) -> None:
    """``NCCL_COMM_BLOCKING``: unset or 1 (NCCL's blocking communicators); ValueError naming the variable otherwise.

    Why refused: with any other value NCCL makes every communicator non-blocking, and every call may then return
    ``ncclInProgress`` (7), which cupy 14's ``NcclError`` cannot even represent (``KeyError: 7``, its table ends at 5):
    the runtime's calls would fail with an unrelated error, or be taken as done while NCCL still works on them."""
    if value is None or not value.strip() or value.strip() == "1":
        return
    raise ValueError(f"owner_reduce: {NCCL_BLOCKING_ENV_VAR}={value!r}: owner_reduce's NCCL calls through cupy need "
                     f"blocking communicators ({NCCL_BLOCKING_ENV_VAR} unset or 1): in a non-blocking one every call "
                     f"may return ncclInProgress (7), which cupy's NcclError cannot represent")


def parse_timeout_s(value: str | None) -> float | None:
    """``OWNER_REDUCE_TIMEOUT_S``: seconds > 0, or None when unset; ValueError naming the variable otherwise."""
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or seconds == math.inf:
        raise ValueError(f"owner_reduce: {TIMEOUT_ENV_VAR} must be a positive number of seconds, got {value!r}")
    return seconds


@dataclass(frozen=True)
class EnvInputs:
    """What the environment asks of the runtime, and why a part of it cannot be used (``problems``: (variable, reason)
    in the order read; the failed variable's default is in its field)."""

    flush_algo: str = AUTO
    measure: bool = True
    calibration: Calibration | None = None
    verdicts: VerdictBook | None = None  # OWNER_REDUCE_VERDICTS names a file that exists: replay it
    verdicts_path: str | None = None  # OWNER_REDUCE_VERDICTS's file (replayed, or written when it does not exist yet)
    timeout_s: float | None = None
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def records_verdicts(self) -> bool:
        """OWNER_REDUCE_VERDICTS names a file that does not exist yet: this run writes its verdicts there."""
        return self.verdicts_path is not None and self.verdicts is None

    def problem_text(self) -> str:
        """One line of every reason (empty when none): what this rank contributes to the agreement."""
        return "; ".join(f"{reason}" for _, reason in self.problems)


def _reason(error: ValueError) -> str:
    return str(error).removeprefix("owner_reduce: ")


def read_environment(environ: Mapping[str, str] | None = None, *, reduce_to_owner: bool = True) -> EnvInputs:
    """Read every variable (see the module docstring); never raises for a bad value."""
    env = os.environ if environ is None else environ
    problems: list[tuple[str, str]] = []
    values: dict[str, object] = {}

    def read(variable: str, field: str, parse) -> None:  # noqa: ANN001 - a parser of one variable
        try:
            values[field] = parse()
        except ValueError as error:
            problems.append((variable, _reason(error)))

    read(FORCE_ENV_VAR, "flush_algo", lambda: parse_force(env.get(FORCE_ENV_VAR)))
    read(MEASURE_ENV_VAR, "measure", lambda: parse_measure(env.get(MEASURE_ENV_VAR)))
    read(TIMEOUT_ENV_VAR, "timeout_s", lambda: parse_timeout_s(env.get(TIMEOUT_ENV_VAR)))
    try:
        check_nccl_blocking(env.get(NCCL_BLOCKING_ENV_VAR))
    except ValueError as error:
        problems.append((NCCL_BLOCKING_ENV_VAR, _reason(error)))
    if reduce_to_owner:
        read(CALIBRATION_ENV_VAR, "calibration", lambda: _complete(calibration_from_environment(env), env))
        path = env.get(VERDICTS_ENV_VAR, "").strip()
        if path:
            values["verdicts_path"] = path
            read(VERDICTS_ENV_VAR, "verdicts", lambda: _verdicts_of(path))
    return EnvInputs(**values, problems=tuple(problems))  # type: ignore[arg-type]


def _complete(calibration: Calibration | None, env: Mapping[str, str]) -> Calibration | None:
    """A calibration the runtime can cost every candidate on, or a ValueError naming what it lacks."""
    if calibration is not None:
        missing = calibration.missing_for_runtime()
        if missing:
            raise ValueError(f"{CALIBRATION_ENV_VAR}={env.get(CALIBRATION_ENV_VAR, '').strip()!r}: the calibration "
                             f"lacks {', '.join(missing)} (written with --kinds, or edited); the runtime costs every "
                             f"candidate on it: rerun scripts/calibrate.py without --kinds")
    return calibration


def _verdicts_of(path: str) -> VerdictBook | None:
    """The book to replay, or None where the file does not exist yet (this run writes it: its folder must exist)."""
    p = Path(path)
    if not p.exists():
        if not p.parent.is_dir():
            raise ValueError(f"{VERDICTS_ENV_VAR}={path!r}: neither the file nor its folder exists (the run writes "
                             f"its verdicts there when the file does not exist yet)")
        return None
    try:
        return load_verdicts(p)
    except ValueError as error:
        raise ValueError(f"{VERDICTS_ENV_VAR}={path!r}: {_reason(error)}") from error
