"""Which algorithm a flush runs: the cheapest one by NCCL's alpha-beta model, chosen alike on every rank.

Why a choice per flush: the owner path moves half the bytes of an AllReduce, but every NCCL call pays a latency
that grows with the ranks. A flush that holds part of the model touches a few owners; one Reduce per owner then
costs a ring latency over all ranks each (about a millisecond at 512 ranks), and a latency-bound flush is
cheapest as one AllReduce. So each flush is costed on ``collective_time``'s model for each candidate and the
cheapest runs:

- ``reduce_scatter``: one ReduceScatter over the owner regions padded to equal size (a flush that covers every
  rank with near-equal regions: ZeRO's own flat layout);
- ``reduce``: one Reduce per owner the flush touches, a larger region cut into consecutive Reduces to its owner
  where that lets NCCL's planner run them as one aggregate, one chain's latency (``aggregation``);
- ``handoff``: one ReduceScatter over the flush cut into ``world_size`` equal chunks, then one grouped send/recv
  round that moves each reduced chunk's pieces to the ranks that own them (each rank receives exactly what it keeps);
- ``allreduce``: one AllReduce of the whole flush (what the native runtime sends, in one call);
- ``two_level``: where ranks form whole nodes over a network, a ReduceScatter in each node, then each owner's region
  reduced across nodes on its rail, pipelined (``two_level``); costed on the node and rail topologies.
Gradients that must reach every rank (another communicator, whole-gradient optimizers) add one AllReduce to the
first three. Every candidate is costed with its host time (``host_cost``): the runtime issues a flush's calls before
NCCL launches them, so a candidate alone costs its issue plus its device time, and a cut, a stage or a hand-off that
adds calls must save more latency than its calls cost to issue. ``allreduce`` is always a candidate, and one
AllReduce of a flush is never modelled slower on the device than the native runtime's one AllReduce per gradient
(the model is subadditive; ``tests/pure/test_flush_choice.py`` checks it), so no flush is modelled slower than native's
calls issued by this runtime, and slower than native DeepCompile's own (its C++ loop) at most by what this runtime
needs to issue one call: Python costs the host more than C++ (``host_cost``'s defaults).

Identical on every rank: the inputs are the flush's layout, the world size, the topology the ranks agreed on at
init and the dtype; the arithmetic is the same Python on every rank, so the same candidate wins everywhere.
The config's ``compile.reduce_to_owner_algo`` forces a candidate where it applies (``planning.settings``); ``auto``
is the default.
Pure: numbers in, a name out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from . import algorithms
from .collective_time import Topology, aggregates, group_time_us, p2p_load, p2p_round_us, topology_of
from .collectives import ALLREDUCE, NATIVE, REDUCE, Collective, Transfer, collectives_of
from .flush_plan import ALL, FlushPlan, FlushRange, merge_ranges
from .host_cost import DEFAULT as DEFAULT_HOST
from .host_cost import HostCost
from .two_level import TwoLevel

AUTO = "auto"


def force_values() -> tuple[str, ...]:
    """What ``FlushCost.force`` may be: ``auto`` and every algorithm the registry lets be forced (``algorithms``;
    ``reduce_scatter`` cannot be: it needs every owner present)."""
    return (AUTO, *algorithms.forceable())


class CallTimes(Protocol):
    """Measured times in place of NCCL's tables (``planning.calibration.Calibration``)."""

    def call_us(self, kind: str, nbytes: int) -> float: ...

    def p2p_round_us(self, peers: int, max_bytes: int) -> float: ...

    def host_cost(self, default: HostCost) -> HostCost: ...


@dataclass(frozen=True)
class FlushCost:
    """What the choice needs besides the layout: the topology (None: one rank, nothing to cost), bytes per element,
    a forced candidate (``auto``: the cheapest), the hand-off's bandwidth scale (the docs' sensitivity rows), and a
    cluster's measured call times (``calibration``: used in place of NCCL's tables where given), and the node and
    rail communicators of a two-level flush (None: not a candidate), and the host's cost of a call (``host``; a
    calibration that measured it replaces it: ``host_cost``). A calibration times the data-parallel communicator
    only, so under one the two-level flush is a candidate only when forced (then on NCCL's tables)."""

    topology: Topology | None
    dtype_bytes: int = 2
    force: str = AUTO
    p2p_bw_scale: float = 1.0
    calibration: CallTimes | None = None
    two_level: TwoLevel | None = None
    host: HostCost = DEFAULT_HOST

    def __post_init__(self) -> None:
        allowed = force_values()
        if self.force not in allowed:
            raise ValueError(f"owner_reduce: flush algorithm must be one of {', '.join(allowed)}, got {self.force!r}")
        if self.dtype_bytes < 1:
            raise ValueError(f"owner_reduce: dtype_bytes must be positive, got {self.dtype_bytes}")
        if not 0 < self.p2p_bw_scale <= 1:
            raise ValueError(f"owner_reduce: p2p_bw_scale must be in (0, 1], got {self.p2p_bw_scale}")

    def calls_us(self, calls: Iterable[tuple[str, int]]) -> float:
        """Modelled time of one group of calls given as (kind, elements): NCCL's planner on its tables
        (``collective_time.group_time_us``), or the same aggregates timed by the calibration."""
        if self.topology is None:
            return 0.0
        b = self.dtype_bytes
        in_bytes = [(kind, count * b) for kind, count in calls]
        if self.calibration is not None:
            return sum(self.calibration.call_us(a.kind, a.nbytes) for a in aggregates(in_bytes))
        return group_time_us(in_bytes, self.topology)

    def native_us(self, numels: Iterable[int]) -> float:
        """What DeepCompile's runtime sends for this flush, one AllReduce per gradient in one group, alone: its host
        issue (native's, ``HostCost.native_issue_us``) then its device time."""
        gpu, issue = self.native_parts(numels)
        return gpu + issue

    def native_parts(self, numels: Iterable[int]) -> tuple[float, float]:
        """(device us, host us) of native DeepCompile's calls for a flush of gradients of ``numels`` elements."""
        counts = [n for n in numels if n]
        if self.topology is None:
            return 0.0, 0.0
        return self.calls_us((ALLREDUCE, n) for n in counts), self.host_cost.native_issue_us(len(counts))

    @property
    def host_cost(self) -> HostCost:
        """The host's cost of a call: the calibration's measurement where it has one, else ``host``."""
        if self.calibration is not None:
            return self.calibration.host_cost(self.host)
        return self.host

    def issue_us(self, calls: int, groups: int = 1, stages: int = 0) -> float:
        """Host time for this runtime to issue ``calls`` calls in ``groups`` groups (none without a topology: one
        rank issues nothing)."""
        if self.topology is None:
            return 0.0
        return self.host_cost.issue_us(calls, groups, stages)

    def group_us(self, calls: Sequence[tuple[str, int]]) -> float:
        """One group of (kind, elements) calls issued by this runtime, alone: its issue then its device time (what
        the cut of Reduces weighs, ``aggregation``)."""
        return self.calls_us(calls) + self.issue_us(sum(1 for _, n in calls if n))

    def handoff_us(self, transfers: Sequence[Transfer]) -> float:
        """Modelled time of the send/recv round that moves ``transfers`` (the busiest sender or receiver)."""
        if self.topology is None or not transfers:
            return 0.0
        b = self.dtype_bytes
        load = p2p_load([(t.src, t.dst, t.count * b) for t in transfers], self.topology.gpus_per_node,
                        self.topology.ranks)
        if self.calibration is not None:
            return self.calibration.p2p_round_us(load.peers, max(load.remote_bytes, load.local_bytes))
        return p2p_round_us(load, self.topology, self.p2p_bw_scale)

    def for_dtype_bytes(self, dtype_bytes: int) -> FlushCost:
        return self if dtype_bytes == self.dtype_bytes else replace(self, dtype_bytes=dtype_bytes)


def agreed_topology(world_size: int, ranks_per_node: Sequence[int], sm_majors: Sequence[int],
                    nvlinks: Sequence[int] = ()) -> Topology | None:
    """The topology every rank models, from every rank's facts (the same lists everywhere, so the same result):
    ranks per node the largest any rank reported (0: unknown; all unknown: one node), Ampere constants when every
    GPU is sm_8x, Hopper's otherwise (also on CPU), NVLinks per GPU the fewest any rank reported (0: the generation's;
    the slowest node bounds every ring). None for one rank: nothing to cost.

    Hopper is modelled with NVSwitch multicast (NVLS / NVLS_TREE for native's AllReduces): the faster native is
    assumed, so the model picks the owner path only where it beats the strongest baseline; a cluster without
    NVLS only loses some of the win, and the measured guard checks the choice on the cluster itself."""
    if world_size <= 1:
        return None
    known = [r for r in ranks_per_node if r > 0]
    per_node = min(max(known), world_size) if known else world_size
    generation = "ampere" if sm_majors and all(m == 8 for m in sm_majors) else "hopper"
    links = min((n for n in nvlinks if n > 0), default=None)
    return topology_of(world_size, per_node, generation, links=links)


def choose(costs: Mapping[str, float], force: str = AUTO, calls: Mapping[str, int] | None = None) -> str:
    """The candidate that runs: the forced one if it is among ``costs``, else the cheapest; ties go to the fewest
    ``calls`` (each candidate's calls where known: a Reduce per owner may be cut into several, ``aggregation``), then
    to the one registered first (``algorithms``: the registry's order)."""
    if force != AUTO and force in costs:
        return force
    counts = calls or {}
    rank = algorithms.tie_rank
    return min((c for c in algorithms.names() if c in costs), key=lambda c: (costs[c], counts.get(c, 0), rank(c)))


@dataclass(frozen=True)
class ArrivalChoice:
    """An arrival-order flush (a graph's first backward, or one that left its schedule), as it will run."""

    plan: FlushPlan  # counters and ranges of what actually runs (all on ALL when AllReduce won)
    collectives: tuple[Collective, ...]
    choice: str  # reduce (the plan's runs), allreduce (the span) or native (each run of pieces present)


def all_reduced(plan: FlushPlan, offset: int, span: int) -> FlushPlan:
    """``plan`` as one AllReduce of bucket elements ``[offset, offset + span)``: nothing takes the owner path."""
    ranges = (FlushRange(offset, span, ALL),) if span else ()
    return replace(plan, ranges=ranges, owner_tasks=0, owner_elems=0)


def choose_arrival(plan: FlushPlan, cost: FlushCost, native: Sequence[FlushRange] | None = None) -> ArrivalChoice:
    """An arrival-order flush (or the pieces of a flush that left its schedule, holes between them): the cheapest,
    host issue included (``FlushCost.group_us``), of the plan's own calls (one per run of owners, AllReduce for the
    rest), one AllReduce over the span of its ranges (holes included, so only when they are small), and ``native``:
    one AllReduce per range of ``native`` (an arrival-order flush passes its gradients: exactly what z1.cpp issues)
    or, by default, per run of pieces present (never the holes). ``handoff`` cannot apply (owners interleave):
    forcing it leaves the choice to the model."""
    per_run = collectives_of(plan.ranges)
    if all(c.kind == ALLREDUCE for c in per_run) and len(per_run) <= 1:
        return ArrivalChoice(plan, per_run, ALLREDUCE if per_run else "none")
    offset = min(r.offset for r in plan.ranges)
    span = max(r.offset + r.count for r in plan.ranges) - offset
    present = merge_ranges(replace(r, root=ALL) for r in plan.ranges) if native is None else tuple(native)
    costs = {REDUCE: cost.group_us([(c.kind, c.count) for c in per_run]),
             ALLREDUCE: cost.group_us([(ALLREDUCE, span)]),
             NATIVE: cost.group_us([(ALLREDUCE, r.count) for r in present])}  # issued by this runtime, one group
    choice = choose(costs, cost.force)
    if choice == ALLREDUCE:
        whole = all_reduced(plan, offset, span)
        return ArrivalChoice(whole, collectives_of(whole.ranges), ALLREDUCE)
    if choice == NATIVE:
        pieces = replace(plan, ranges=tuple(present), owner_tasks=0, owner_elems=0)
        return ArrivalChoice(pieces, collectives_of(pieces.ranges), NATIVE)
    return ArrivalChoice(plan, per_run, REDUCE)
