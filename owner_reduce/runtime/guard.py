"""The measured guard at run time, with the state a checkpoint keeps: every verdict decided, replayed or restored (the
book, ``planning.verdict_book``), and the trials under way.

Why a module of its own: the guard's life spans runs. A freshly learned schedule is measured against native's calls
(``trial``), or takes the winners its verdicts already name (a verdict file's, a checkpoint's, an earlier trial's of
this run), or goes on with a checkpoint's trial from where it was saved (``trial`` Note (resumed trials)); every rank
alike, since every rank holds the same book and learns the same schedules. Rank 0 says what was measured (the
measured lines), writes the verdict file where this run writes it, and says where a verdict was within the noise.
The handle calls it at three points: a schedule learned (``trial_for``), a backward ended (``advance``), a checkpoint
saved or loaded (``checkpoint_state``, ``restore``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import OwnerReduceMismatchError
from ..planning.collectives import NATIVE
from ..planning.flush_choice import AUTO, FlushCost
from ..planning.measured import (
    STEP,
    TRIAL_ROUNDS,
    format_measured_detail,
    format_measured_line,
    slowest_progress,
    verdicts,
)
from ..planning.settings import VERDICTS, key_name
from ..planning.verdict_book import (
    ScheduleVerdicts,
    TrialProgress,
    VerdictBook,
    checkpoint_payload,
    parse_checkpoint_payload,
    payload_digest,
    write_verdicts,
)
from ..planning.wording import by_value, count_noun
from .comm import ReduceComm
from .placement import GradPlacer
from .schedule import Schedule
from .schedule_lines import SCHEDULE_PREFIX
from .stats import RuntimeStats, emit, emit_detail
from .trial import Trial, key_of, trial_flushes


class MeasuredGuard:
    """The measured guard of one runtime: its book of verdicts (``book``), where each schedule's verdicts came from
    (``sources``, for the lines), a checkpoint's trials waiting for their schedules (``resumed``), and whether it
    measures at all (``measuring``, agreed at init: ``start``)."""

    def __init__(self, stats: RuntimeStats, verdicts: VerdictBook | None, verdicts_path: str | None,
                 graph_number: Callable[[int], int | None]) -> None:
        self._stats = stats
        self._graph_number = graph_number  # a graph's number in the schedule lines (``schedule_lines``), or None
        self._replays_file = verdicts is not None  # compile.reduce_to_owner_verdicts's file existed: never written
        self._verdicts_path = verdicts_path
        self.book: VerdictBook | None = verdicts
        replayed = verdicts.schedules if verdicts is not None else ()
        # schedule key -> where its verdicts came from (the replay line)
        self.sources: dict[str, str] = {s.key: f"{key_name(VERDICTS)}={verdicts_path}" for s in replayed}
        # schedule key -> a checkpoint's trial under way, until its schedule is learned (``trial`` Note (resumed
        # trials))
        self.resumed: dict[str, tuple[TrialProgress, str]] = {}
        self.measuring = False
        self._comm: ReduceComm | None = None
        self._placer: GradPlacer | None = None
        self._cost: FlushCost | None = None

    def start(self, comm: ReduceComm, placer: GradPlacer, cost: FlushCost, measuring: bool) -> None:
        """At init: the communicator its gathers run on, the placer whose trials it decides, the agreed cost model."""
        self._comm, self._placer, self._cost, self.measuring = comm, placer, cost, measuring

    def release(self) -> None:
        """At cleanup: the communicator is closed."""
        self._comm = None

    # ---- a schedule learned ------------------------------------------------------------------------------

    def trial_for(self, schedule: Schedule) -> Trial | Schedule:
        """A freshly learned schedule's trial (``trial``): its model-chosen flushes against native's calls; or, where
        the book holds this schedule's verdicts (a checkpoint's, a verdict file's, an earlier trial's in this run), the
        schedule of their winners at once, every rank alike (``planning.verdict_book``)."""
        cost = self._cost

        def native_us(flush: Any) -> float:
            return cost.for_dtype_bytes(flush.dtype.itemsize).native_us(flush.numels)

        trial = Trial(schedule, self._placer.native_layout, native_us, world_size=self._comm.world_size)
        known = self.known_verdicts(schedule)
        if known is None:
            self._resume(trial)
            return trial
        if trial.key in self.resumed and self._resume(trial):
            # Saved during this trial, decided since (a verdict file the saving run wrote after its save): the trial's
            # remaining steps run as the saving run ran them, then the known winners (``trial`` Note (resumed trials)).
            trial.known = known
            return trial
        winners, report = trial.winners(known.verdicts)
        self._stats.trials_replayed += 1
        self._stats.measured_overruled += sum(f.verdict.native_wins for f in report)
        if self._comm.rank == 0:
            self._measured_line(schedule.graph_id, report, known.rounds, source=self.sources.get(trial.key))
        return winners

    def _resume(self, trial: Trial) -> bool:
        """A checkpoint's trial of this schedule goes on from where it was saved (``trial`` Note (resumed trials)),
        every rank alike (every rank restored the same state and learned the same schedule); whether it does."""
        saved = self.resumed.pop(trial.key, None)
        if saved is None or not trial.needed:
            return False
        progress, source = saved
        why = trial.resume(progress)
        if why is None:
            self._stats.trials_resumed += 1
            return True
        if self._comm.rank == 0:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: not resuming the measured guard's trial saved in {source}: {why}; this "
                           f"schedule is measured from its first trial step")
        return False

    def known_verdicts(self, schedule: Schedule) -> ScheduleVerdicts | None:
        """The book's verdicts of ``schedule`` where they match its trial flushes (``verdict_book`` Note (key)), or
        None: it is measured."""
        if self.book is None:
            return None
        flushes = trial_flushes(schedule)
        known = self.book.find(key_of(schedule, self._comm.world_size)) if flushes else None
        return known if known is not None and known.matches(flushes) else None

    def plan(self, schedule: Schedule) -> str:
        """The end of a schedule line (``schedule_lines``): what the guard does with this schedule's model-chosen
        flushes; empty where it does not run or nothing is measured."""
        trial = sum(f.layout.choice != NATIVE for flushes in schedule.flushes.values() for f in flushes)
        if not (self.measuring and trial):
            return ""
        known = self.known_verdicts(schedule)
        saved = self.resumed.get(key_of(schedule, self._comm.world_size))
        remaining = count_noun(2 * TRIAL_ROUNDS - (saved[0].steps if saved is not None else 0), "step", "steps")
        if known is not None and saved is not None:
            return (f"; the resumed trial's last {remaining}, then the verdicts replayed from "
                    f"{self.sources.get(known.key)}")
        if known is not None:
            return f"; verdicts replayed from {self.sources.get(known.key)} (no trial)"
        if saved is not None:
            what = "the step" if schedule.overlapped else count_noun(trial, "flush", "flushes")
            return f"; measuring {what} against native's calls, {remaining} left (resumed trial)"
        if schedule.overlapped:
            return f"; measuring the step against native's calls over the next {2 * TRIAL_ROUNDS} steps"
        return f"; measuring {count_noun(trial, 'flush', 'flushes')} against native's calls over the next " \
               f"{2 * TRIAL_ROUNDS} steps"

    # ---- a backward ended --------------------------------------------------------------------------------

    def advance(self) -> None:
        """After ``end_backward``'s wait: the timed flushes' times go to their trials; a trial with every sample
        gathers every rank's samples in one collective (bounded by the deadline, as every call of the communicator)
        and every rank installs the same winners, and keeps them in the book (``planning.verdict_book``)."""
        placer, comm = self._placer, self._comm
        placer.take_marks()
        for graph_id, trial in placer.finished_trials():
            if trial.known is not None:  # a resumed trial whose verdicts a file holds: those, as the saving run's
                schedule, report = trial.winners(trial.known.verdicts)
                placer.install(graph_id, schedule)
                self._stats.trials_replayed += 1
                self._stats.measured_overruled += sum(f.verdict.native_wins for f in report)
                if comm.rank == 0:
                    self._measured_line(graph_id, report, trial.known.rounds, source=self.sources.get(trial.key))
                continue
            rows = comm.all_gather_ints(trial.row())
            schedule, report = trial.winners(verdicts(rows))
            placer.install(graph_id, schedule)
            self._stats.trials_decided += 1
            self._stats.measured_overruled += sum(f.verdict.native_wins for f in report)
            book = self.book or VerdictBook(comm.world_size)
            self.book = book.with_schedule(ScheduleVerdicts(trial.key, trial.rounds, report))
            self.sources[trial.key] = "an earlier trial of this run"
            if comm.rank == 0:
                written = self._write_verdicts()
                self._measured_line(graph_id, report, trial.rounds, written=written)
                if written is None:
                    self._say_close(graph_id, report)

    def _say_close(self, graph_id: int, report: Any) -> None:
        """Rank 0, once per decided schedule: the flushes whose verdict another run could take otherwise
        (``measured.is_close``), and how to pin the verdicts. Not where this run wrote them to a verdict file."""
        close = [f for f in report if f.verdict.close]
        if not close:
            return
        from deepspeed.utils import logger

        number = self._graph_number(graph_id)
        names = ", ".join("the step's reduction" if f.algo == STEP else f"flush {f.number} ({f.algo})"
                          for f in close)
        # Why "within the noise": the verdict would flip where native's slowest step crosses the model's fastest,
        # and these lie no further from that than one variant's steps varied (``measured.is_close``).
        line = (f"owner_reduce: graph {f'#{number}' if number else graph_id}: the measured guard's verdict on {names} "
                f"was within the noise, so another run may decide otherwise and differ in the last bits; set "
                f"{key_name(VERDICTS)} to pin the verdicts")
        self._stats.close_lines.append(line)
        logger.warning(line)

    def _measured_line(self, graph_id: int, report: Any, rounds: int, source: str | None = None,
                       written: str | None = None) -> None:
        number = self._graph_number(graph_id)
        graph = f"#{number}" if number else str(graph_id)
        line = format_measured_line(SCHEDULE_PREFIX, graph, report, source=source)
        if written is not None:
            line += f"; verdicts written to {written}"  # the next run with this config replays them
        self._stats.measured_lines.append(line)
        emit(line)
        emit_detail(format_measured_detail(SCHEDULE_PREFIX, graph, report, rounds))

    def _write_verdicts(self) -> str | None:
        """Rank 0, after a trial: the book to ``compile.reduce_to_owner_verdicts``'s file when this run writes it (it
        did not exist at init); the path written, or None. A failure to write is said, never raised: training is not at
        fault, only the pinning is lost."""
        path = self._verdicts_path
        if path is None or self._replays_file or self.book is None:
            return None
        try:
            write_verdicts(path, self.book)
        except OSError as error:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: {key_name(VERDICTS)}={path!r}: writing the verdicts failed ({error}); this "
                           f"run's verdicts are not pinned")
            return None
        return path

    def say_unused(self, owner_path: bool, algo: str) -> None:
        """Rank 0 at init, where ``compile.reduce_to_owner_verdicts`` is set but the guard does not run for a reason
        the config could not show (one rank: nothing to measure): that it has no effect. (Replayed or written: the
        settings line says which; the owner path off or another algorithm than auto: warned at config time.)"""
        if not self.measuring and owner_path and algo == AUTO:
            from deepspeed.utils import logger

            logger.warning(f"owner_reduce: {key_name(VERDICTS)} has no effect: the measured guard does not run with "
                           f"{count_noun(self._comm.world_size, 'rank')}")

    # ---- checkpoints (``wiring.checkpoint``) --------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What ``engine.save_checkpoint`` keeps of the runtime (``wiring.checkpoint``): the verdicts and every schedule
        as learned (``placement`` Note (resumed schedules)); None before any schedule."""
        recordings = self._placer.recordings() if self._placer is not None else []
        if not recordings and (self.book is None or not self.book.schedules):
            return None
        named = [[(str(d).removeprefix("torch."), ids, numels) for d, ids, numels in r] for r in recordings]
        return checkpoint_payload(self.book, named, self._trials_under_way())

    def _trials_under_way(self) -> list[TrialProgress]:
        """Every trial under way, with every rank's samples so far (``trial`` Note (resumed trials)), plus a
        checkpoint's trials not resumed yet, in key order. Collective where a trial is under way (identical on every
        rank; ``save_checkpoint`` is called on every rank): two gathers bounded by the deadline, between steps, so no
        sample spans them."""
        trials = self._placer.running_trials() if self._placer is not None else []
        progress = [progress for progress, _ in self.resumed.values()]
        if not trials:
            return sorted(progress, key=lambda p: p.key)
        comm = self._comm
        row: list[int] = []
        for trial in trials:
            part = trial.progress_row()
            row += [len(part), *part]
        # Two gathers: the rows' lengths first (the gather of the rows needs one length on every rank), so that ranks
        # at different points of their trials (which the invariants exclude) refuse together instead of hanging.
        shapes = [tuple(r) for r in comm.all_gather_ints([len(trials), len(row)])]
        if len(set(shapes)) > 1:
            raise OwnerReduceMismatchError(
                f"owner_reduce on rank {comm.rank}: save_checkpoint: the ranks are at different points of the "
                f"measured guard's trials: "
                + by_value(shapes, lambda s: f"{count_noun(s[0], 'trial')} in a row of {s[1]} integers"))
        rows = comm.all_gather_ints(row)
        at = 0
        for trial in trials:
            width = rows[0][at]
            progress.append(trial.progress(slowest_progress([r[at + 1:at + 1 + width] for r in rows])))
            at += 1 + width
        return sorted(progress, key=lambda p: p.key)

    def restore(self, data: Any, source: str = "the checkpoint") -> None:
        """``engine.load_checkpoint``: the checkpoint's verdicts join the book (theirs win) and its schedules wait for
        their graphs' first backward, so the resumed run follows the same flushes with the same winners as the run
        that saved it, from its first step. Collective: every rank calls it (``load_checkpoint`` is), and the ranks
        agree on what they read, within the deadline; what every rank finds unusable is said once and dropped."""
        comm = self._comm
        try:
            # Looked up in this module at call time: the harness's fault injection replaces it here.
            book, recordings, trials = parse_checkpoint_payload(data, source)
            if book is not None:
                book.check_world_size(comm.world_size)
            dtypes = [[(getattr(torch, d), ids, numels) for d, ids, numels in r] for r in recordings]
            if any(not isinstance(d, torch.dtype) for r in dtypes for d, _, _ in r):
                raise ValueError(f"owner_reduce: {source}: a schedule names a dtype torch does not have")
        except (ValueError, AttributeError) as error:
            usable, reason = False, str(error).removeprefix("owner_reduce: ")
        else:
            usable, reason = True, None
        digest = int(payload_digest(data), 16) if usable else 0
        values = [row[0] for row in comm.all_gather_ints([digest])]
        if len(set(values)) > 1:
            raise OwnerReduceMismatchError(
                f"owner_reduce on rank {comm.rank}: the ranks read different owner_reduce state from {source}: "
                + by_value(values, lambda v: f"{v:012x}" if v else "unusable")
                + (f" (this rank: {reason})" if reason else ""))
        if not usable:
            if comm.rank == 0:
                from deepspeed.utils import logger

                logger.warning(f"owner_reduce: not resuming the verdicts and schedules of {source}: {reason}; they are "
                               f"learned and measured again")
            return
        if book is not None:
            self.book = book if self.book is None else self.book.merged(book)
            self.sources.update((s.key, source) for s in book.schedules)
        self._placer.restore_recordings(dtypes)
        self.resumed = {t.key: (t, source) for t in trials}
        if comm.rank == 0:
            verdicts = count_noun(len(book.schedules), "schedule's verdicts", "schedules' verdicts") if book else \
                "no verdicts"
            under_way = "".join(f", the measured guard's trial of schedule {t.key} after {t.steps} of its "
                                f"{2 * t.rounds} steps" for t in trials)
            emit(f"owner_reduce: restored from {source}: {count_noun(len(recordings), 'schedule', 'schedules')} as "
                 f"learned and {verdicts}{under_way}: the resumed run follows them from its first backward")
