"""The measured guard at run time: one graph's trial of its model-chosen flushes against native's calls.

Why (``planning.measured``): the model's choice is only as good as its assumed cluster; the runtime checks it where
it runs. A ``Trial`` holds two schedules of the same flushes, the model's and one where every trial flush is laid
out as native's (one AllReduce per gradient, z1.cpp's calls); the placement follows them in alternate backwards
(model first), the flusher times the trial flushes, and once every trial flush has ``TRIAL_ROUNDS`` samples of each
variant the guard (``guard``) gathers every rank's medians in one collective and installs the schedule of winners.

Note (timing): a flush is timed where its work runs: on the GPU two CUDA events on the stream it runs on around
everything the flush does there (padding, pre-division, the groups, the hand-off, the copy-out), read after
``end_backward``'s bounded wait; on the CPU the wall clock around the same code, whose collectives complete (their
works waited) before it returns. Only trial flushes are timed, and only during their trial: outside it the hot path
pays one ``None`` check per flush.

Note (whole step): where the step's plan overlaps flushes (``Schedule.overlapped``: a flush's node step runs during
the previous flush's rail step), a flush's own time no longer says what it costs, so the trial times the step's
reduction as a whole, from the first flush's start (an event where it starts, the node stream) to the end of the
last (an event on the reduce stream after it joined both levels, at ``end_backward``), against native's calls for
every flush, and every rank keeps one of the two schedules.

Note (resumed trials): a checkpoint saved during a trial keeps it (``progress``): its schedule's key, the steps it ran
(so the variant that runs next), and every sample so far as the step's slowest rank took it, gathered from every rank
at the save (``measured.slowest_progress``); samples are taken inside backward and read at its end, a save comes
between steps, so no sample spans a save. A run resumed from that checkpoint adopts the schedule at its first
backward (``placement`` Note (resumed schedules)), and the trial made for it goes on from there (``resume``): the
same variant next, the same samples, the verdict at the same step, from every rank's slowest samples as the saving
run's. Only the samples of the steps after the save are the resumed run's own: where the two variants are close
(``measured.is_close``), its verdict may differ from the saving run's, and rank 0 says so (``guard``), naming the
pin: a verdict file. Where the resumed run replays a verdict file that holds this schedule (the saving run wrote it
after its save), the trial still runs its remaining steps as the saving run ran them, and then installs the file's
verdicts (``known``), not its own.

Note (identical on every rank): which flushes a trial covers, the order of the variants and the step at which a
trial ends follow from the schedule and the backwards, the same on every rank (``schedule`` Note (identical on every
rank)); the verdict comes from the gathered rows, the same on every rank. A backward that leaves its schedule drops
the graph's trial on every rank alike; the schedule learned again starts a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..planning.collectives import NATIVE
from ..planning.measured import (
    MODEL,
    NATIVE_VARIANT,
    STEP,
    TRIAL_ROUNDS,
    TrialFlush,
    Verdict,
    pack_progress,
    pack_samples,
)
from ..planning.owner_layout import OwnerLayout
from ..planning.verdict_book import ScheduleVerdicts, TrialProgress, schedule_key
from .schedule import Schedule, ScheduledFlush


class TimedKey(NamedTuple):
    """What a timed flush's marks belong to: its graph's trial, the trial flush (0 for a step timed as a whole), the
    variant, and whether the marks span the whole step (from this flush's start to the end of backward)."""

    graph: int
    index: int
    variant: int
    whole_step: bool = False


class Trial:
    """One graph's trial (see the module docstring). ``timed`` maps ``id`` of each variant's scheduled flush to
    (trial flush number, variant, whole step); the flushes are held by the schedules, so their ids are not reused
    meanwhile. A schedule whose flushes overlap (``Schedule.overlapped``) is timed as a whole: Note (whole step)."""

    def __init__(self, model: Schedule, native_layout: Callable[[ScheduledFlush], OwnerLayout],
                 native_modelled_us: Callable[[ScheduledFlush], float], rounds: int = TRIAL_ROUNDS,
                 world_size: int = 0) -> None:
        self.rounds = rounds
        self.key = key_of(model, world_size)  # ``verdict_book`` Note (key)
        self.steps = 0  # backwards that followed a variant in full
        self.flushes: list[tuple[int, ScheduledFlush, ScheduledFlush, float]] = []  # (number, model, native, us)
        self.timed: dict[int, tuple[int, int, bool]] = {}
        self.whole_step = model.overlapped
        native_by_dtype: dict[Any, tuple[ScheduledFlush, ...]] = {}
        number = 0
        for dtype, flushes in model.flushes.items():
            variant = []
            for flush in flushes:
                number += 1
                if flush.layout.choice == NATIVE:
                    variant.append(flush)  # already native's calls: nothing to compare, the same object in both
                    continue
                native = ScheduledFlush(flush.dtype, flush.ids, flush.numels, native_layout(flush))
                variant.append(native)
                if not self.whole_step:
                    index = len(self.flushes)
                    self.flushes.append((number, flush, native, native_modelled_us(flush)))
                    self.timed[id(flush)] = (index, MODEL, False)
                    self.timed[id(native)] = (index, NATIVE_VARIANT, False)
            native_by_dtype[dtype] = tuple(variant)
        native_schedule = Schedule(model.graph_id, native_by_dtype, first_dtype=model.first_dtype)
        self.schedules = (model, native_schedule)
        first, native_first = model.first(), native_schedule.first()
        if self.whole_step and first is not None and native_first is not None:
            native_us = sum(native_modelled_us(f) for fs in model.flushes.values() for f in fs)
            self.flushes.append((0, first, native_first, native_us))
            self.timed[id(first)] = (0, MODEL, True)
            self.timed[id(native_first)] = (0, NATIVE_VARIANT, True)
        self.samples: list[tuple[list[float], list[float]]] = [([], []) for _ in self.flushes]
        # A resumed trial whose verdicts are known already (a verdict file): at its end these are installed, not the
        # samples' (Note (resumed trials))
        self.known: ScheduleVerdicts | None = None

    @property
    def needed(self) -> bool:
        """False when every flush already runs native's calls: no trial."""
        return bool(self.flushes)

    def current(self) -> Schedule:
        """The schedule the next backward of the graph follows."""
        return self.schedules[self.steps % 2]

    def add_sample(self, index: int, variant: int, us: float) -> None:
        self.samples[index][variant].append(us)

    def step_done(self) -> None:
        self.steps += 1

    @property
    def done(self) -> bool:
        return all(len(s[MODEL]) >= self.rounds and len(s[NATIVE_VARIANT]) >= self.rounds for s in self.samples)

    def row(self) -> list[int]:
        """This rank's contribution to the agreement collective (``measured.pack_samples``)."""
        return pack_samples(self.samples, self.rounds)

    def numbers_and_algos(self) -> list[tuple[int, str]]:
        """(number in the graph, the model's algorithm) of each trial flush, as ``trial_flushes`` gives them."""
        if self.whole_step:
            return [(0, STEP)]
        return [(number, model.layout.algo) for number, model, _, _ in self.flushes]

    def progress_row(self) -> list[int]:
        """This rank's samples so far, for the collective at a checkpoint (``measured.pack_progress``)."""
        return pack_progress(self.samples)

    def progress(self, slowest: Sequence[tuple[Sequence[int], Sequence[int]]]) -> TrialProgress:
        """What a checkpoint keeps of this trial, from every rank's samples so far (``measured.slowest_progress``):
        Note (resumed trials)."""
        return TrialProgress(self.key, self.steps, self.rounds, tuple(
            (number, algo, tuple(model), tuple(native))
            for (number, algo), (model, native) in zip(self.numbers_and_algos(), slowest, strict=True)))

    def resume(self, saved: TrialProgress) -> str | None:
        """Go on from ``saved`` (Note (resumed trials)): its steps and samples in place of this fresh trial's; or why
        not (it is another trial), and nothing changes."""
        mine = self.numbers_and_algos()
        theirs = [(number, algo) for number, algo, _, _ in saved.flushes]
        if saved.key != self.key or theirs != mine or saved.rounds != self.rounds:
            return (f"the saved trial of schedule {saved.key} ({theirs}, {saved.rounds} rounds) is not this one "
                    f"({self.key}: {mine}, {self.rounds} rounds)")
        if self.steps or any(model or native for model, native in self.samples):
            return f"the trial of schedule {self.key} is under way already"
        self.steps = saved.steps
        self.samples = [([ns / 1000 for ns in model], [ns / 1000 for ns in native])
                        for _, _, model, native in saved.flushes]
        return None

    def winners(self, verdicts: Sequence[Verdict]) -> tuple[Schedule, tuple[TrialFlush, ...]]:
        """The schedule every rank keeps (each trial flush's winner, or for a step timed as a whole one of the two
        schedules) and what the measured line reports."""
        model_schedule, native_schedule = self.schedules
        if self.whole_step:
            (number, model, _, native_us), = self.flushes
            (verdict,) = verdicts
            report = (TrialFlush(0, STEP, model_schedule.modelled_us, native_us, verdict),)
            return (native_schedule if verdict.native_wins else model_schedule), report
        winner: dict[int, ScheduledFlush] = {}
        report = []
        for (number, model, native, native_us), verdict in zip(self.flushes, verdicts, strict=True):
            winner[id(model)] = native if verdict.native_wins else model
            report.append(TrialFlush(number, model.layout.algo,
                                     model.layout.modelled_us, native_us, verdict))
        kept = {d: tuple(winner.get(id(f), f) for f in fs) for d, fs in model_schedule.flushes.items()}
        return Schedule(model_schedule.graph_id, kept, first_dtype=model_schedule.first_dtype), tuple(report)


def key_of(schedule: Schedule, world_size: int) -> str:
    """``verdict_book.schedule_key`` of a learned schedule: its flushes per dtype as learned, and each one's choice."""
    return schedule_key(world_size, [(str(f.dtype).removeprefix("torch."), f.ids, f.numels, f.layout.algo)
                                     for flushes in schedule.flushes.values() for f in flushes])


def trial_flushes(schedule: Schedule) -> list[tuple[int, str]]:
    """(number in the graph, the model's algorithm) of each flush a trial of ``schedule`` covers: ``Trial``'s order
    (a step timed as a whole: one, the step)."""
    numbered = enumerate((f for flushes in schedule.flushes.values() for f in flushes), start=1)
    covered = [(number, f.layout.algo) for number, f in numbered if f.layout.choice != NATIVE]
    return [(0, STEP)] if covered and schedule.overlapped else covered
