"""Where a gradient goes: into which bucket, at which offset, and when that bucket is complete and flushes.

Why its own module: this is the per-gradient hot path (microseconds count), and it is only about placement. A
graph's first backward is bucketed in arrival order, as DeepCompile does, and recorded; every later backward of
that graph copies each gradient, or each slice of a straddling one, to its place in an owner-ordered bucket
(``schedule``, ``planning.owner_layout``): owners ascending, AllReduce-only gradients last, laid out for the
algorithm the cost model chose for that flush. A bucket that is complete goes to the ``Flusher``; calls go one
way, placement to flush, never back.

Note (owner-ordered buckets): a flush's layout spans at most the bucket plus its padding (a ReduceScatter's short
regions, the last of a hand-off's equal chunks, the regions' 16-byte slots: ``planning.alignment``), so the bucket's
buffer grows by that much at most, in the first step that needs it (both buffers of the pair at one wait, kept across
releases: ``buckets`` Note (growth); a schedule on trial: Note (trial room)); no other buffer. A
backward that leaves the recorded order flushes what it placed and continues in arrival order, identically on every
rank (see ``schedule``), and the graph learns its schedule again.

Note (hot path): per scheduled gradient this costs one dictionary lookup, one schedule step and one copy per piece
into a view of the bucket made once per (bucket, flush) and kept with the bucket (``ReduceBucket.views``); no
stream or event call (``streams``), no allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..planning.collectives import NATIVE
from ..planning.exposure import ARRIVAL, MODELLED, NATIVE_TRIAL, OWNER
from ..planning.flush_choice import FlushCost
from ..planning.measured import NATIVE_VARIANT
from ..planning.owner_layout import OwnerLayout, StepLayouts, map_order, plan_owner_layout, plan_step_layouts
from ..planning.owner_map import OwnerMap
from .buckets import DoubleBufferedBuckets, ReduceBucket
from .flush import Flusher, Pending
from .schedule import Follower, Schedule, ScheduledFlush, learn
from .stats import RuntimeStats
from .streams import CudaStreams, HostStreams, make_streams
from .trial import TimedKey, Trial
from .trial_clock import SamplePoint, StreamClock, TrialClock

Recording = list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]]  # a schedule as learned: (dtype, ids, numels)

NOTES = """
Note (resumed schedules): a run resumed from a checkpoint would learn each graph's schedule again from an
arrival-order backward, whose calls (the arrival-order layout's) add the ranks' terms in another order than the
saved run's scheduled flushes did at that step. So each checkpoint keeps every schedule as learned (dtype, gradient
ids and sizes of each flush: ``recordings``), and after a resume the first backward of a graph whose first gradient
is a restored schedule's first gradient learns that schedule at once and follows it (with the book's verdicts:
``verdict_book``), as the saved run did. The match is the same on every rank (the same arrival sequence); a backward
that then leaves the schedule falls back and learns again, as any backward does (``schedule`` Note (identical on
every rank)). A recompile forgets learned schedules, not the restored ones.

Note (trial room): a schedule on trial (``trial``) alternates the model's layouts with native's, and native's can be
the larger (each gradient starts 16-byte aligned: ``planning.alignment``; DeepCompile packs them). So when the trial
starts, at the end of the learning backward, each dtype's buckets grow to hold the largest flush of either variant: one
host wait there, just before ``end_backward``'s own, and none in a timed step, where it would stall the variant being
measured. A schedule not on trial grows in its first step, as any flush does (``buckets`` Note (growth)).
"""


class GradPlacer:
    """Buckets, schedules and the copies into buckets, for one runtime (all graphs share the buckets)."""

    def __init__(self, owner_map: OwnerMap, reduce_to_owner: bool, buckets: DoubleBufferedBuckets, flusher: Flusher,
                 stats: RuntimeStats, cost: FlushCost, sync: Callable[[str], None],
                 on_learned: Callable[[Schedule], None] | None = None,
                 make_trial: Callable[[Schedule], Trial | Schedule | None] | None = None) -> None:
        self._owner_map = owner_map
        self._owner = reduce_to_owner
        self.buckets = buckets
        self._flusher = flusher
        self._stats = stats
        self._cost = cost
        self._sync = sync  # waits for the reduce stream within the deadline (before a bucket is replaced)
        self._on_learned = on_learned
        self._make_trial = make_trial  # the measured guard (``trial``), or the known winners; None: off
        self._trials: dict[int, Trial] = {}  # graph_id -> its running trial
        self.clock: TrialClock = StreamClock()  # where a trial's samples come from (``trial_clock``)
        self.streams: HostStreams | CudaStreams | None = None  # chosen from the first gradient's device
        self._pending: dict[torch.dtype, Pending] = {}
        self._schedules: dict[int, Schedule] = {}  # graph_id -> learned owner-ordered flushes (a trial's: the model's)
        self._map_order = map_order(owner_map)
        self._backward_graph: int | None = None  # the graph whose gradients this backward enqueues
        self._follower: Follower | None = None  # following a schedule in this backward
        self._recording: list[tuple[Any, tuple[int, ...], tuple[int, ...]]] | None = None  # arrival-order flushes
        self._restored: list[Recording] = []  # a checkpoint's schedules not adopted yet: Note (resumed schedules)
        self.last_backward = MODELLED  # how the last backward's flushes ran (``planning.exposure``: the probe's lines)

    # ---- one gradient ------------------------------------------------------------------------------------

    def add(self, ds_id: int, grad: torch.Tensor, graph_id: int) -> None:
        """Copy ``grad`` into its bucket; flush the bucket when it is complete (or would overflow)."""
        if self._backward_graph != graph_id:
            self._start(graph_id, ds_id, grad)
        follower = self._follower
        if follower is not None:
            step = follower.next(grad.dtype, ds_id, grad.numel())
            if step is not None:
                self._place(step, grad)
                return
            self._leave_schedule()
        self._append(ds_id, grad)

    def _place(self, step: tuple[ScheduledFlush, int, bool], grad: torch.Tensor) -> None:
        """A scheduled gradient: copy it (piece by piece) to its owner-ordered place; flush when its flush is done."""
        flush, index, last = step
        dtype = grad.dtype
        if index == 0:
            pending = self._begin_scheduled(flush, dtype, grad)
        else:
            pending = self._pending[dtype]
        targets = pending.views[index]
        if targets is None:
            targets = pending.views[index] = _targets(pending.bucket.buffer, flush.layout, index, grad)
        copy = pending.copy
        if targets.__class__ is torch.Tensor:  # a whole gradient (the common case)
            copy(targets, grad)
        else:
            flat = grad.reshape(-1)
            for dst, start, stop in targets:
                copy(dst, flat[start:stop])
        pending.count += 1
        if last:
            self._flush(dtype)

    def _begin_scheduled(self, flush: ScheduledFlush, dtype: torch.dtype, grad: torch.Tensor) -> Pending:
        """The first gradient of a scheduled flush: the bucket is empty here (a schedule's flushes of one dtype
        follow each other, and arrival-order gradients of this dtype were flushed when the schedule was left)."""
        bucket = self.buckets.for_tensor(grad)
        total = flush.layout.total
        if total > bucket.capacity:  # at most the padding beyond a right-sized bucket, in the first step only
            # Once for the whole schedule: room for its largest flush of this dtype (a follower is set here).
            self._grow(dtype, max(f.layout.total for f in self._follower.schedule.flushes[dtype]))
        bucket.offset = total
        streams = self._streams_for(grad.device)
        streams.bucket_acquired(bucket)
        cached = bucket.views.get(id(flush))
        if cached is None or cached[0] is not flush:  # the flush is kept alive by the entry: its id is not reused
            cached = bucket.views[id(flush)] = (flush, [None] * len(flush.ids))
        pending = self._pending[dtype] = Pending(bucket, streams.copy, scheduled=flush, views=cached[1])
        return pending

    def _append(self, ds_id: int, grad: torch.Tensor) -> None:
        """Arrival order (a graph's first backward, the AllReduce path, or after leaving a schedule)."""
        dtype = grad.dtype
        numel = grad.numel()
        bucket = self.buckets.for_tensor(grad)
        if bucket.offset and bucket.offset + numel > bucket.size:
            self._flush(dtype)
            bucket = self.buckets.for_tensor(grad)
        if numel > bucket.size:
            if numel > bucket.capacity:
                self._grow(dtype, numel)
            bucket.reserve(numel)
        pending = self._pending.get(dtype)
        if pending is None:
            streams = self._streams_for(grad.device)
            streams.bucket_acquired(bucket)
            pending = self._pending[dtype] = Pending(bucket, streams.copy)
        start = bucket.offset
        bucket.offset = start + numel
        # A basic slice makes the view faster than narrow() does (about 1.2 vs 1.8 µs on this host).
        pending.copy(bucket.buffer[start:start + numel], grad if grad.dim() == 1 else grad.reshape(-1))
        pending.ids.append(ds_id)
        pending.numels.append(numel)
        pending.count += 1

    def _room_for(self, schedules: Sequence[Schedule]) -> None:
        """Each dtype's buckets grown to hold the largest flush of any of ``schedules`` (Note (trial room))."""
        for dtype in {d for s in schedules for d in s.flushes}:
            need = max(f.layout.total for s in schedules for f in s.flushes.get(dtype, ()))
            if need > self.buckets.capacity_for(dtype):
                self._grow(dtype, need)

    def _grow(self, dtype: torch.dtype, numel: int) -> None:
        """Both buffers of ``dtype``'s pair to ``numel`` elements, kept across releases (``buckets`` Note (growth)):
        only when a flush needs more than any before it, so never in a steady-state step."""
        self._sync("bucket growth")  # a buffer being replaced may still be read by a flush in flight
        self.buckets.grow(dtype, numel)
        self._flusher.buffers_replaced()

    def _streams_for(self, device: torch.device) -> HostStreams | CudaStreams:
        streams = self.streams
        if streams is None:
            streams = self.streams = make_streams(device)
        return streams

    # ---- flushes -----------------------------------------------------------------------------------------

    def _flush(self, dtype: torch.dtype) -> None:
        pending = self._pending.pop(dtype, None)
        if pending is None or not pending.count:
            return
        if pending.scheduled is None and self._recording is not None:
            self._recording.append((dtype, tuple(pending.ids), tuple(pending.numels)))
        try:
            self._flusher.flush(pending, self.streams)
        finally:
            self.buckets.swap(dtype)  # even after an error: the next flush must not find a half-used bucket

    def end_backward(self) -> None:
        """Flush what is left (leaving a schedule this backward did not finish), then learn from this backward; a
        graph on trial that followed its schedule in full goes on to the other variant."""
        follower = self._follower
        completed = follower is not None and follower.complete()
        if follower is not None and not completed:
            self._leave_schedule()  # this backward ended before its schedule did
        for dtype in list(self._pending):
            self._flush(dtype)
        self.step_end()
        graph = self._backward_graph
        self._end_schedule(learn_graph=True)
        trial = self._trials.get(graph) if completed else None
        self.last_backward = (MODELLED if not self._owner else ARRIVAL if not completed
                              else NATIVE_TRIAL if trial is not None and trial.steps % 2 == NATIVE_VARIANT else OWNER)
        if trial is not None:
            trial.step_done()
            self._stats.trial_steps += 1

    @property
    def has_pending(self) -> bool:
        """A bucket holds gradients not flushed yet (``end_backward`` will flush it)."""
        return bool(self._pending)

    # ---- owner-ordered schedules -------------------------------------------------------------------------

    def _start(self, graph_id: int, ds_id: int, grad: torch.Tensor) -> None:
        """The first gradient of a backward (or of another graph in it): follow the graph's schedule (or a restored
        one whose first gradient this is), or record this backward's arrival-order flushes to learn one."""
        if self._backward_graph is not None:
            # Two graphs in one backward: leave any schedule, and learn nothing from it (the record is mixed).
            if self._follower is not None:
                self._leave_schedule()
            self._recording = None
            self._backward_graph = graph_id
            return
        self._backward_graph = graph_id
        if not self._owner:
            return
        if graph_id not in self._schedules and self._restored:
            self._adopt(graph_id, grad.dtype, ds_id, grad.numel())
        trial = self._trials.get(graph_id)  # on trial: the variant this backward runs (``trial``)
        schedule = trial.current() if trial is not None else self._schedules.get(graph_id)
        if schedule is not None:
            self._follower = Follower(schedule)
        else:
            self._recording = []

    def _adopt(self, graph_id: int, dtype: torch.dtype, ds_id: int, numel: int) -> None:
        """Learn a restored schedule for ``graph_id`` now if its first gradient of ``dtype`` is this one (Note (resumed
        schedules)); it is adopted once."""
        for i, recording in enumerate(self._restored):
            first = next(((ids[0], numels[0]) for d, ids, numels in recording if d == dtype and ids), None)
            if first == (ds_id, numel):
                del self._restored[i]
                self._learn(graph_id, recording)
                self._stats.schedules_restored += 1
                return

    def _leave_schedule(self) -> None:
        """This backward left its schedule: flush what was placed (the pieces present, planned where they lie),
        then continue in arrival order; drop the schedule so that the next backward learns it again."""
        follower, self._follower = self._follower, None
        if follower is None:
            return
        for dtype in [d for d, p in self._pending.items() if p.scheduled is not None]:
            self._flush(dtype)
        self._schedules.pop(follower.schedule.graph_id, None)
        if self._trials.pop(follower.schedule.graph_id, None) is not None:
            self._timed_changed()
        self._recording = None
        self._stats.schedule_fallbacks += 1

    def _end_schedule(self, learn_graph: bool = False) -> None:
        recording, graph = self._recording, self._backward_graph
        self._recording = self._follower = self._backward_graph = None
        if learn_graph and recording and graph is not None:
            self._learn(graph, recording)

    def _learn(self, graph: int, recording: Recording) -> None:
        """``graph``'s schedule from ``recording``; its trial starts, or its known verdicts' winners are installed."""
        schedule = learn(graph, recording, self._step_layouts)
        self._schedules[graph] = schedule
        self._stats.schedules_learned += 1
        if self._on_learned is not None:
            self._on_learned(schedule)
        trial = self._make_trial(schedule) if self._make_trial is not None else None
        if isinstance(trial, Schedule):  # its verdicts were known (``verdict_book``): the winners, untimed
            self._schedules[graph] = trial
        elif trial is not None and trial.needed:
            self._trials[graph] = trial
            self._timed_changed()
            self._room_for(trial.schedules)

    # ---- checkpoints: Note (resumed schedules) -------------------------------------------------------------

    def recordings(self) -> list[Recording]:
        """Every schedule as learned (per dtype, in its order), and the restored ones not adopted yet."""
        learned = [[(dtype, f.ids, f.numels) for dtype, flushes in s.flushes.items() for f in flushes]
                   for s in self._schedules.values()]
        return learned + [list(r) for r in self._restored]

    def restore_recordings(self, recordings: list[Recording]) -> None:
        self._restored = [list(r) for r in recordings]

    def _step_layouts(self, flushes: Sequence[tuple[torch.dtype, Sequence[tuple[int, int]]]]) -> StepLayouts:
        """A learned schedule's flushes laid out together for the step (``owner_layout.plan_step_layouts``), with the
        buffers a dtype keeps (two when double-buffered)."""
        # Looked up in this module at call time: the harness's fault injection replaces it here.
        return plan_step_layouts(flushes, self._owner_map, self._owner, capacity=self.buckets.size,
                                 cost_of=lambda dtype: self._cost.for_dtype_bytes(dtype.itemsize),
                                 order=self._map_order, per_bucket=self.buckets_per_dtype)

    @property
    def buckets_per_dtype(self) -> int:
        """What a dtype's flushes take turns on (``buckets``): the step's plan schedules bucket reuse with it."""
        return 2 if self.buckets.double_buffer else 1

    def _layout_of(self, dtype: torch.dtype, grads: list[tuple[int, int]], cost: FlushCost | None = None
                   ) -> OwnerLayout:
        capacity = max([self.buckets.size] + [n for _, n in grads])
        cost = (self._cost if cost is None else cost).for_dtype_bytes(dtype.itemsize)
        # Looked up in this module at call time: the harness's fault injection replaces it here.
        return plan_owner_layout(grads, self._owner_map, self._owner, order=self._map_order, capacity=capacity,
                                 cost=cost)

    def native_layout(self, flush: ScheduledFlush) -> OwnerLayout:
        """``flush`` laid out as native's calls (a trial's other variant)."""
        return self._layout_of(flush.dtype, list(zip(flush.ids, flush.numels, strict=True)),
                               replace(self._cost, force=NATIVE))

    # ---- the measured guard (``trial``) ------------------------------------------------------------------

    @property
    def trials_running(self) -> bool:
        return bool(self._trials)

    def _timed_changed(self) -> None:
        """The flusher times exactly the running trials' flushes, or steps (``TimedKey``)."""
        timed = {flush_id: TimedKey(graph, *key) for graph, trial in self._trials.items()
                 for flush_id, key in trial.timed.items()}
        self._flusher.timed = timed or None
        if not timed:
            self._flusher.marks.clear()
            self._flusher.step_start = None

    def step_end(self) -> None:
        """The end of a backward whose step is timed as a whole: its end mark (``trial`` Note (timing)), before the
        host waits."""
        started = self._flusher.step_start
        if started is not None and self.streams is not None:
            self._flusher.step_start = None
            self._flusher.marks.append((started[0], started[1], self.streams.step_end_mark()))

    def take_marks(self) -> None:
        """After the reduce stream was waited: each timed flush's (or step's) time goes to its trial."""
        marks = self._flusher.marks
        streams = self.streams
        for key, start, end in marks:
            trial = self._trials.get(key.graph)
            if trial is not None and streams is not None:
                point = SamplePoint(trial.key, key.index, key.variant, len(trial.samples[key.index][key.variant]))
                trial.add_sample(key.index, key.variant, self.clock.sample_us(point, streams, start, end))
                self._stats.trial_native_flushes += key.variant == NATIVE_VARIANT
        marks.clear()

    def running_trials(self) -> list[Trial]:
        """The trials under way, in the order of their keys (the same on every rank: graph ids are not)."""
        return sorted(self._trials.values(), key=lambda trial: trial.key)

    def finished_trials(self) -> list[tuple[int, Trial]]:
        return [(graph, trial) for graph, trial in self._trials.items() if trial.done]

    def install(self, graph_id: int, schedule: Schedule) -> None:
        """A trial's verdict: the graph follows ``schedule`` from now on, untimed."""
        self._trials.pop(graph_id, None)
        self._schedules[graph_id] = schedule
        self._timed_changed()

    # ---- lifetime ----------------------------------------------------------------------------------------

    def release_buckets(self) -> None:
        """As deepcompile.cpp's end_backward with ``release_reduce_buckets``: the next flush allocates again (at the
        capacity the buckets grew to)."""
        self.buckets.release()
        self._flusher.buffers_replaced()

    def forget_schedules(self, graph_id: int | None = None) -> None:
        """Forget the schedule learned for ``graph_id`` (None: for every graph): the id names another graph now
        (the handle's Note (graph ids)); that graph learns its own from its next backward."""
        if graph_id is None:
            self._schedules.clear()
            self._trials.clear()
        else:
            self._schedules.pop(graph_id, None)
            self._trials.pop(graph_id, None)
        self._timed_changed()

    def clear(self) -> None:
        self._pending.clear()
        self._schedules.clear()
        self._trials.clear()
        self._timed_changed()
        self._end_schedule()
        self.buckets.clear()


def _targets(buffer: torch.Tensor, layout: OwnerLayout, index: int, grad: torch.Tensor) -> Any:
    """Where gradient ``index`` of a scheduled flush goes in ``buffer``: one view shaped like the gradient when it
    goes whole (copy_ takes any strides), else (view, start, stop) per piece of the flattened gradient."""
    placed = layout.grads[index]
    pieces = placed.pieces
    numel = grad.numel()
    if len(pieces) == 1 and pieces[0].length == numel:
        at = pieces[0].bucket_offset
        return buffer[at:at + numel].view(grad.shape)
    return [(buffer[p.bucket_offset:p.bucket_offset + p.length], p.src_offset, p.src_offset + p.length)
            for p in pieces]


__all__ = ["GradPlacer", "ReduceBucket"]
