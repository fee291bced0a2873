"""The step's reduction as one schedule: which option each flush runs, chosen for the whole step on the node and rail
streams, with the levels of consecutive two-level flushes overlapped.

Why a step and not a flush: a two-level flush's node step (a ReduceScatter on NVLink) and rail step (Reduces or a
ReduceScatter on the NICs) use different links, so flush ``i + 1``'s node step can run while flush ``i``'s rail step
does (``runtime.streams`` Note (two levels)): across flushes the overlap costs no latency, where more pipeline stages
inside one flush buy it at a chain's latency each (``collective_time`` Note (Reduce latency): 0.9 ms per Simple rail
Reduce at 64 nodes). Whether a flush should be two-level, and with how many stages, therefore depends on its
neighbours: a flush whose rail step is long is fine while the next flush's node step fills it; the last flush's is
exposed. So the options of every flush of a step are compared together.

The schedule (``Timeline``), the same rules the runtime's streams follow:

- a two-level flush's node stages run back to back on the node stream, each after the node stream's previous work
  and (the first) after its bucket is free; its rail stage ``k`` after node stage ``k`` and the rail stream's previous
  work; calls on the data-parallel communicator it adds (gradients that reach every rank) after both;
- a one-level flush (every call on the data-parallel communicator, which spans NVLink and the NICs) after everything
  before it on both streams, and everything after it waits for it;
- a bucket is free when the flush that used it last has ended (its copy-out runs after its last call); a dtype keeps
  ``buckets`` of them, used in turn (``runtime.buckets``: two with DeepSpeed's ``double_buffer``);
- the gradients are there at the start (compute and copies are not modelled, as in every flush time here): the
  step's reduction is the schedule's end, native's the sum of its flushes (one stream).

The choice (``plan_step``): the options of every flush, searched in order keeping every schedule state that no other
beats on every stream and bucket (the cheapest few hundred), so the step's end is minimal up to that bound; then two
bounds hold or the flush falls back to its best one-level option: a flush that runs alone (its rail step overlaps
neither neighbour's) is never modelled slower than native's calls for it, and the last flush's own time (its stages,
nothing before it in the way) is at most ``LAST_FLUSH_BOUND`` x native's for it, its tail being exposed after the
last gradient. Every rank computes the same plan from the same numbers. Pure: numbers in, indices out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .two_level import pipelined_us

LAST_FLUSH_BOUND = 1.5  # the last flush's own time against native's for its gradients (its tail is exposed)
_STATES_KEPT = 256  # schedule states kept per flush in the search (the cheapest, none beaten by another on every end)


@dataclass(frozen=True)
class FlushTimes:
    """One option of one flush as the streams see it: two-level stages (node, rail microseconds), then calls on the
    data-parallel communicator (``world_us``); a one-level option has no stages."""

    stages: tuple[tuple[float, float], ...] = ()
    world_us: float = 0.0

    @property
    def two_level(self) -> bool:
        return bool(self.stages)

    @property
    def alone_us(self) -> float:
        """The flush with nothing before it: its stages pipelined, then its data-parallel calls."""
        return (pipelined_us(self.stages) if self.stages else 0.0) + self.world_us


@dataclass(frozen=True)
class Step:
    """Where one flush of the schedule runs: its node step (start, end), its rail step's end, its end."""

    node_start: float
    node_end: float
    rail_end: float
    end: float


@dataclass(frozen=True)
class StepPlan:
    """The chosen option per flush and the schedule it makes."""

    picks: tuple[int, ...]
    steps: tuple[Step, ...]
    native_us: float  # native's step: its flushes one after another

    @property
    def end_us(self) -> float:
        return max((s.end for s in self.steps), default=0.0)

    @property
    def overlapped(self) -> bool:
        """Some flush's node step ran while the previous flush's rail step did: flushes overlap."""
        return any(b.node_start < a.end for a, b in zip(self.steps, self.steps[1:], strict=False))


def schedule(options: Sequence[FlushTimes], buckets: Sequence[int], per_bucket: int) -> tuple[Step, ...]:
    """The timeline of ``options`` (one per flush, in order) whose flushes use bucket ``buckets[i]`` (dtype and turn,
    any hashable per dtype with ``per_bucket`` turns; see the module docstring)."""
    state = _State()
    steps = []
    for option, bucket in zip(options, buckets, strict=True):
        state, step = state.after(option, bucket, per_bucket)
        steps.append(step)
    return tuple(steps)


@dataclass(frozen=True)
class _State:
    """The streams' ends and, per dtype, when each of its last ``per_bucket`` flushes ended (their buckets free)."""

    node: float = 0.0
    rail: float = 0.0
    freed: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (dtype key, ends of its last flushes, oldest first)

    def after(self, option: FlushTimes, dtype: int, per_bucket: int) -> tuple[_State, Step]:
        ends = dict(self.freed).get(dtype, ())
        free = ends[0] if len(ends) >= per_bucket else 0.0
        if not option.two_level:
            start = max(self.node, self.rail, free)
            end = start + option.world_us
            step = Step(start, end, end, end)
            node = rail = end
        else:
            node = start = max(self.node, free)
            rail = self.rail
            for node_us, rail_us in option.stages:
                node += node_us
                rail = max(rail, node) + rail_us
            end = max(node, rail) + option.world_us if option.world_us else rail
            step = Step(start, node, rail, end)
            if option.world_us:
                node = rail = end
        ends = (*ends, step.end)[-per_bucket:]
        freed = tuple(sorted({**dict(self.freed), dtype: ends}.items()))
        return _State(node, rail, freed), step

    def key(self) -> tuple[float, ...]:
        return (self.node, self.rail, *(t for _, ends in self.freed for t in ends))


def plan_step(options: Sequence[Sequence[FlushTimes]], native: Sequence[float], buckets: Sequence[int],
              per_bucket: int = 2) -> StepPlan:
    """The option per flush whose schedule ends first (see the module docstring). ``options[i][0]`` must be flush
    ``i``'s best one-level option (the fallback), ``native[i]`` native's time for its gradients, ``buckets[i]`` its
    dtype's key. Deterministic: the same inputs give the same plan on every rank."""
    if not options:
        return StepPlan((), (), 0.0)
    last = len(options) - 1
    states: list[tuple[_State, tuple[int, ...]]] = [(_State(), ())]
    for i, flush in enumerate(options):
        grown = []
        for state, picks in states:
            for j, option in enumerate(flush):
                if i == last and j and option.alone_us > LAST_FLUSH_BOUND * native[i]:
                    continue
                after, _ = state.after(option, buckets[i], per_bucket)
                grown.append((after, (*picks, j)))
        grown.sort(key=lambda sp: (max(sp[0].node, sp[0].rail), sp[0].rail, sp[0].node, sp[1]))
        kept: list[tuple[_State, tuple[int, ...]]] = []
        keys: list[tuple[float, ...]] = []
        for state, picks in grown:
            key = state.key()
            if any(len(k) == len(key) and all(a <= b for a, b in zip(k, key, strict=True)) for k in keys):
                continue  # another schedule is no later on any stream or bucket
            kept.append((state, picks))
            keys.append(key)
            if len(kept) == _STATES_KEPT:
                break
        states = kept
    picks = min(states, key=lambda sp: (max(sp[0].node, sp[0].rail), sp[1]))[1]
    picks = _alone_bound(options, native, buckets, per_bucket, picks)
    steps = schedule([options[i][j] for i, j in enumerate(picks)], buckets, per_bucket)
    native_us = sum(native)
    if max((s.end for s in steps), default=0.0) > native_us:  # the bounded search missed it: every flush one-level
        picks = (0,) * len(options)
        steps = schedule([flush[0] for flush in options], buckets, per_bucket)
    return StepPlan(tuple(picks), steps, native_us)


def runs_alone(steps: Sequence[Step]) -> tuple[bool, ...]:
    """Per flush of a schedule: whether it overlaps neither neighbour (its node step starts after the previous flush
    ended, and the next flush's starts after it ended), so that its own time is what it costs the step."""
    return tuple((i == 0 or step.node_start >= steps[i - 1].end)
                 and (i + 1 == len(steps) or steps[i + 1].node_start >= step.end) for i, step in enumerate(steps))


def _alone_bound(options: Sequence[Sequence[FlushTimes]], native: Sequence[float], buckets: Sequence[int],
                 per_bucket: int, picks: tuple[int, ...]) -> tuple[int, ...]:
    """A two-level flush that runs alone (its node step starts after the previous flush ended, and the next flush
    starts after it ended) may not be slower than native's calls for it: such a flush takes its one-level option,
    until none is left."""
    picks = list(picks)
    while True:
        steps = schedule([options[i][j] for i, j in enumerate(picks)], buckets, per_bucket)
        alone = [i for i, by_itself in enumerate(runs_alone(steps))
                 if picks[i] and by_itself and options[i][picks[i]].alone_us > native[i]]
        if not alone:
            return tuple(picks)
        picks[alone[0]] = 0
