"""An alpha-beta time estimate per NCCL collective, with NCCL's own tuning constants.

Why: a bandwidth-only model says any owner layout costs (n-1)/n of the bytes, half an AllReduce, whatever the
number of calls; but every NCCL call pays a launch and per-hop latency, and at large world sizes many small
calls are what made DeepSpeed's eager path fall back to one AllReduce per bucket (DeepSpeed PR #4695). This
module reproduces NCCL's cost model (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in src/graph/tuning.cc)
for the ring algorithm (the one NCCL has for Reduce, and the one it uses for ReduceScatter without NVLS/PAT)
and, for AllReduce, also the tree: ``time = latency + bytes / algorithm bandwidth``, the minimum over the
algorithms and the LL, LL128 and Simple protocols, as NCCL picks.

Constants: NVIDIA/nccl at commit 5067397c2676d5aed50042fc39e5c8ee96eb0027 (2026-06-11): src/graph/tuning.cc
(``ncclTunerConstantsDefaults``: baseLatencies, hwLatencies, llMaxBws, perChMaxRingLL128Bws,
perChMaxTreeLL128Bws, perChMaxTreeBws; treeCorrectionFactor; the ring and tree latency and bandwidth
formulas), src/graph/topo.h (``SM80_NVLINK_BW``, ``SM90_NVLINK_BW`` per NVLink) and src/graph/search.cc
(``sm90SpeedArrayInter``: the fastest inter-node speed per channel); docs/reduce_to_owner.md cites each.
Not modelled: NVLS, CollNet and PAT (AllReduce may pick NVLS and be faster than this estimate), the tree
pattern's 0.85 factor, the graph search's exact channel count, and the network's ``latencyInter`` (0 here).

Note (send/recv): tuning.cc has no model for point-to-point operations. A grouped send/recv round (the owner
hand-off after a ReduceScatter) is charged here as NCCL schedules it (src/enqueue.cc ``scheduleP2pTasksToPlan``,
``addP2pToPlan``): peers run concurrently, up to ``p2pnChannels / nChannelsPerPeer * NCCL_MAX_DEV_WORK_P2P_PER_BATCH``
at a time, and paths.cc lowers the channels per peer across nodes so that every peer fits one round; each wave of
concurrent peers costs one Simple ring step (``baseLatencies[RING][Simple]`` + one hop of ``hwLatencies``), and the
busiest rank's bytes move at one NIC's speed across nodes (``sm90SpeedArrayInter[0]``: point-to-point traffic of a
GPU leaves through its own NIC, not through the rings of every GPU of its node) or at the NVLink bus bandwidth
within one node. Conservative on purpose: every peer is charged as if it were on another node.

Note (Reduce latency): tuning.cc charges a Reduce one hop when the ring graph has ``sameChannels`` and
``nsteps`` hops otherwise. A Reduce is a chain through every rank, so the default here is the second (its
latency grows with the ranks, like every other ring collective); the published check prints both.
Pure: numbers in, microseconds out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = ("LL", "LL128", "Simple")

# tuning.cc, ncclTunerConstantsDefaults.baseLatencies[RING] (us), by protocol LL / LL128 / Simple.
BASE_LATENCY_RING = (6.6, 14.0, 8.4)
BASE_LATENCY_TREE = (6.8, 14.0, 8.4)
# tuning.cc, hwLatencies[NVLINK|NET][RING|TREE] (us per hop), by protocol.
HW_LATENCY = {
    ("nvlink", "ring"): (0.6, 1.9, 3.4),
    ("nvlink", "tree"): (0.6, 1.25, 4.0),
    ("net", "ring"): (2.7, 4.0, 14.0),
    ("net", "tree"): (5.0, 8.5, 14.0),
}
# tuning.cc, llMaxBws (GB/s): single node by GPU generation; several nodes by CPU vendor (Intel row), then by
# node count N1 / N2 / N4+.
LL_MAX_BW = {"ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0), "intel-cpu": (39.0, 39.0, 20.4)}
# tuning.cc, perChMaxRingLL128Bws (GB/s per channel).
PER_CHANNEL_MAX_RING_LL128_BW = {"ampere": 20.0, "hopper": 36.7}
# tuning.cc, perChMaxTreeLL128Bws and perChMaxTreeBws (GB/s per channel), N1 / N2 / N4+.
PER_CHANNEL_MAX_TREE_LL128_BW = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0)}
PER_CHANNEL_MAX_TREE_BW = {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
# tuning.cc treeCorrectionFactor[protocol][log2(bytes / 64)], for tree AllReduce.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
NET_OVERHEAD_US = 1.0  # tuning.cc getNetOverhead(): x86 Intel; tripled for Simple
RING_PLATEAU = 1.4  # tuning.cc ncclTopoGetAlgoTime: multi-node ring/Simple AllReduce latency factor (sm >= 80)
SM80_NVLINK_BW = 20.0  # topo.h, GB/s per NVLink (A100/A800)
SM90_NVLINK_BW = 20.6  # topo.h, GB/s per NVLink (H100)
SM90_MAX_INTER_SPEED = 48.0  # search.cc sm90SpeedArrayInter[0], GB/s per channel across nodes

P2P_MAX_PER_BATCH = 8  # device.h NCCL_MAX_DEV_WORK_P2P_PER_BATCH: p2p operations one channel runs at once
MAX_CHANNELS = 64  # device.h MAXCHANNELS: the most channels (and p2p channels) a communicator has

ALLREDUCE, REDUCE, REDUCE_SCATTER = "allreduce", "reduce", "reduce_scatter"


@dataclass(frozen=True)
class Topology:
    """What NCCL's ring model needs: ranks, nodes, channels and per-channel bandwidth inside / across nodes."""

    name: str
    gpus_per_node: int
    nodes: int
    channels: int
    bw_intra: float  # GB/s per channel (NVLink)
    bw_inter: float  # GB/s per channel across nodes (used when nodes > 2, as tuning.cc does)
    generation: str  # "ampere" or "hopper": selects LL / LL128 caps
    same_channels: bool = False  # see Note (Reduce latency)

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def bus_bw(self) -> float:
        return self.channels * (self.bw_intra if self.nodes <= 2 else self.bw_inter)


def nvlink_node(gpus: int = 8, *, generation: str = "hopper", links: int = 18, channels: int = 16) -> Topology:
    """One node of ``gpus`` GPUs on NVSwitch: bus bandwidth = NVLinks per GPU x topo.h's bandwidth per link."""
    per_link = SM90_NVLINK_BW if generation == "hopper" else SM80_NVLINK_BW
    return Topology(name=f"{gpus}-GPU NVLink node ({generation}, {links} links x {per_link:g} GB/s)",
                    gpus_per_node=gpus, nodes=1, channels=channels, bw_intra=links * per_link / channels,
                    bw_inter=0.0, generation=generation)


def network(nodes: int, gpus_per_node: int = 8, *, channels: int = 8) -> Topology:
    """``nodes`` NVLink nodes of ``gpus_per_node`` H100-class GPUs over a network, one 400 Gb/s NIC per GPU:
    ``channels`` rings, each at search.cc's fastest inter-node speed per channel."""
    intra = nvlink_node(gpus_per_node)
    return Topology(name=f"{nodes} nodes x {gpus_per_node} GPUs, network ({channels} x {SM90_MAX_INTER_SPEED:g} GB/s)",
                    gpus_per_node=gpus_per_node, nodes=nodes, channels=channels,
                    bw_intra=intra.bus_bw / channels, bw_inter=SM90_MAX_INTER_SPEED, generation="hopper")


A800_NODE = nvlink_node(8, generation="ampere", links=8, channels=8)  # the published measurement's machine


def named_topology(world_size: int) -> Topology | None:
    """``topology_for(world_size)``, or None where there is nothing to model (one rank) or no named topology."""
    if world_size <= 1:
        return None
    try:
        return topology_for(world_size)
    except ValueError:
        return None


def topology_for(world_size: int) -> Topology:
    """The named topology for a world size: one NVLink node up to 8 GPUs, nodes of 8 over a network above."""
    if world_size <= 8:
        return nvlink_node(world_size)
    if world_size % 8:
        raise ValueError(f"world size {world_size}: nodes of 8 GPUs need a multiple of 8")
    return network(world_size // 8)


def topology_of(world_size: int, gpus_per_node: int, generation: str = "hopper") -> Topology:
    """The topology the runtime assumes for ``world_size`` ranks with ``gpus_per_node`` ranks on each node: one NVLink
    node when they all fit in one (of ``generation``), else H100-class nodes over a network (``network``). A world
    size that is not a whole number of nodes is modelled as one rank per node (every hop crosses the network: the
    most conservative latencies)."""
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world size {world_size} and GPUs per node {gpus_per_node} must be at least 1")
    if world_size <= gpus_per_node:
        return nvlink_node(world_size, generation=generation)
    if world_size % gpus_per_node:
        gpus_per_node = 1
    return network(world_size // gpus_per_node, gpus_per_node)


def _steps(kind: str, n: int) -> int:
    return {ALLREDUCE: 2 * (n - 1), REDUCE_SCATTER: n - 1, REDUCE: n}[kind]


def latency_us(kind: str, topo: Topology, protocol: int) -> float:
    """tuning.cc's ring latency of one call (before the AllReduce plateau factor)."""
    n, nodes = topo.ranks, topo.nodes
    lat = BASE_LATENCY_RING[protocol]
    hw = "nvlink" if nodes == 1 else "net"
    if kind == REDUCE:
        if topo.same_channels:
            return lat + HW_LATENCY[(hw, "ring")][protocol]
        hop = HW_LATENCY[(hw, "tree" if protocol == SIMPLE else "ring")][protocol]
        return lat + _steps(kind, n) * hop
    intra = HW_LATENCY[("nvlink", "ring")][protocol]
    # ppn == 1 exposes the Tree network latency; latencyInter (0 here) would be added, twice for Simple.
    inter = HW_LATENCY[("net", "tree" if topo.gpus_per_node == 1 else "ring")][protocol]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == SIMPLE else 1))
    steps = _steps(kind, n)
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if kind == ALLREDUCE else nodes - 1)
    return lat + (steps - inter_steps) * intra + inter_steps * inter


def algo_bw(kind: str, topo: Topology, protocol: int) -> float:
    """tuning.cc's ring algorithm bandwidth (GB/s): bus bandwidth, protocol caps, then x nRanks / nsteps."""
    bus = topo.bus_bw
    index2 = min(topo.nodes, 3) - 1
    if protocol == LL:
        ll_max = LL_MAX_BW[topo.generation if topo.nodes == 1 else "intel-cpu"][index2]
        bus = min(ll_max, bus * 0.5)
    elif protocol == LL128:
        bus = min(bus * 0.92, topo.channels * PER_CHANNEL_MAX_RING_LL128_BW[topo.generation])
    return bus * topo.ranks / _steps(kind, topo.ranks)


def tree_allreduce_us(nbytes: int, topo: Topology, protocol: int) -> float:
    """tuning.cc's tree AllReduce: latency 2((ppn-1) intra + log2(nodes) inter); bandwidth capped, halved, then
    corrected by ``treeCorrectionFactor`` for the message size."""
    ppn, nodes = topo.gpus_per_node, topo.nodes
    intra = HW_LATENCY[("nvlink", "tree")][protocol]
    inter = HW_LATENCY[("net", "tree")][protocol]
    lat = BASE_LATENCY_TREE[protocol] + 2 * ((ppn - 1) * intra + (nodes.bit_length() - 1) * inter)
    index2 = min(nodes, 3) - 1
    bus = min(topo.bus_bw * 0.92, topo.channels * PER_CHANNEL_MAX_TREE_BW[topo.generation][index2])
    if protocol == LL:
        bus = min(bus / 3.8, LL_MAX_BW[topo.generation if nodes == 1 else "intel-cpu"][index2])
    elif protocol == LL128:
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                  topo.channels * PER_CHANNEL_MAX_TREE_LL128_BW[topo.generation][index2])
    bw = bus * 0.5
    log_size = (nbytes >> 6).bit_length() - 1
    if 0 <= log_size < 23:
        bw *= TREE_CORRECTION[protocol][log_size]
    return lat + nbytes / (1000.0 * bw)


def call_time_us(kind: str, nbytes: int, topo: Topology) -> float:
    """One call moving ``nbytes`` (a ReduceScatter's whole input): the fastest algorithm and protocol."""
    if topo.ranks <= 1 or nbytes <= 0:
        return 0.0
    best = float("inf")
    for protocol in (LL, LL128, SIMPLE):
        lat = latency_us(kind, topo, protocol)
        if (kind == ALLREDUCE and protocol == SIMPLE and topo.nodes > 1
                and nbytes / (topo.channels * topo.ranks) >= 64):
            lat *= RING_PLATEAU
        best = min(best, lat + nbytes / (1000.0 * algo_bw(kind, topo, protocol)))
        if kind == ALLREDUCE:
            best = min(best, tree_allreduce_us(nbytes, topo, protocol))
    return best


def p2p_round_us(peers: int, max_bytes: int, topo: Topology) -> float:
    """One grouped send/recv round in which the busiest rank talks to ``peers`` peers and sends or receives
    ``max_bytes`` bytes (see Note (send/recv)); 0 when nothing moves."""
    if peers <= 0 or topo.ranks <= 1:
        return 0.0
    across_nodes = topo.nodes > 1
    hop = HW_LATENCY[("net" if across_nodes else "nvlink", "ring")][SIMPLE]
    p2p_channels = min(MAX_CHANNELS, 1 << max(topo.channels - 1, 0).bit_length())  # pow2Up(nChannels)
    waves = -(-peers // (p2p_channels * P2P_MAX_PER_BATCH))  # one channel per peer
    bandwidth = topo.bw_inter if across_nodes else topo.bus_bw  # GB/s
    return BASE_LATENCY_RING[SIMPLE] + waves * hop + max_bytes / (1000.0 * bandwidth)


def flush_time_us(calls: Iterable[tuple[str, int]], topo: Topology) -> float:
    """A grouped flush of (kind, bytes) calls: NCCL runs a group's operations one after another on the same
    channels, and its model charges each one its latency (``latCount = numPipeOps`` for ring), so times add."""
    return sum(call_time_us(kind, nbytes, topo) for kind, nbytes in calls)
