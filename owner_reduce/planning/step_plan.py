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
  step's reduction is the schedule's end, native's its flushes one after another (one stream);
- the host is a resource too (Note (host)): it issues the flushes in order, each in its own time
  (``FlushTimes.issue_us``, ``host_cost``), and a flush's device work (a two-level flush's stage ``k``) starts no
  earlier than the host has issued it (stages ``1..k``); native's flushes likewise, with native's own issue time.

The choice (``plan_step``): the options of every flush, searched in order keeping every schedule state that no other
beats on every stream and bucket (the cheapest few hundred), so the step's end is minimal up to that bound; then two
bounds hold or the flush falls back to its best one-level option: a flush that runs alone (its rail step overlaps
neither neighbour's) is never modelled slower than native's calls for it, and the last flush's own time (its stages,
nothing before it in the way) is at most ``LAST_FLUSH_BOUND`` x native's for it, its tail being exposed after the
last gradient. Both bounds compare times alone with their issue on both sides. Every rank computes the same plan
from the same numbers. Pure: numbers in, indices out.

Note (host): NCCL launches a group's kernels at ``ncclGroupEnd``, after every call of the group is enqueued
(src/group.cc 598-760, NVIDIA/nccl v2.30.7-1), so a group's device work cannot start before its issue ends. The
runtime issues a flush's groups back to back (a two-level flush: stage by stage, its node group then its rail
group, then its data-parallel calls), without waiting for the device, and the next flush right after. So a flush
that runs alone costs its issue plus its device time, and a flush queued behind a long one has issued before its
stream is free: its issue is hidden. A hand-off's second group is issued while the first runs; only what its issue
exceeds the first group's device time by is exposed (``owner_layout``), charged with its device time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter, le

from .two_level import pipelined_us

LAST_FLUSH_BOUND = 1.5  # the last flush's own time against native's for its gradients (its tail is exposed)
_STATES_KEPT = 256  # schedule states kept per flush in the search (the cheapest, none beaten by another on every end)


@dataclass(frozen=True)
class FlushTimes:
    """One option of one flush as the streams and the host see it: two-level stages (node, rail device
    microseconds), then calls on the data-parallel communicator (``world_us``, device); a one-level option has no
    stages. ``issue_us``: the host's microseconds to issue it, in issue order: one per stage (its node and rail
    groups), then one for its data-parallel calls where it has any (a one-level option: that one only); entries
    left out cost nothing (Note (host))."""

    stages: tuple[tuple[float, float], ...] = ()
    world_us: float = 0.0
    issue_us: tuple[float, ...] = ()

    @property
    def two_level(self) -> bool:
        return bool(self.stages)

    @cached_property
    def host_us(self) -> float:
        """The host's time to issue the whole flush."""
        return sum(self.issue_us)

    def stage_issue(self, stage: int) -> float:
        return self.issue_us[stage] if stage < len(self.issue_us) else 0.0

    @cached_property
    def stage_issues(self) -> tuple[float, ...]:
        """``stage_issue`` of every stage, in order: read once per stage by every schedule state the search grows
        (cached: the plan's search advances hundreds of states by each option)."""
        return tuple(self.stage_issue(k) for k in range(len(self.stages)))

    @cached_property
    def world_issue(self) -> float:
        """The issue of the data-parallel calls (after every stage's)."""
        return sum(self.issue_us[len(self.stages):])

    @cached_property
    def alone_us(self) -> float:
        """The flush with nothing before it: issued, its stages pipelined behind their issue, then its
        data-parallel calls (Note (host))."""
        return _State().after(self, 0, 1)[1].end

    @property
    def device_us(self) -> float:
        """The flush alone without its issue: its stages pipelined, then its data-parallel calls."""
        return (pipelined_us(self.stages) if self.stages else 0.0) + self.world_us


@dataclass(frozen=True)
class Step:
    """Where one flush of the schedule runs: its node step (start, end), its rail step's end, its end, and when the
    host began and ended issuing it."""

    node_start: float
    node_end: float
    rail_end: float
    end: float
    issue_start: float = 0.0
    issue_end: float = 0.0


@dataclass(frozen=True)
class StepPlan:
    """The chosen option per flush and the schedule it makes."""

    picks: tuple[int, ...]
    steps: tuple[Step, ...]
    native_us: float  # native's step: its flushes one after another, each behind its issue
    times: tuple[FlushTimes, ...] = ()  # the picked option of each flush (device and host times)

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
    """The streams' ends, the host's (when it has issued everything so far: Note (host)) and, per dtype, when each of
    its last ``per_bucket`` flushes ended (their buckets free)."""

    node: float = 0.0
    rail: float = 0.0
    freed: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (dtype key, ends of its last flushes, oldest first)
    host: float = 0.0

    def after(self, option: FlushTimes, dtype: int, per_bucket: int) -> tuple[_State, Step]:
        node, rail, freed, host, step = _advance(self.node, self.rail, self.freed, self.host, option, dtype, per_bucket)
        return _State(node, rail, freed, host), Step(*step)


_Freed = tuple[tuple[int, tuple[float, ...]], ...]


def _advance(node: float, rail: float, freed: _Freed, host: float, option: FlushTimes, dtype: int, per_bucket: int
             ) -> tuple[float, float, _Freed, float, tuple[float, float, float, float, float, float]]:
    """``_State.after`` on plain values: the streams', buckets' and host's ends after ``option`` and its ``Step``'s
    fields. Plain values because the plan's search advances each of its few hundred kept states by every option of
    every flush (a frozen dataclass per state made the search the sizing's hot spot)."""
    ends: tuple[float, ...] = ()
    for key, value in freed:
        if key == dtype:
            ends = value
            break
    free = ends[0] if len(ends) >= per_bucket else 0.0
    issued = host
    # ``b if b > a else a`` is ``max(a, b)`` exactly (the first of equal values), without the call: this loop runs
    # for every stage of every option of every kept state.
    if not option.stages:
        host += option.host_us
        start = node  # max(node, rail, free, host)
        if rail > start:
            start = rail
        if free > start:
            start = free
        if host > start:
            start = host
        end = start + option.world_us
        step = (start, end, end, end, issued, host)
        node = rail = end
    else:
        if free > node:
            node = free
        start = None
        for (node_us, rail_us), issue in zip(option.stages, option.stage_issues, strict=True):
            host += issue
            if host > node:
                node = host
            if start is None:
                start = node
            node += node_us
            rail = (node if node > rail else rail) + rail_us
        if option.world_us:
            host += option.world_issue
            end = node  # max(node, rail, host)
            if rail > end:
                end = rail
            if host > end:
                end = host
            end += option.world_us
        else:
            end = rail
        step = (start, node, rail, end, issued, host)
        if option.world_us:
            node = rail = end
    ends = (*ends, end)[-per_bucket:]
    return node, rail, _with_ends(freed, dtype, ends), host, step


def _with_ends(freed: _Freed, dtype: int, ends: tuple[float, ...]) -> _Freed:
    """``freed`` with ``dtype``'s ends replaced (or added), by dtype key: what ``sorted({**dict(freed), dtype:
    ends}.items())`` gives, without the dict and the sort."""
    if len(freed) == 1 and freed[0][0] == dtype:
        return ((dtype, ends),)
    out = []
    placed = False
    for key, value in freed:
        if key == dtype:
            out.append((dtype, ends))
            placed = True
        else:
            if not placed and key > dtype:
                out.append((dtype, ends))
                placed = True
            out.append((key, value))
    if not placed:
        out.append((dtype, ends))
    return tuple(out)


def native_step_us(native: Sequence[FlushTimes | float]) -> float:
    """Native's step: its flushes one after another on one stream, each issued in turn by the host (Note (host))."""
    state = _State()
    for flush in native:
        state, _ = state.after(_times(flush), 0, 1)
    return state.rail


def _times(flush: FlushTimes | float) -> FlushTimes:
    """A flush's times, or a plain number as a one-level flush of that device time without issue."""
    return flush if isinstance(flush, FlushTimes) else FlushTimes(world_us=float(flush))


def plan_step(options: Sequence[Sequence[FlushTimes]], native: Sequence[FlushTimes | float], buckets: Sequence[int],
              per_bucket: int = 2) -> StepPlan:
    """The option per flush whose schedule ends first (see the module docstring). ``options[i][0]`` must be flush
    ``i``'s best one-level option (the fallback), ``native[i]`` native's times for its gradients (a number: its device
    time, without issue), ``buckets[i]`` its dtype's key. Deterministic: the same inputs give the same plan on every
    rank."""
    if not options:
        return StepPlan((), (), 0.0)
    native = [_times(n) for n in native]
    last = len(options) - 1
    # A state: (max(node, rail), rail, node, picks, freed, host), the first four its order (picks differ, so no ties).
    states: list[tuple[float, float, float, tuple[int, ...], _Freed, float]] = [(0.0, 0.0, 0.0, (), (), 0.0)]
    order = itemgetter(0, 1, 2, 3)
    for i, flush in enumerate(options):
        grown = []
        for _, rail0, node0, picks, freed0, host0 in states:
            for j, option in enumerate(flush):
                if i == last and j and option.alone_us > LAST_FLUSH_BOUND * native[i].alone_us:
                    continue
                node, rail, freed, host, _ = _advance(node0, rail0, freed0, host0, option, buckets[i], per_bucket)
                grown.append((max(node, rail), rail, node, (*picks, j), freed, host))
        grown.sort(key=order)
        kept: list[tuple[float, float, float, tuple[int, ...], _Freed, float]] = []
        seen: set[tuple[float, ...]] = set()
        by_length: dict[int, list[tuple[float, ...]]] = {}
        for state in grown:
            _, rail, node, _, freed, host = state
            key = (node, rail, host, *(t for _, ends in freed for t in ends))
            if key in seen:
                continue  # the same ends as a kept schedule's
            same = by_length.setdefault(len(key), [])
            if _dominated(same, key):
                continue  # another schedule is no later on any stream or bucket
            kept.append(state)
            seen.add(key)
            same.append(key)
            if len(kept) == _STATES_KEPT:
                break
        states = kept
    picks = min(states, key=lambda sp: (sp[0], sp[3]))[3]
    picks = _alone_bound(options, native, buckets, per_bucket, picks)
    steps = schedule([options[i][j] for i, j in enumerate(picks)], buckets, per_bucket)
    native_us = native_step_us(native)
    if max((s.end for s in steps), default=0.0) > native_us:  # the bounded search missed it: every flush one-level
        picks = (0,) * len(options)
        steps = schedule([flush[0] for flush in options], buckets, per_bucket)
    return StepPlan(tuple(picks), steps, native_us, tuple(options[i][j] for i, j in enumerate(picks)))


def _dominated(keys: list[tuple[float, ...]], key: tuple[float, ...]) -> bool:
    """Whether some key of ``keys`` is no later than ``key`` on every stream and bucket. The one found moves to the
    front, to be tried first from now on (a schedule that beats one candidate tends to beat the next; the answer
    does not depend on the order)."""
    for at, k in enumerate(keys):
        if all(map(le, k, key)):
            if at:
                keys.insert(0, keys.pop(at))
            return True
    return False


def runs_alone(steps: Sequence[Step]) -> tuple[bool, ...]:
    """Per flush of a schedule: whether it overlaps neither neighbour (its node step starts after the previous flush
    ended, and the next flush's starts after it ended), so that its own time is what it costs the step."""
    return tuple((i == 0 or step.node_start >= steps[i - 1].end)
                 and (i + 1 == len(steps) or steps[i + 1].node_start >= step.end) for i, step in enumerate(steps))


def _alone_bound(options: Sequence[Sequence[FlushTimes]], native: Sequence[FlushTimes], buckets: Sequence[int],
                 per_bucket: int, picks: tuple[int, ...]) -> tuple[int, ...]:
    """A two-level flush that runs alone (its node step starts after the previous flush ended, and the next flush
    starts after it ended) may not be slower than native's calls for it (both alone, issue included): such a flush
    takes its one-level option, until none is left."""
    picks = list(picks)
    while True:
        steps = schedule([options[i][j] for i, j in enumerate(picks)], buckets, per_bucket)
        alone = [i for i, by_itself in enumerate(runs_alone(steps))
                 if picks[i] and by_itself and options[i][picks[i]].alone_us > native[i].alone_us]
        if not alone:
            return tuple(picks)
        picks[alone[0]] = 0
