"""The measured guard's arithmetic: which flushes a trial covers, the verdict from every rank's medians, the line.

Why measure at all: the cost model is NCCL's own tuning model on an assumed cluster; the one published measurement
(8x A800) says it overstates the owner path's gain, and no interconnect has timed it. A user at 512 ranks cannot
check a model, so the runtime checks its choice where it runs: after a graph learns its schedule, each flush whose
choice is not native's own calls runs, in alternate steady steps, the model's choice and native's calls
(``TRIAL_ROUNDS`` steps each); every rank contributes its median times per flush and variant to one small
collective, the maximum over ranks is taken (the slowest rank is what the step waits for), and every rank keeps the
same winner for that flush from then on. Identical on every rank: the inputs are the gathered rows, the same on
every rank, and the arithmetic here.

On by default; ``OWNER_REDUCE_MEASURE=0`` turns it off (agreed at init like the other settings); never under a
forced algorithm (``OWNER_REDUCE_FLUSH_ALGO``): a forced choice is what the user asked to run.
Pure: numbers in, verdicts and text out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .wording import count_noun

TRIAL_ROUNDS = 3  # steady steps of each variant per trial: a median of three survives one outlier
MEASURE_ENV_VAR = "OWNER_REDUCE_MEASURE"
MODEL, NATIVE_VARIANT = 0, 1  # the two variants a trial alternates, in that order (step k runs k % 2)
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


def parse_measure(value: str | None) -> bool:
    """``OWNER_REDUCE_MEASURE``: unset or empty means on; ValueError naming the variable for anything unknown."""
    if value is None or not value.strip():
        return True
    text = value.strip().lower()
    if text in _OFF:
        return False
    if text in _ON:
        return True
    raise ValueError(f"owner_reduce: {MEASURE_ENV_VAR} must be one of {', '.join(_ON + _OFF)}, got {value!r}")


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def pack_medians(medians: Sequence[tuple[float, float]]) -> list[int]:
    """This rank's row for the agreement collective: (model, native) median per trial flush, in nanoseconds."""
    row = [len(medians)]
    for model_us, native_us in medians:
        row += [round(model_us * 1000), round(native_us * 1000)]
    return row


@dataclass(frozen=True)
class Verdict:
    """One trial flush after the agreement: the slowest rank's medians (us) and whether native's calls won."""

    model_us: float
    native_us: float

    @property
    def native_wins(self) -> bool:
        return self.native_us < self.model_us  # a tie keeps the model's choice (fewer calls)


def verdicts(rows: Sequence[Sequence[int]]) -> tuple[Verdict, ...]:
    """Every rank's ``pack_medians`` row -> per trial flush the maximum over ranks of each variant's median."""
    counts = {row[0] for row in rows}
    if len(counts) != 1 or any(len(row) != 1 + 2 * row[0] for row in rows):
        raise RuntimeError(f"owner_reduce: ranks measured different flushes in the trial: rows {list(rows)}")
    (n,) = counts
    return tuple(Verdict(max(row[1 + 2 * i] for row in rows) / 1000, max(row[2 + 2 * i] for row in rows) / 1000)
                 for i in range(n))


@dataclass(frozen=True)
class TrialFlush:
    """What the measured line says about one trial flush: its number in the graph, the model's choice (its
    ``algo=``), modelled times of both variants, and the verdict."""

    number: int
    algo: str
    modelled_us: float
    native_modelled_us: float
    verdict: Verdict


def format_measured_line(prefix: str, graph: str, flushes: Sequence[TrialFlush], rounds: int = TRIAL_ROUNDS) -> str:
    """The ``[dc-schedule]`` line after a trial: measured against modelled milliseconds per flush kind (summed over
    that kind's flushes, the slowest rank's medians), then which flushes the measurement overruled."""
    by_algo: dict[str, list[TrialFlush]] = {}
    for f in flushes:
        by_algo.setdefault(f.algo, []).append(f)
    parts = []
    for algo, group in by_algo.items():
        measured = sum(f.verdict.model_us for f in group) / 1000
        native = sum(f.verdict.native_us for f in group) / 1000
        modelled = sum(f.modelled_us for f in group) / 1000
        native_modelled = sum(f.native_modelled_us for f in group) / 1000
        parts.append(f"{algo} x{len(group)} measured {measured:.3f} ms vs native {native:.3f} ms "
                     f"(modelled {modelled:.3f} vs {native_modelled:.3f})")
    overruled = [f for f in flushes if f.verdict.native_wins]
    tail = ("overruled by measurement, native from now on: "
            + ", ".join(f"flush {f.number} ({f.algo})" for f in overruled)) if overruled else \
        "the model's choice kept for every flush"
    return (f"{prefix} graph {graph}: measured {count_noun(len(flushes), 'flush', 'flushes')} over {rounds} steps "
            f"each way, slowest rank: " + "; ".join(parts) + f"; {tail}")
