"""What each rank reads on its own when the runtime starts: the files the config names, and the one variable of
NCCL's it must refuse; each failure kept as a reason instead of raised.

Why not raise: each rank reads its own files and its own environment. A rank that raised here alone (a calibration
file its node cannot read, a typo in one rank's launcher line) would leave every other rank waiting for it in the
first collective of init, on DeepSpeed's group, for DeepSpeed's timeout, never learning why. So each input that fails
is kept as (name, reason) with the default in its place; the runtime's init-time agreement gathers every rank's
reasons within the package's deadline and every rank refuses together, naming the ranks, the key or variable and the
reason (``runtime.agreement``). What may differ across ranks without failing here (another calibration file) is compared
there too.

The environment: no owner_reduce variable is read. The variables that held settings before they moved into the config
(``REMOVED_ENV_VARS``, the flushes' deadline override among them) are named in a warning, with the key that replaced
them, where one is still set.
Pure: a settings object and a mapping in, values and reasons out (the named files are read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .calibration import Calibration, load_calibration
from .settings import ALGO, CALIBRATION, TIMEOUT, VERDICTS, OwnerReduceSettings, key_name
from .verdict_book import VerdictBook, load_verdicts

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


# variable -> what replaced it (read until issue 38; OWNER_REDUCE_TIMEOUT_S, a developer override, until issue 48)
REMOVED_ENV_VARS: dict[str, str] = {
    "OWNER_REDUCE_FLUSH_ALGO": key_name(ALGO),
    "OWNER_REDUCE_MEASURE": f'{key_name(ALGO)} "model" (for OWNER_REDUCE_MEASURE=0)',
    "OWNER_REDUCE_CALIBRATION": key_name(CALIBRATION),
    "OWNER_REDUCE_VERDICTS": key_name(VERDICTS),
    "OWNER_REDUCE_TIMEOUT_S": key_name(TIMEOUT),
}


def removed_variables_set(environ: Mapping[str, str]) -> list[str]:
    """One warning per variable of ``REMOVED_ENV_VARS`` that is set (non-empty), naming what replaced it."""
    return [f"owner_reduce: {name} is set but no longer read (DeepSpeed's multi-node launcher does not forward it to "
            f"other nodes); set {replacement} in the DeepSpeed config instead"
            for name, replacement in REMOVED_ENV_VARS.items() if environ.get(name, "").strip()]


@dataclass(frozen=True)
class RankInputs:
    """What this rank read, and why a part of it cannot be used (``problems``: (key or variable, reason) in the order
    read; the failed input's default is in its field)."""

    calibration: Calibration | None = None
    verdicts: VerdictBook | None = None  # the verdicts file exists: replay it
    verdicts_path: str | None = None  # the verdicts file (replayed, or written when it does not exist yet)
    problems: tuple[tuple[str, str], ...] = ()

    @property
    def records_verdicts(self) -> bool:
        """The verdicts file does not exist yet: this run writes its verdicts there."""
        return self.verdicts_path is not None and self.verdicts is None

    def problem_text(self) -> str:
        """One line of every reason (empty when none): what this rank contributes to the agreement."""
        return "; ".join(reason for _, reason in self.problems)


def _reason(error: ValueError) -> str:
    return str(error).removeprefix("owner_reduce: ")


def read_inputs(settings: OwnerReduceSettings, environ: Mapping[str, str] | None = None) -> RankInputs:
    """Read the files ``settings`` names (only with the owner path on: otherwise they cannot take effect, and
    ``settings.inapplicable_settings`` said so at config time) and NCCL's blocking variable; never raises for a bad
    value."""
    env = os.environ if environ is None else environ
    problems: list[tuple[str, str]] = []
    values: dict[str, object] = {}

    def read(name: str, field: str, parse) -> None:  # noqa: ANN001 - a parser of one input
        try:
            values[field] = parse()
        except ValueError as error:
            problems.append((name, _reason(error)))

    try:
        check_nccl_blocking(env.get(NCCL_BLOCKING_ENV_VAR))
    except ValueError as error:
        problems.append((NCCL_BLOCKING_ENV_VAR, _reason(error)))
    if settings.flags.reduce_to_owner:
        if settings.calibration is not None:
            read(key_name(CALIBRATION), "calibration", lambda: _calibration_of(settings.calibration))
        if settings.verdicts is not None:
            values["verdicts_path"] = settings.verdicts
            read(key_name(VERDICTS), "verdicts", lambda: _verdicts_of(settings.verdicts))
    return RankInputs(**values, problems=tuple(problems))  # type: ignore[arg-type]


def _calibration_of(path: str) -> Calibration:
    """The calibration file, complete enough to cost every candidate on, or a ValueError naming the key and path."""
    name = f"{key_name(CALIBRATION)}={path!r}"
    try:
        calibration = load_calibration(path)
    except ValueError as error:
        raise ValueError(f"{name}: {_reason(error)}") from error
    missing = calibration.missing_for_runtime()
    if missing:
        raise ValueError(f"{name}: the calibration lacks {', '.join(missing)} (written with --kinds, or edited); the "
                         f"runtime costs every candidate on it: rerun scripts/calibrate.py without --kinds")
    return calibration


def _verdicts_of(path: str) -> VerdictBook | None:
    """The book to replay, or None where the file does not exist yet (this run writes it: its folder must exist)."""
    name = f"{key_name(VERDICTS)}={path!r}"
    p = Path(path)
    if not p.exists():
        if not p.parent.is_dir():
            raise ValueError(f"{name}: neither the file nor its folder exists (the run writes its verdicts there when "
                             f"the file does not exist yet)")
        return None
    try:
        return load_verdicts(p)
    except ValueError as error:
        raise ValueError(f"{name}: {_reason(error)}") from error
