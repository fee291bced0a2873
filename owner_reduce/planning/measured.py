"""The measured guard's arithmetic: which flushes a trial covers, the verdict from every rank's samples, the line.

Why measure at all: the cost model is NCCL's own tuning model on an assumed cluster; the one published measurement
(8x A800) says it overstates the owner path's gain, and no interconnect has timed it. A user at 512 ranks cannot
check a model, so the runtime checks its choice where it runs: after a graph learns its schedule, each flush whose
choice is not native's own calls runs, in alternate steady steps, the model's choice and native's calls
(``TRIAL_ROUNDS`` steps each); every rank contributes its times per flush and variant to one small collective, each
step is timed by its slowest rank (what the step waits for), and every rank keeps the same winner for that flush from
then on. Identical on every rank: the inputs are the gathered rows, the same on every rank, and the arithmetic here.

Note (beyond the noise): native's calls replace the model's choice only where every step of native's was faster than
every step of the model's (each step timed by its slowest rank): the two ranges do not overlap. Where they overlap
the model's choice stays, also when native's median is the lower one (the line says "within the noise"). Why not
the lower median: a verdict changes which algorithm adds the ranks' terms, so a verdict decided by noise would make
two runs of one job, or a run and its resumption, differ in the last bits (issue 31). Timings on a loaded host vary
by several times from step to step (samples of one flush from 0.5 to 10 ms on the CPU test cluster), while the
differences the guard exists for (a model that is wrong at the user's scale) are systematic, so they separate;
with three steps each way two variants of equal speed still separate by chance one time in twenty, which is why a
verdict is kept with the checkpoint and can be pinned (``verdict_book``). The rule is two functions,
``slowest_rank`` and ``native_beyond_noise``; ``is_close`` says where another run could decide otherwise (rank 0 then
names the flush and the pin).

On by default (``compile.reduce_to_owner_algo: "auto"``); ``"model"`` turns it off (agreed at init like the other
settings); never under a forced algorithm (any other value): a forced choice is what the user asked to run.
Pure: numbers in, verdicts and text out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .wording import count_noun, rank_ranges

TRIAL_ROUNDS = 3  # steady steps of each variant per trial: a median of three survives one outlier
MODEL, NATIVE_VARIANT = 0, 1  # the two variants a trial alternates, in that order (step k runs k % 2)
FLUSHES_SHOWN = 4  # flush numbers (or runs) of one kind the measured line names before "and N more"
STEP = "the step"  # a trial of a schedule whose flushes overlap: the step's reduction timed as a whole


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def pack_samples(samples: Sequence[tuple[Sequence[float], Sequence[float]]], rounds: int = TRIAL_ROUNDS) -> list[int]:
    """This rank's row for the agreement collective: per trial flush its first ``rounds`` samples (us) of the model's
    choice, then of native's calls, in nanoseconds, after the flush count and ``rounds``. Sample k of every rank is
    the same backward (the variants alternate alike on every rank), so the gathered rows line up step by step."""
    row = [len(samples), rounds]
    for model, native in samples:
        if len(model) < rounds or len(native) < rounds:
            raise ValueError(f"owner_reduce: a trial flush has {len(model)} and {len(native)} samples, needs {rounds}")
        row += [round(us * 1000) for us in model[:rounds]] + [round(us * 1000) for us in native[:rounds]]
    return row


@dataclass(frozen=True)
class Verdict:
    """One trial flush after the agreement: the medians (us) of its steps' times, each step timed by its slowest
    rank, and whether native's calls won (see ``verdicts``). ``close``: another run could decide otherwise
    (``is_close``); known where this run measured it, not kept in the book (a replayed verdict is pinned)."""

    model_us: float
    native_us: float
    native_wins: bool = False
    close: bool = field(default=False, compare=False)

    @property
    def within_noise(self) -> bool:
        """Native's median was the lower one, but not beyond the trial's own noise: the model's choice stays."""
        return not self.native_wins and self.native_us < self.model_us


def slowest_rank(times: Sequence[float]) -> float:
    """One step's time from every rank's time of that step: the slowest rank's, what the step waits for."""
    return max(times)


def native_beyond_noise(model: Sequence[float], native: Sequence[float]) -> bool:
    """The verdict rule, Note (beyond the noise): native's calls win a flush only where every one of native's steps was
    faster than every one of the model's (each step timed by ``slowest_rank``); a tie keeps the model's choice."""
    return max(native) < min(model)


def is_close(model: Sequence[float], native: Sequence[float]) -> bool:
    """Another run of the job could decide this flush otherwise: the distance from these samples to a flip of the
    verdict is no wider than either variant's own spread from step to step (its slowest step minus its fastest).

    Why that distance: the rule (``native_beyond_noise``) flips exactly where native's slowest step crosses the
    model's fastest one, so how far this trial is from the other verdict is ``|max(native) - min(model)|``, whichever
    side won; and a variant whose steps varied by that much in this trial could move that far in the next one. Not
    the ranges' separation (``min`` of the slower variant minus ``max`` of the faster): on a loaded host a variant's
    steps vary by several times, so the ranges overlap or lie within a spread of each other also where native's
    steps are 4x the model's and no run would ever flip (one slow outlier of native's widens the spread, and it
    widens the distance to a flip just as much). A tie is close (the rule keeps the model's choice by a hair).

    Where a verdict is close, a run resumed from a checkpoint saved before it, or another run of the job, may differ
    from this one in the last bits, unless the verdicts are pinned (``verdict_book``). Pure: the slowest rank's step
    times in, a bool out."""
    to_flip = abs(max(native) - min(model))
    return to_flip <= max(max(model) - min(model), max(native) - min(native))


def verdicts(rows: Sequence[Sequence[int]]) -> tuple[Verdict, ...]:
    """Every rank's ``pack_samples`` row -> per trial flush a ``Verdict``. See Note (beyond the noise)."""
    shapes = {(row[0], row[1]) if len(row) >= 2 else None for row in rows}
    if len(shapes) != 1 or None in shapes or any(len(row) != 2 + 2 * row[0] * row[1] for row in rows):
        raise RuntimeError(f"owner_reduce: ranks measured different flushes in the trial: rows {list(rows)}")
    ((n, rounds),) = shapes
    out = []
    for i in range(n):
        at = 2 + 2 * rounds * i
        # The rule's two parts are looked up at call time: a test injects a wrong rule there, in the product's path.
        model = [slowest_rank([row[at + k] for row in rows]) / 1000 for k in range(rounds)]
        native = [slowest_rank([row[at + rounds + k] for row in rows]) / 1000 for k in range(rounds)]
        out.append(Verdict(median(model), median(native), native_wins=native_beyond_noise(model, native),
                           close=is_close(model, native)))
    return tuple(out)


def pack_progress(samples: Sequence[tuple[Sequence[float], Sequence[float]]]) -> list[int]:
    """This rank's samples of a trial under way (us), for the collective at a checkpoint: the flush count, then per
    trial flush the count of the model's samples and of native's, then those samples in nanoseconds (as
    ``pack_samples``: sample k of every rank is the same backward)."""
    row = [len(samples)]
    for model, native in samples:
        row += [len(model), len(native)] + [round(us * 1000) for us in model] + [round(us * 1000) for us in native]
    return row


def slowest_progress(rows: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Every rank's ``pack_progress`` row -> per trial flush the model's and native's step times so far (ns), each
    step its slowest rank's: all that a verdict needs of them (``verdicts`` takes the slowest rank of each step, and
    the slowest of equal times is that time), so a resumed trial goes on from them on every rank alike."""
    shapes = [_progress_shape(row) for row in rows]
    if not shapes or None in shapes or any(s != shapes[0] for s in shapes):
        raise RuntimeError(f"owner_reduce: ranks are at different points of the trial: rows {list(rows)}")
    out, at = [], 1
    for m, n in shapes[0]:
        model = tuple(slowest_rank([row[at + 2 + k] for row in rows]) for k in range(m))
        native = tuple(slowest_rank([row[at + 2 + m + k] for row in rows]) for k in range(n))
        out.append((model, native))
        at += 2 + m + n
    return tuple(out)


def _progress_shape(row: Sequence[int]) -> list[tuple[int, int]] | None:
    """(model samples, native samples) per flush of a ``pack_progress`` row, or None where it is not one."""
    if not row or row[0] < 0:
        return None
    out, at = [], 1
    for _ in range(row[0]):
        if at + 2 > len(row) or min(row[at], row[at + 1]) < 0:
            return None
        out.append((row[at], row[at + 1]))
        at += 2 + row[at] + row[at + 1]
    return out if at == len(row) else None


@dataclass(frozen=True)
class TrialFlush:
    """What the measured line says about one trial flush: its number in the graph, the model's choice (its
    ``algo=``), modelled times of both variants, and the verdict."""

    number: int
    algo: str
    modelled_us: float
    native_modelled_us: float
    verdict: Verdict


def format_measured_line(prefix: str, graph: str, flushes: Sequence[TrialFlush], source: str | None = None) -> str:
    """The ``[dc-schedule]`` line after a trial, in at most 30 words (issue 38: a line read at 512 ranks stays a line):
    the trial flushes' measured milliseconds against native's (summed over the flushes, each the median of its steps'
    slowest ranks), then which flushes the measurement overruled and where native was faster within the noise (Note
    (beyond the noise)), folded by kind (``_names``). The modelled times and the flush count are the schedule line's
    (printed when the graph learned it); the rounds and the times per kind next to the modelled ones are
    ``format_measured_detail``'s, a DEBUG line. ``source``: the verdicts were not measured in this run but replayed
    from there (a checkpoint, a verdict file)."""
    what = "measured" if source is None else "verdicts replayed from " + source + ", measured"
    if len(flushes) == 1 and flushes[0].algo == STEP:  # the step's reduction, timed as a whole
        (f,) = flushes
        kept = ("overruled by measurement: native's calls for every flush" if f.verdict.native_wins else
                "the plan kept" + (", native faster within the noise" if f.verdict.within_noise else ""))
        return (f"{prefix} graph {graph}: {what} the step's reduction (flushes overlapped): "
                f"{_times(flushes)}; {kept}")
    overruled = [f for f in flushes if f.verdict.native_wins]
    tail = "overruled by measurement: " + _names(overruled) if overruled else "the model's choice kept for every flush"
    close = [f for f in flushes if f.verdict.within_noise]
    if close:
        tail += "; native faster within the noise: " + _names(close)
    return f"{prefix} graph {graph}: {what} {_times(flushes)}; {tail}"


def format_measured_detail(prefix: str, graph: str, flushes: Sequence[TrialFlush], rounds: int = TRIAL_ROUNDS) -> str:
    """What the measured line leaves out to stay short, for its DEBUG line: the flush count, the rounds, and per kind
    of flush (its ``algo=``) the measured times next to the modelled ones."""
    by_algo: dict[str, list[TrialFlush]] = {}
    for f in flushes:
        by_algo.setdefault(f.algo, []).append(f)
    kinds = "; ".join(f"{algo} x{len(group)} {_times(group, modelled=True)}" for algo, group in by_algo.items())
    return (f"{prefix} graph {graph}: the trial of {count_noun(len(flushes), 'flush', 'flushes')}, medians over "
            f"{rounds} steps each way, each step timed by its slowest rank: {kinds}")


def _times(flushes: Sequence[TrialFlush], modelled: bool = False) -> str:
    """``0.049 ms vs native 0.053 ms``, summed over ``flushes``; with ``modelled``, `` (modelled 0.031 vs 0.100)``."""
    measured = sum(f.verdict.model_us for f in flushes) / 1000
    native = sum(f.verdict.native_us for f in flushes) / 1000
    text = f"{measured:.3f} ms vs native {native:.3f} ms"
    if not modelled:
        return text
    chosen, native_modelled = (sum(f.modelled_us for f in flushes) / 1000,
                               sum(f.native_modelled_us for f in flushes) / 1000)
    return text + f" (modelled {chosen:.3f} vs {native_modelled:.3f})"


def _names(flushes: Sequence[TrialFlush]) -> str:
    """``flush 2 (reduce)``, ``flushes 1-4, 7 (reduce), flush 9 (allreduce)``: by kind, numbers folded and capped as
    rank lists are (``wording.rank_ranges``, ``FLUSHES_SHOWN``), so that a graph of a hundred flushes still gets a
    line."""
    by_algo: dict[str, list[int]] = {}
    for f in flushes:
        by_algo.setdefault(f.algo, []).append(f.number)
    return ", ".join(f"flush {numbers[0]} ({algo})" if len(numbers) == 1 else
                     f"flushes {rank_ranges(numbers, FLUSHES_SHOWN)} ({algo})" for algo, numbers in by_algo.items())
