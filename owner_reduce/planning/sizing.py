"""Size the win of the owner path for one layout: bytes delivered, collective calls, ring-model time.

Why a pure module: the numbers follow from three things only, the owner map (DeepSpeed's own ZeRO-1
partitioning, read by ``engine_tables``), the order in which gradients reach the reduce bucket, and the
bucket size. Keeping torch.distributed out of here lets the arithmetic be tested on hand-built maps with
known answers, while ``sizing_engine`` obtains the real map from a fake-process-group engine.

Model (DESIGN.md, "Performance model"), per rank, bandwidth-bound, ring:
- AllReduce of S elements: every rank sends (and receives) 2(n-1)/n * S, so time 2(n-1)/n * S/B.
- Reduce of S elements to one root (pipelined chain): every rank but the root sends S, time S/B.
- Reduces to different roots inside one NCCL group run together; a rank sends every range whose root it
  is not, so a bucket split evenly over the n owners costs (n-1)/n * S/B, like a ReduceScatter.
Times are kept in units of "elements sent by the busiest rank"; divide by B (elements/s) for seconds.
Three paths are compared: ``native`` (DeepCompile today: one AllReduce per gradient), ``owner`` (the
proposal: single-owner gradients Reduce to their owner, straddling ones AllReduce, ranges merged per run)
and ``sliced`` (what ``reduce_to_owner`` does: every partition's slice of a straddling gradient also reduces
to its owner, so every element goes to exactly one rank). Both come from ``flush_plan.plan_flush``.
A fourth, ``layout``, is what ``reduce_to_owner`` runs: the owner-ordered bucket (``owner_layout``) with each
flush's algorithm chosen by NCCL's alpha-beta model (``flush_choice``: one Reduce per owner, one ReduceScatter,
a ReduceScatter with an owner hand-off, or one AllReduce). Calls per flush matter because each NCCL call pays a
latency: ``collective_time`` estimates each flush with NCCL's own tuning model on a named topology. ``previous``
is the owner-ordered bucket before the choice (one ReduceScatter where it covers every rank, else one Reduce per
owner), kept to show what the choice changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .calls import ALLREDUCE, HANDOFF, NODE, NODE_HANDOFF, RAIL, REDUCE, REDUCE_SCATTER, KindTable
from .collective_time import Topology, topology_of
from .collectives import Collective
from .flush_choice import CallTimes, FlushCost
from .flush_plan import ALL, BucketEntry, FlushRange, plan_flush
from .owner_layout import OwnerLayout, StepLayouts, collectives_of, cost_step_choices, map_order, plan_step_layouts
from .owner_map import OwnerMap, Placement
from .step_plan import runs_alone
from .two_level import two_level_of
from .wording import count_noun

# Bytes per element of the gradient dtypes DeepCompile reduces.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}

DEFAULT_BUCKET_SIZE = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default (elements)
HANDOFF_SENSITIVITY = (0.5, 0.25)  # the hand-off's network bandwidth scales the docs show (issue 20 item 3)


@dataclass(frozen=True)
class Cluster:
    """The machine the sizing models: ranks per node, GPU generation, NVSwitch multicast (NVLS / NVLS_TREE for
    native's AllReduces), the hand-off's bandwidth scale, and a cluster's measured call times (a calibration file,
    ``planning.calibration``) that replace NCCL's tables where given. The default is the runtime's own assumption
    (``flush_choice.agreed_topology`` on Hopper): 8 GPUs per node on NVSwitch with NVLS."""

    ranks_per_node: int = 8
    generation: str = "hopper"
    nvls: bool = True
    p2p_bw_scale: float = 1.0
    calibration: CallTimes | None = None
    # The rail's ring graph has sameChannels, as NCCL's search gives it: its table picks the rail's protocols with one
    # hop of latency per Reduce; the time is physical either way (``collective_time`` Note (Reduce latency)).
    rail_same_channels: bool = True
    two_level: bool = True  # the two-level flush is a candidate where the ranks form whole nodes
    nvlinks: int | None = None  # NVLinks per GPU (None: the generation's, ``collective_time.NVLINKS``)

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks per node must be at least 1, got {self.ranks_per_node}")
        if self.nvls and self.generation != "hopper":
            raise ValueError(f"NVLS needs Hopper or later; GPU generation {self.generation!r} has none (--no-nvls)")
        if self.nvlinks is not None and self.nvlinks < 1:
            raise ValueError(f"NVLinks per GPU must be at least 1, got {self.nvlinks}")

    def topology(self, world_size: int) -> Topology | None:
        """NCCL's model of ``world_size`` ranks on this cluster (None for one rank: nothing to cost). Any world
        size works: a last node partly filled is modelled as such (``collective_time.topology_of``)."""
        if world_size <= 1:
            return None
        return topology_of(world_size, self.ranks_per_node, self.generation, nvls=self.nvls, links=self.nvlinks)

    def cost(self, world_size: int, dtype_bytes: int) -> FlushCost:
        topology = self.topology(world_size)
        return FlushCost(topology, dtype_bytes, p2p_bw_scale=self.p2p_bw_scale, calibration=self.calibration,
                         two_level=two_level_of(topology, self.ranks_per_node,
                                                rail_same_channels=self.rail_same_channels,
                                                p2p_bw_scale=self.p2p_bw_scale)
                         if self.two_level else None)

    def with_p2p_scale(self, scale: float) -> Cluster:
        return replace(self, p2p_bw_scale=scale)


# ---- where the elements are ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementShare:
    """Parameters and elements by placement; ``share`` is what the owner path can take whole."""

    params: int
    elems: int
    single_owner_params: int
    single_owner_elems: int
    straddling_params: int
    straddling_elems: int
    other_comm_params: int
    other_comm_elems: int

    @property
    def share(self) -> float:
        return self.single_owner_elems / self.elems if self.elems else 0.0


def element_share(owner_map: OwnerMap) -> ElementShare:
    def tally(kind: Placement) -> tuple[int, int]:
        chosen = [p.numel for p in owner_map if p.placement is kind]
        return len(chosen), sum(chosen)

    one = tally(Placement.ONE_OWNER)
    straddles = tally(Placement.STRADDLES)
    other = tally(Placement.OTHER_COMM)
    return ElementShare(params=len(owner_map), elems=sum(p.numel for p in owner_map),
                        single_owner_params=one[0], single_owner_elems=one[1],
                        straddling_params=straddles[0], straddling_elems=straddles[1],
                        other_comm_params=other[0], other_comm_elems=other[1])


# ---- bytes delivered per rank per step --------------------------------------------------------------------


@dataclass(frozen=True)
class RankStat:
    """One quantity over the ranks: the mean, the smallest and the largest value, and each rank's value."""

    mean: float
    min: int
    max: int
    per_rank: tuple[int, ...] = field(repr=False)

    @classmethod
    def of(cls, values: Sequence[int]) -> RankStat:
        values = tuple(int(v) for v in values)
        if not values:
            return cls(0.0, 0, 0, ())
        return cls(mean=sum(values) / len(values), min=min(values), max=max(values), per_rank=values)


@dataclass(frozen=True)
class DeliveredBytes:
    """Bytes of reduced results that arrive at each rank in one step (one backward), per path.

    Delivered, not sent: what a rank receives back from the reduction. On the AllReduce path every rank
    receives every element; on the owner path a rank receives the single-owner gradients it owns plus every
    gradient that still goes through AllReduce; ``kept`` is what the rank's optimizer partition actually
    uses (the rest of what arrives is discarded).
    """

    dtype_bytes: int
    world_size: int
    allreduce: RankStat
    owner: RankStat
    sliced: RankStat
    kept: RankStat

    @property
    def owner_over_allreduce(self) -> float:
        """Mean delivered bytes on the owner path as a share of the AllReduce path's."""
        return self.owner.mean / self.allreduce.mean if self.allreduce.mean else 1.0


def delivered_bytes(owner_map: OwnerMap, dtype_bytes: int = 2) -> DeliveredBytes:
    n = owner_map.dp_world_size
    total = sum(p.numel for p in owner_map)
    everyone = sum(p.numel for p in owner_map if p.placement is not Placement.ONE_OWNER)  # still AllReduce
    # Sliced: only other-communicator groups and whole-gradient (Muon) straddlers still reach every rank.
    sliced_everyone = sum(p.numel for p in owner_map if p.placement is not Placement.ONE_OWNER and not p.sliced)
    owned = [0] * n
    kept = [0] * n
    sliced_owned = [0] * n
    for p in owner_map:
        if p.placement is Placement.ONE_OWNER:
            owned[p.slices[0].owner] += p.numel
        for piece in p.slices:
            kept[piece.owner] += piece.length
            if p.placement is Placement.ONE_OWNER or p.sliced:
                sliced_owned[piece.owner] += piece.length
    return DeliveredBytes(
        dtype_bytes=dtype_bytes, world_size=n,
        allreduce=RankStat.of([total * dtype_bytes] * n),
        owner=RankStat.of([(owned[r] + everyone) * dtype_bytes for r in range(n)]),
        sliced=RankStat.of([(sliced_owned[r] + sliced_everyone) * dtype_bytes for r in range(n)]),
        kept=RankStat.of([k * dtype_bytes for k in kept]))


# ---- the reduce buckets of one backward -------------------------------------------------------------------


def backward_order(param_ids_in_forward_order: Iterable[int]) -> tuple[int, ...]:
    """Gradient arrival order, approximated as reverse parameter order.

    Why an approximation: DeepCompile places ``reduce_grad`` right after each parameter's last gradient
    node in the backward graph, which for a model whose parameters are declared in forward order is the
    reverse of that order (a tied embedding/head weight is complete only after the embedding's backward,
    i.e. last, which is where reverse order puts the embedding too).
    """
    return tuple(reversed(tuple(param_ids_in_forward_order)))


def simulate_flushes(owner_map: OwnerMap, grad_order: Sequence[int], bucket_size: int,
                     double_buffer: bool = True) -> tuple[tuple[BucketEntry, ...], ...]:
    """The bucket flushes of one backward, as DeepCompile forms them (``CustomOpExecutor::reduceGrad``).

    A gradient flushes the current bucket when the bucket is non-empty and the gradient would overflow it;
    a gradient larger than the bucket grows that buffer for the rest of the step (``ReduceBucket::reserve``),
    and with double buffering the two buffers alternate at every flush, so the growth applies to one of
    them only. ``end_backward`` flushes what is left. One dtype is assumed (all gradients in one bucket).
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    sizes = [int(bucket_size), int(bucket_size)] if double_buffer else [int(bucket_size)]
    current = 0
    flushes: list[tuple[BucketEntry, ...]] = []
    entries: list[BucketEntry] = []
    offset = 0
    for param_id in grad_order:
        numel = owner_map.placement(param_id).numel
        if offset > 0 and offset + numel > sizes[current]:
            flushes.append(tuple(entries))
            entries, offset = [], 0
            current = (current + 1) % len(sizes)
        sizes[current] = max(sizes[current], numel)
        entries.append(BucketEntry(param_id=param_id, offset=offset, numel=numel))
        offset += numel
    if entries:
        flushes.append(tuple(entries))
    return tuple(flushes)


def ring_time(ranges: Sequence[FlushRange], world_size: int) -> float:
    """Elements sent by the busiest rank for one grouped flush of ``ranges`` (divide by B for seconds)."""
    n = world_size
    if n <= 1:
        return 0.0
    everyone = sum(r.count for r in ranges if r.root is ALL)
    rooted = [0] * n
    for r in ranges:
        if r.root is not ALL:
            rooted[r.root] += r.count
    owner_total = sum(rooted)
    return 2 * (n - 1) / n * everyone + owner_total - min(rooted)


@dataclass(frozen=True)
class IssuedCall:
    """One NCCL call as the ``--json`` plan lists it (issue 20's schema): ``elements`` is NCCL's count (per rank
    for a ReduceScatter), ``root`` a Reduce's root, ``peer`` and ``rank`` a send's destination and sender."""

    kind: str  # allreduce, reduce, reduce_scatter, send, recv
    elements: int
    root: int | None = None
    peer: int | None = None
    rank: int | None = None
    comm: str = "world"
    comm_size: int = 0
    rail: int | None = None  # a rail call: the local rank whose rail issues it (``root`` is then a node index)
    stage: int | None = None  # a two-level call: its pipeline stage


# What an issued call lists of each collective, (elements, root) (``calls`` Note (no fall-through)): a ReduceScatter its
# per-rank count, a Reduce its count and root, an AllReduce its count. A hand-off is its group of sends, listed apart.
_ISSUED: KindTable[str, Callable[[Collective], tuple[int, int | None]]] = KindTable(
    "the sizing's issued calls (planning.sizing)", {REDUCE_SCATTER: lambda c: (c.per_rank, None),
                                                    REDUCE: lambda c: (c.count, c.root),
                                                    ALLREDUCE: lambda c: (c.count, None)})


def issued_groups(layout: OwnerLayout, world_size: int) -> tuple[tuple[IssuedCall, ...], ...]:
    """The NCCL groups a flush's layout issues, in order: its collectives in one group, then (a hand-off) one
    grouped send/recv round listing every rank's sends (each has a matching recv on its ``peer``). A two-level flush:
    per stage, one group on the node communicators (every node issues it) and one on the rail communicators (each
    rail its own calls, listed with ``rail``), then its AllReduce on the data-parallel communicator."""
    if layout.stages:
        return _two_level_groups(layout, world_size)
    calls = []
    for c in layout.collectives:
        if c.kind == HANDOFF:  # its sends: the second group below
            continue
        elements, root = _ISSUED[c.kind](c)
        calls.append(IssuedCall(c.kind, elements, root=root, comm_size=world_size))
    groups = [tuple(calls)] if calls else []
    if layout.transfers:
        groups.append(tuple(IssuedCall("send", t.count, peer=t.dst, rank=t.src, comm_size=world_size)
                            for t in layout.transfers))
    return tuple(groups)


def _two_level_groups(layout: OwnerLayout, world_size: int) -> tuple[tuple[IssuedCall, ...], ...]:
    """Per stage: the node group, the rails' group (Reduces, or a ReduceScatter per rail), the rails' hand-off round
    (rail step ``scatter``: sends, node indices on the rail), the node hand-off round (balanced rails: sends on the
    ``node_handoff`` communicator, data-parallel ranks, run on the rail stream); then the data-parallel communicator's
    AllReduce."""
    world = []
    per_node = layout.ranks_per_node
    nodes = world_size // per_node
    stages: list[list[IssuedCall]] = [[] for _ in range(4 * layout.stages)]
    for t in layout.transfers:  # data-parallel ranks; on the rail, node indices
        if t.comm == NODE_HANDOFF:
            stages[4 * t.stage + 3].append(IssuedCall("send", t.count, peer=t.dst, rank=t.src, comm=NODE_HANDOFF,
                                                      comm_size=per_node, stage=t.stage))
            continue
        stages[4 * t.stage + 2].append(IssuedCall("send", t.count, peer=t.dst // per_node, rank=t.src // per_node,
                                                  comm=RAIL, comm_size=nodes, rail=t.src % per_node, stage=t.stage))
    for c in layout.collectives:
        if c.kind == HANDOFF:  # its sends: listed from the transfers above
            continue
        elements, root = _ISSUED[c.kind](c)
        if c.comm in (NODE, RAIL):
            size = per_node if c.comm == NODE else nodes
            rail = c.rail if c.comm == RAIL else None
            call = IssuedCall(c.kind, elements, root=root, comm=c.comm, comm_size=size, rail=rail, stage=c.stage)
            stages[4 * c.stage + (c.comm == RAIL)].append(call)
        else:
            world.append(IssuedCall(c.kind, elements, root=root, comm_size=world_size))
    return tuple(tuple(g) for g in [*stages, world] if g)


@dataclass(frozen=True)
class FlushSizing:
    """One bucket flush on the three paths: collective calls and ring-model time (elements, busiest rank)."""

    index: int  # 1-based, in the step
    tasks: int  # gradients in the flush
    elems: int
    owner_elems: int  # elements that take the owner path (single-owner gradients)
    native_calls: int  # one AllReduce per gradient (z1.cpp flushReduceBucket)
    owner_calls: int  # one collective per run of same-root ranges (flush_plan.plan_flush)
    sliced_calls: int
    native_time: float
    owner_time: float
    sliced_time: float
    owners: int = 0  # distinct owner ranks the flush touches (the floor of Reduce calls per flush)
    layout_calls: int = 0  # what reduce_to_owner runs: the owner-ordered bucket, algorithm chosen per flush
    layout_algo: str = ""
    # alpha-beta estimates (us) on the world size's named topology; 0 when there is none
    native_us: float = 0.0
    sliced_us: float = 0.0
    layout_us: float = 0.0
    previous_us: float = 0.0  # the owner-ordered bucket before the per-flush choice (see the module's docstring)
    # the host's time to issue the flush (``host_cost``), part of ``layout_us`` / ``native_us`` (each alone: its issue,
    # then its device time)
    host_us: float = 0.0
    native_host_us: float = 0.0
    layout_choice: str = ""  # the algorithm that won (its name in the registry, ``planning.algorithms``)
    costs: tuple[tuple[str, float], ...] = ()  # every candidate's modelled time (us)
    gradients: tuple[int, ...] = ()  # elements of each gradient, in arrival order (native's calls)
    groups: tuple[tuple[IssuedCall, ...], ...] = ()  # what reduce_to_owner issues: one entry per NCCL group
    # Where the step's plan runs it (``step_plan``): its node step's start and end, its rail step's end, its end (us),
    # and whether it runs alone (no overlap with the flush before or after it)
    node_start_us: float = 0.0
    node_end_us: float = 0.0
    rail_end_us: float = 0.0
    end_us: float = 0.0
    alone: bool = True
    rail_step: str = ""  # a two-level flush's rail step (``two_level`` Note (rail step))
    rail_layout: str = ""  # a two-level flush's layout over the rails (``two_level`` Note (balanced rails))

    @property
    def layout_over_native(self) -> float:
        """This flush's own time (its issue and its calls, nothing before it in the way) over native's for its
        gradients (native's issue and calls)."""
        return self.layout_us / self.native_us if self.native_us else 1.0

    @property
    def device_us(self) -> float:
        """``layout_us`` without the host's issue."""
        return self.layout_us - self.host_us

    @property
    def native_device_us(self) -> float:
        return self.native_us - self.native_host_us


@dataclass(frozen=True)
class BucketSizing:
    """All flushes of one step for one bucket size, with step totals."""

    bucket_size: int
    world_size: int
    flushes: tuple[FlushSizing, ...]
    topology: str = ""  # the alpha-beta estimate's topology ("" when the world size has none)
    # With the hand-off at a share of its modelled network bandwidth: (scale, step ratio and worst flush ratio of
    # the choices made at full bandwidth, step ratio when the model knows the bandwidth and chooses again)
    handoff_sensitivity: tuple[tuple[float, float, float | None, float], ...] = ()
    schedule_us: float = 0.0  # the step's plan: when its last flush ends (``step_plan``), flushes overlapped
    cross_flush_overlap: bool = False  # some flush's node step runs during the previous flush's rail step
    buckets_per_dtype: int = 2  # buffers a dtype keeps, in turn (double buffering)
    native_schedule_us: float = 0.0  # native's step: its flushes one after another, each behind its issue

    @property
    def native_calls(self) -> int:
        return sum(f.native_calls for f in self.flushes)

    @property
    def owner_calls(self) -> int:
        return sum(f.owner_calls for f in self.flushes)

    @property
    def sliced_calls(self) -> int:
        return sum(f.sliced_calls for f in self.flushes)

    @property
    def layout_calls(self) -> int:
        return sum(f.layout_calls for f in self.flushes)

    def step_us(self, path: str) -> float:
        """Alpha-beta step time of ``path`` (native, sliced, layout, previous): flushes run one after another, but
        ``layout`` is the step's plan, whose two-level flushes overlap across the node and rail streams, and native's
        is its flushes one after another with each flush's issue hidden behind the previous flush where it can be
        (``step_plan`` Note (host)); the other two add up every flush alone."""
        if path == "layout" and self.flushes:
            return self.schedule_us
        if path == "native" and self.flushes and self.native_schedule_us:
            return self.native_schedule_us
        return sum(getattr(f, f"{path}_us") for f in self.flushes)

    def host_per_flush(self, path: str) -> float:
        """The host's mean time per flush to issue it (``layout``: reduce_to_owner's runtime; ``native``: native
        DeepCompile's), microseconds."""
        attr = "host_us" if path == "layout" else "native_host_us"
        return sum(getattr(f, attr) for f in self.flushes) / len(self.flushes) if self.flushes else 0.0

    def device_per_flush(self, path: str) -> float:
        """The device's mean time per flush alone (its calls without the issue), microseconds."""
        attr = "device_us" if path == "layout" else "native_device_us"
        return sum(getattr(f, attr) for f in self.flushes) / len(self.flushes) if self.flushes else 0.0

    def worst_flush(self) -> FlushSizing | None:
        """Among the flushes that run alone (a flush overlapped with its neighbours is costed with the step), the one
        modelled slowest against native (None without such flushes)."""
        return max((f for f in self.flushes if f.alone), key=lambda f: (f.layout_over_native, -f.index), default=None)

    def last_flush_over_native(self) -> float:
        """The last flush's own time (its calls, nothing before it in the way) over native's: its exposed tail."""
        return self.flushes[-1].layout_over_native if self.flushes else 1.0

    def choices(self) -> dict[str, int]:
        """Flushes per ``algo=`` value, most frequent first."""
        counts: dict[str, int] = {}
        for f in self.flushes:
            counts[f.layout_algo] = counts.get(f.layout_algo, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def us_ratio(self, path: str) -> float:
        native = self.step_us("native")
        return self.step_us(path) / native if native else 1.0

    def _ratio(self, attr: str) -> float:
        native = sum(f.native_time for f in self.flushes)
        return sum(getattr(f, attr) for f in self.flushes) / native if native else 1.0

    @property
    def owner_time_ratio(self) -> float:
        """Owner-path step time over native (flushes summed: they run one after another on one stream)."""
        return self._ratio("owner_time")

    @property
    def sliced_time_ratio(self) -> float:
        return self._ratio("sliced_time")


def size_buckets(owner_map: OwnerMap, grad_order: Sequence[int], bucket_size: int,
                 double_buffer: bool = True, dtype_bytes: int = 2, cluster: Cluster | None = None, *,
                 planned: _PlannedStep | None = None) -> BucketSizing:
    """Every flush of one step at ``bucket_size``: calls and modelled times per path on ``cluster`` (default
    ``Cluster()``); ``planned``: the step's plan with these same arguments, already made."""
    n = owner_map.dp_world_size
    cluster = Cluster() if cluster is None else cluster
    topo = cluster.topology(n)
    if planned is None:
        planned = _planned_step(owner_map, grad_order, bucket_size, double_buffer, dtype_bytes, cluster)
    flushes, step, cost, per_bucket = planned.flushes, planned.step, planned.cost, planned.step.per_bucket
    timeline = step.plan.steps
    alone = runs_alone(timeline)
    sized = []
    for index, (entries, layout) in enumerate(zip(flushes, step.layouts, strict=True), 1):
        native = plan_flush(entries, owner_map, reduce_to_owner=False)
        owner = plan_flush(entries, owner_map, reduce_to_owner=True, slice_straddlers=False)
        sliced = plan_flush(entries, owner_map, reduce_to_owner=True).ranges
        at = timeline[index - 1] if timeline else None
        times = {} if at is None else dict(node_start_us=at.node_start, node_end_us=at.node_end,
                                           rail_end_us=at.rail_end, end_us=at.end, alone=alone[index - 1])
        if topo is not None:
            costs = dict(layout.costs)
            native_device, native_host = cost.native_parts(e.numel for e in entries)
            times.update(
                native_us=native_device + native_host, native_host_us=native_host,
                sliced_us=cost.group_us([(c.kind, c.count) for c in collectives_of(sliced)]),
                layout_us=layout.modelled_us, host_us=layout.issue_us,
                previous_us=costs.get(REDUCE_SCATTER, costs.get(REDUCE, costs[ALLREDUCE])))
        # Native: each gradient is its own AllReduce, but they share one group, so time adds up as one range.
        sized.append(FlushSizing(index=index, tasks=owner.tasks, elems=owner.reduced_elems,
                                 owner_elems=owner.owner_elems, native_calls=len(entries),
                                 owner_calls=len(owner.ranges), sliced_calls=len(sliced),
                                 native_time=ring_time(native.ranges, n), owner_time=ring_time(owner.ranges, n),
                                 sliced_time=ring_time(sliced, n),
                                 owners=len({r.root for r in sliced if r.root is not ALL}),
                                 layout_calls=layout.calls, layout_algo=layout.algo,
                                 layout_choice=layout.choice, costs=layout.costs,
                                 gradients=tuple(e.numel for e in entries), rail_step=layout.rail_step,
                                 rail_layout=layout.rail_layout,
                                 groups=issued_groups(layout, n), **times))
    name = topo.name if topo is not None else ""
    if name and cost.calibration is not None:
        name += ", calls timed by the calibration file"
    elif name and cost.p2p_bw_scale != 1.0:
        name += f", hand-off at {cost.p2p_bw_scale:g}x its network bandwidth"
    plan = step.plan
    return BucketSizing(bucket_size=int(bucket_size), world_size=n, flushes=tuple(sized), topology=name,
                        schedule_us=plan.end_us if topo is not None else 0.0,
                        cross_flush_overlap=plan.overlapped, buckets_per_dtype=per_bucket,
                        native_schedule_us=plan.native_us if topo is not None else 0.0)


@dataclass(frozen=True)
class _PlannedStep:
    """One step's flushes at a bucket size and the plan the model makes for them (``plan_step_layouts``)."""

    flushes: tuple[tuple[BucketEntry, ...], ...]
    step: StepLayouts
    cost: FlushCost
    order: dict[int, int]

    @property
    def grads(self) -> list[tuple[int, list[tuple[int, int]]]]:
        return [(0, [(e.param_id, e.numel) for e in entries]) for entries in self.flushes]


def _planned_step(owner_map: OwnerMap, grad_order: Sequence[int], bucket_size: int, double_buffer: bool,
                  dtype_bytes: int, cluster: Cluster) -> _PlannedStep:
    cost = cluster.cost(owner_map.dp_world_size, dtype_bytes)
    order = map_order(owner_map)
    flushes = tuple(tuple(f) for f in simulate_flushes(owner_map, grad_order, bucket_size, double_buffer))
    grads = [(0, [(e.param_id, e.numel) for e in entries]) for entries in flushes]
    step = plan_step_layouts(grads, owner_map, True, capacity=int(bucket_size), cost_of=lambda _: cost, order=order,
                             per_bucket=2 if double_buffer else 1)
    return _PlannedStep(flushes, step, cost, order)


def _handoff_row(full: _PlannedStep, owner_map: OwnerMap, grad_order: Sequence[int], bucket_size: int,
                 scale: float, dtype_bytes: int, cluster: Cluster, double_buffer: bool
                 ) -> tuple[float, float, float | None, float]:
    """(scale, step ratio and worst flush ratio (None: no flush runs alone) of the choices made at full bandwidth,
    step ratio chosen again) with every p2p transfer (the hand-offs, the rail hand-off) at ``scale`` x its modelled
    network bandwidth. The choices made at full bandwidth (``full``) keep their candidate, geometry and rail step and
    are scheduled as the runtime runs them (``owner_layout.cost_step_choices``: overlapped flushes stay overlapped);
    the worst flush is among those that run alone, as ``BucketSizing.worst_flush``."""
    scaled = cluster.with_p2p_scale(scale)
    scaled_cost = scaled.cost(owner_map.dp_world_size, dtype_bytes)
    fixed = cost_step_choices(full.grads, owner_map, full.step, capacity=int(bucket_size),
                              cost_of=lambda _: scaled_cost, order=full.order)
    ratios = []
    for times, by_itself, entries in zip(fixed.times, runs_alone(fixed.steps), full.flushes, strict=True):
        native = scaled_cost.native_us(e.numel for e in entries)
        if native and by_itself:
            ratios.append(times.alone_us / native)
    worst = max(ratios, default=None)
    again = size_buckets(owner_map, grad_order, bucket_size, double_buffer, dtype_bytes, scaled).us_ratio("layout")
    return scale, (fixed.end_us / fixed.native_us if fixed.native_us else 1.0), worst, again


# ---- the whole report ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizingReport:
    """Everything ``size_the_win`` prints for one model and world size."""

    model: str
    world_size: int
    dtype: str
    summary_line: str  # the init line exactly as the runtime prints it with reduce_to_owner on
    share: ElementShare
    delivered: DeliveredBytes
    buckets: tuple[BucketSizing, ...]
    build_seconds: float = 0.0  # wall time to build the engine and the map (informational)
    notes: tuple[str, ...] = ()
    ranks_per_node: int = 8  # the cluster modelled (``Cluster``)
    gpu_generation: str = "hopper"
    nvls: bool = True
    host: str = ""  # the host cost charged (``HostCost.describe``)


def size_the_win(owner_map: OwnerMap, grad_order: Sequence[int], bucket_sizes: Sequence[int], *, model: str,
                 dtype: str = "bf16", build_seconds: float = 0.0, notes: Sequence[str] = (),
                 cluster: Cluster | None = None, sensitivity: Sequence[float] = ()) -> SizingReport:
    """The whole report; ``sensitivity``: hand-off bandwidth scales to size each bucket again at (the docs' rows)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} not one of {', '.join(DTYPE_BYTES)}")
    cluster = Cluster() if cluster is None else cluster
    b = DTYPE_BYTES[dtype]
    buckets = []
    for size in bucket_sizes:
        full = _planned_step(owner_map, grad_order, size, True, b, cluster)
        sized = size_buckets(owner_map, grad_order, size, dtype_bytes=b, cluster=cluster, planned=full)
        rows = tuple(_handoff_row(full, owner_map, grad_order, size, scale, b, cluster, True) for scale in sensitivity)
        buckets.append(replace(sized, handoff_sensitivity=rows))
    return SizingReport(model=model, world_size=owner_map.dp_world_size, dtype=dtype,
                        summary_line=owner_map.init_line(sliced=True), share=element_share(owner_map),
                        delivered=delivered_bytes(owner_map, b), buckets=tuple(buckets),
                        build_seconds=build_seconds, notes=tuple(notes), ranks_per_node=cluster.ranks_per_node,
                        gpu_generation=cluster.generation, nvls=cluster.nvls,
                        host=cluster.cost(owner_map.dp_world_size, b).host_cost.describe())


def _host_device(b: BucketSizing, path: str) -> str:
    """``host + device us`` of a bucket's mean flush alone on ``path``."""
    return f"{b.host_per_flush(path):,.1f} + {b.device_per_flush(path):,.1f} us"


def _worst(ratio: float | None) -> str:
    return "none" if ratio is None else f"{ratio:.3f}x"


def _ms(us: float) -> str:
    return f"{us / 1000:.3f} ms"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def format_report(report: SizingReport) -> str:
    """The plain-text report; the first line is the init line exactly as the runtime prints it."""
    s, d, n = report.share, report.delivered, report.world_size
    lines = [
        report.summary_line,
        f"model: {report.model}",
        f"world size: {n}   grad dtype: {report.dtype} ({d.dtype_bytes} B/elem)   "
        f"engine+map built in {report.build_seconds:.1f} s",
        "",
        "elements on the owner path (single-owner parameters):",
        f"  single-owner {s.single_owner_params}/{s.params} params, {s.single_owner_elems:,}/{s.elems:,} elements "
        f"= {_pct(s.share)}",
        f"  straddling   {count_noun(s.straddling_params, 'param')}, {s.straddling_elems:,} elements "
        "(reduce in slices with reduce_to_owner; AllReduce in the proposal)",
    ]
    if s.other_comm_params:
        lines.append(f"  other comm   {count_noun(s.other_comm_params, 'param')}, {s.other_comm_elems:,} "
                     "elements (AllReduce)")
    lines += [
        "",
        "bytes delivered per rank per step (reduced results arriving at a rank):   mean / max",
        f"  AllReduce (native)          {_mib(d.allreduce.mean):>14} / {_mib(d.allreduce.max):>14}",
        f"  owner, straddlers AllReduce {_mib(d.owner.mean):>14} / {_mib(d.owner.max):>14}   "
        f"({_pct(d.owner_over_allreduce)} of AllReduce)",
        f"  owner, straddlers sliced    {_mib(d.sliced.mean):>14} / {_mib(d.sliced.max):>14}   "
        f"({_pct(d.sliced.mean / d.allreduce.mean if d.allreduce.mean else 1.0)} of AllReduce; reduce_to_owner)",
        f"  kept by the optimizer       {_mib(d.kept.mean):>14} / {_mib(d.kept.max):>14}",
    ]
    for b in report.buckets:
        flushes = len(b.flushes)
        per = max(flushes, 1)
        lines += [
            "",
            f"bucket {b.bucket_size:,} elements: {count_noun(flushes, 'flush', 'flushes')} per step "
            "(gradients in reverse parameter order)",
            f"  collective calls per flush (mean, max):  native {b.native_calls / per:.1f}, "
            f"{max((f.native_calls for f in b.flushes), default=0)}   owner {b.owner_calls / per:.1f}, "
            f"{max((f.owner_calls for f in b.flushes), default=0)}   sliced {b.sliced_calls / per:.1f}, "
            f"{max((f.sliced_calls for f in b.flushes), default=0)}",
            f"  collective calls per step:               native {b.native_calls}   owner {b.owner_calls}   "
            f"sliced {b.sliced_calls}",
            f"  reduce_to_owner (owner-ordered, algorithm chosen per flush), calls per flush: "
            f"{b.layout_calls / per:.1f}, {max((f.layout_calls for f in b.flushes), default=0)}   "
            f"(owners touched {sum(f.owners for f in b.flushes) / per:.1f}; algo {_algos(b)})",
            f"  ring-model time, owner / native:         {b.owner_time_ratio:.3f}   "
            f"(sliced {b.sliced_time_ratio:.3f}; native AllReduce = 2(n-1)/n = {2 * (n - 1) / n:.3f} S/B)",
        ]
        worst = b.worst_flush()
        if b.topology and b.flushes:
            alone = (f"worst flush alone #{worst.index} {worst.layout_over_native:.3f} of native ({worst.layout_algo}, "
                     f"{worst.elems:,} elements)" if worst is not None else "no flush runs alone")
            overlap = ", flushes overlapped on the node and rail streams" if b.cross_flush_overlap else ""
            lines += [
                f"  alpha-beta step time on {b.topology}:",
                f"    native {_ms(b.step_us('native'))}   reduce_to_owner {_ms(b.step_us('layout'))} "
                f"({b.us_ratio('layout'):.3f} of native{overlap})   {alone}   last flush "
                f"{b.last_flush_over_native():.3f}",
                f"    before the per-flush choice: owner-ordered {_ms(b.step_us('previous'))} "
                f"({b.us_ratio('previous'):.3f})   arrival order {_ms(b.step_us('sliced'))} "
                f"({b.us_ratio('sliced'):.3f})   (bandwidth-only {b.sliced_time_ratio:.3f})",
                f"    per flush alone, host issue + device (mean): native {_host_device(b, 'native')}   "
                f"reduce_to_owner {_host_device(b, 'layout')}",
            ]
            lines += [f"    hand-off at {scale:g}x its network bandwidth: the choices above {ratio:.3f} of native "
                      f"(worst flush alone {_worst(worst_ratio)}); chosen again knowing it {again:.3f}"
                      for scale, ratio, worst_ratio, again in b.handoff_sensitivity]
    lines += ["", "estimates: ring-model time is bandwidth only, per rank; alpha-beta time is NCCL's tuning model "
              "(planning/collective_time.py; a ring Reduce pays a hop per rank) plus the host's issue where the device "
              "waits for it (planning/host_cost.py), native's flushes serial, reduce_to_owner's the step's plan "
              "(two-level flushes overlapped on the node and rail streams), compute overlap ignored."]
    if report.host:
        lines.append(f"{report.host}")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


SUMMARY_HEADER = ("| model | ws | bucket | flushes | calls per flush: native / reduce_to_owner | algorithms chosen | "
                  "step, native | before the choice | reduce_to_owner | worst flush alone | last flush | "
                  "per flush, host + device: native / reduce_to_owner |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|---|")


def summary_header(sensitivity: Sequence[float] = ()) -> str:
    """``SUMMARY_HEADER`` with one more column per hand-off bandwidth scale."""
    if not sensitivity:
        return SUMMARY_HEADER
    head, rule = SUMMARY_HEADER.split("\n")
    extra = "".join(f" hand-off at {s:g}x bw |" for s in sensitivity)
    return head + extra + "\n" + rule + "---|" * len(sensitivity)


def format_summary_rows(report: SizingReport, name: str) -> list[str]:
    """One markdown row per bucket size: the scale table of the guide (alpha-beta step time against native, the
    owner-ordered bucket before the per-flush choice, the worst flush, and the hand-off sensitivity when sized),
    for ``summary_header``."""
    rows = []
    for b in report.buckets:
        per = max(len(b.flushes), 1)
        worst = b.worst_flush()
        if not b.topology or not b.flushes:
            rows.append(f"| {name} | {report.world_size} | {b.bucket_size:.0e} | {len(b.flushes)} | "
                        "one rank: nothing to reduce |" + " |" * (7 + len(b.handoff_sensitivity)))
            continue
        sens = "".join(f" {ratio:.3f}x (worst alone {_worst(w)}; chosen again {again:.3f}x) |"
                       for _, ratio, w, again in b.handoff_sensitivity)
        alone = f"{worst.layout_over_native:.3f}x ({worst.layout_algo})" if worst is not None else "none alone"
        overlap = ", overlapped" if b.cross_flush_overlap else ""
        rows.append(f"| {name} | {report.world_size} | {b.bucket_size:.0e} | {len(b.flushes)} | "
                    f"{b.native_calls / per:.1f} / {b.layout_calls / per:.1f} | {_algos(b)}{overlap} | "
                    f"{_ms(b.step_us('native'))} | {b.us_ratio('previous'):.3f}x | "
                    f"**{b.us_ratio('layout'):.3f}x** | {alone} | {b.last_flush_over_native():.3f}x | "
                    f"{_host_device(b, 'native')} / {_host_device(b, 'layout')} |" + sens)
    return rows


def report_to_dict(report: SizingReport) -> dict[str, Any]:
    """Machine-readable report: the dataclasses as plain data plus the derived ratios and call totals."""
    data = asdict(report)
    for raw in data["buckets"]:
        for flush in raw["flushes"]:
            del flush["gradients"], flush["groups"]  # the plan's own file: ``plan_to_dicts``
    data["share"]["share"] = report.share.share
    data["delivered"]["owner_over_allreduce"] = report.delivered.owner_over_allreduce
    for raw, b in zip(data["buckets"], report.buckets, strict=True):
        raw.update(flush_count=len(b.flushes), native_calls=b.native_calls, owner_calls=b.owner_calls,
                   sliced_calls=b.sliced_calls, owner_time_ratio=b.owner_time_ratio,
                   sliced_time_ratio=b.sliced_time_ratio, layout_calls=b.layout_calls,
                   native_us=b.step_us("native"), sliced_us=b.step_us("sliced"), layout_us=b.step_us("layout"),
                   previous_us=b.step_us("previous"), sliced_us_ratio=b.us_ratio("sliced"),
                   host_us_per_flush=b.host_per_flush("layout"), native_host_us_per_flush=b.host_per_flush("native"),
                   device_us_per_flush=b.device_per_flush("layout"),
                   native_device_us_per_flush=b.device_per_flush("native"),
                   layout_us_ratio=b.us_ratio("layout"), previous_us_ratio=b.us_ratio("previous"),
                   worst_flush_over_native=max((f.layout_over_native for f in b.flushes if f.alone), default=1.0),
                   last_flush_over_native=b.last_flush_over_native(),
                   choices=b.choices())
    return data


def plan_to_dicts(report: SizingReport) -> list[dict[str, Any]]:
    """Issue 20's machine-readable plan, one object per bucket size: for each flush what native issues (one
    AllReduce per gradient, in one group) and what reduce_to_owner issues (``groups``: one entry per NCCL group in
    issue order; a two-level call names its ``comm``, ``rail`` and ``stage``), with both modelled times and where the
    step's plan runs it, so anyone can cost them their own way. How the step runs (``cross_flush_overlap``,
    ``buckets_per_dtype``): node groups on the node stream, rail groups (and the rail hand-off's sends) on the rail
    stream, rail stage ``k`` of flush ``i`` after node stage ``k`` of flush ``i``, a balanced flush's node hand-off
    (``comm`` ``node_handoff``, ``rail_layout`` ``balanced``) on the rail stream after that stage's rail group, its
    NVLink bytes beside the node stream's (the model charges it to both), anything on the data-parallel
    communicator after both streams' earlier work, a flush's first node group after the rail end of the flush that
    last used its bucket (flushes of a dtype take ``buckets_per_dtype`` buckets in turn)."""
    out = []
    for b in report.buckets:
        flushes = []
        for f in b.flushes:
            flushes.append({
                "index": f.index, "gradients": list(f.gradients),
                "groups": [[asdict(call) for call in group] for group in f.groups],
                "algo": f.layout_algo, "choice": f.layout_choice, "rail_step": f.rail_step or None,
                "rail_layout": f.rail_layout or None,
                "modelled_us": f.layout_us, "native_modelled_us": f.native_us,
                "host_us": f.host_us, "native_host_us": f.native_host_us,
                "schedule_us": {"node_start": f.node_start_us, "node_end": f.node_end_us, "rail_end": f.rail_end_us,
                                "end": f.end_us}})
        out.append({"model": report.model, "world_size": report.world_size,
                    "ranks_per_node": report.ranks_per_node, "gpu_generation": report.gpu_generation,
                    "nvls": report.nvls, "dtype_bytes": DTYPE_BYTES[report.dtype], "bucket_elems": b.bucket_size,
                    "topology": b.topology, "cross_flush_overlap": b.cross_flush_overlap,
                    "buckets_per_dtype": b.buckets_per_dtype, "step_modelled_us": b.step_us("layout"),
                    "native_step_modelled_us": b.step_us("native"), "flushes": flushes})
    return out


def report_to_json(report: SizingReport) -> str:
    return json.dumps(report_to_dict(report), indent=2)


def _algos(b: BucketSizing) -> str:
    """The distinct ``algo=`` values of a bucket's flushes, most frequent first."""
    return ", ".join(f"{a} x{c}" for a, c in b.choices().items())
