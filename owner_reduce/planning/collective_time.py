"""NCCL 2.30's own time model of a grouped flush: per-call tuning tables, the planner's aggregation, p2p rounds.

Why: the owner path is only worth turning on where it beats what DeepCompile sends today, and that baseline is one
``ncclAllReduce`` per gradient inside one ``ncclGroupStart/End`` per flush (deepspeed/ops/csrc/compile/z1.cpp
57-68, z2.cpp 50-61). NCCL does not pay each of those calls' latency in full: its planner aggregates a group's
tasks and, on NVSwitch clusters, runs AllReduce as NVLS / NVLS_TREE. Costing native call by call overstated the
owner path's win at scale; this module costs every candidate the way NCCL plans it.

Sources, all at NVIDIA/nccl v2.30.7-1 (commit 5067397c2676d5aed50042fc39e5c8ee96eb0027):

- ``ncclTopoTuneModel`` (src/graph/tuning.cc 253-449): per (function, algorithm, protocol) a latency and a bus
  bandwidth converted to algorithm bandwidth; constants from ``ncclTunerConstantsDefaults`` (tuning.cc 146-211)
  and ``nvlsEfficiency`` (tuning.cc 138-143). Which algorithms exist per function: tuning.cc 300-312 (Reduce: ring
  only; ReduceScatter: ring, NVLS, PAT, CollNet; AllReduce: everything but PAT), 534-545 (NVLS_TREE off on one
  node, NVLS off across nodes without CollNet), enqueue.cc 2000-2007 (NVLS needs ``nvlsSupport``).
- ``ncclTopoGetAlgoTime`` (tuning.cc 624-655): the tree correction, the ring plateau, and
  ``latCount = ring ? numPipeOps : DIVUP(numPipeOps, NCCL_MAX_DEV_WORK_BATCH_COLLS)``.
- ``ncclPrepareTasks`` (src/enqueue.cc 363-470): a group's collective tasks, sorted by ``trafficBytes`` (AllReduce
  2x, ReduceScatter nRanks x the receive count, Reduce 1x: enqueue.cc 91-102) in the sorter's bins
  (src/include/comm.h 366-390: ``u32fpEncode(min(1 GB, bytes) >> 10, 2)``), binned per function, then aggregated
  smallest first while the next task is under 4x the aggregate's first (enqueue.cc 434-439); each aggregate is
  costed on its total bytes (``ncclFuncMaxSendRecvCount``, src/include/enqueue.h 39) with
  ``numPipeOps = DIVUP(nTasksColl, nChannels)`` (enqueue.cc 428), and its algorithm is the fastest.
- The p2p round (a hand-off): no time model in NCCL; see Note (send/recv).

A grouped flush is charged the sum of its aggregates' times (each aggregate runs as its own work batches on the
channels). A candidate's calls are one group; the hand-off's send/recv round is a second group after it.

Topology assumptions (named; the calibration file replaces them with a cluster's own measurements): H100/H200 HGX
nodes of 8 GPUs on NVSwitch, 18 NVLinks x 20.6 GB/s (topo.h ``SM90_NVLINK_BW``), one 400 Gb/s NIC per GPU. The
ring graph: inside one node 6 rings at search.cc's 60 GB/s (``sm90SpeedArrayIntra[0]``) duplicated by
``ncclTopoDupChannels`` (search.cc 1036-1049) into 12 at 30 GB/s; across nodes 8 rings (one per NIC) at 48 GB/s
(``sm90SpeedArrayInter[0]``), not duplicated (bw < 50, > 4 channels); the communicator runs twice the graph's
channels (24 / 16), which is what ``numPipeOps`` divides by. The tree graph as the ring's. NVLS: one head per GPU
(search.cc 1126-1128), at the search's starting speed (search.cc 1160-1168: 50 GB/s in one node, 48 across).
``latencyInter`` 0, an Intel host (``getNetOverhead`` 1 us), the balanced tree pattern (no 0.85 factor), LL128
enabled (Hopper, paths up to PXN). Not modelled: CollNet/SHARP, symmetric kernels, the CE path.
Pure: numbers in, microseconds out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from .calls import ALLREDUCE, COLLECTIVES, REDUCE, REDUCE_SCATTER, KindTable

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = ("LL", "LL128", "Simple")
TREE, RING, NVLS, NVLS_TREE, PAT = "tree", "ring", "nvls", "nvls_tree", "pat"
ALGORITHMS = (TREE, RING, NVLS, NVLS_TREE, PAT)

# tuning.cc 149-154 baseLatencies (us), by protocol LL / LL128 / Simple.
BASE_LATENCY = {TREE: (6.8, 14.0, 8.4), RING: (6.6, 14.0, 8.4), NVLS: (0.0, 0.0, 0.0), NVLS_TREE: (0.0, 0.0, 0.0),
                PAT: (8.0, 8.0, 8.0)}
# tuning.cc 156-176 hwLatencies[NVLINK | NET][algorithm] (us per hop), by protocol.
HW_LATENCY = {
    ("nvlink", TREE): (0.6, 1.25, 4.0), ("nvlink", RING): (0.6, 1.9, 3.4), ("nvlink", NVLS): (0.0, 0.0, 25.0),
    ("nvlink", NVLS_TREE): (0.0, 0.0, 25.0), ("nvlink", PAT): (0.0, 0.0, 4.0),
    ("net", TREE): (5.0, 8.5, 14.0), ("net", RING): (2.7, 4.0, 14.0), ("net", NVLS): (0.0, 0.0, 18.0),
    ("net", NVLS_TREE): (0.0, 0.0, 20.9), ("net", PAT): (0.0, 0.0, 14.0),
}
# tuning.cc 178-211, by GPU generation (N1 / N2 / N4+ nodes). llMaxBws: one node by GPU, several by CPU (Intel row).
LL_MAX_BW = {"ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0), "intel-cpu": (39.0, 39.0, 20.4)}
PER_CHANNEL_MAX_RING_LL128_BW = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 36.7)}
PER_CHANNEL_MAX_TREE_LL128_BW = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0)}
PER_CHANNEL_MAX_TREE_BW = {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
PER_CHANNEL_MAX_NVLS_TREE_BW = {"ampere": (24.0, 23.6, 17.8), "hopper": (0.0, 57.7, 45.5)}
NVLS_EFFICIENCY = {"ampere": 0.0, "hopper": 0.85}  # tuning.cc 138-143
# tuning.cc 614-620 treeCorrectionFactor[protocol][log2(bytes / 64)].
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
NET_OVERHEAD_US = 1.0  # tuning.cc 226-231 getNetOverhead(): x86 Intel; tripled for Simple (tuning.cc 406)
RING_PLATEAU = 1.4  # tuning.cc 647-649: multi-node ring/Simple AllReduce latency factor (sm >= 80)
MAX_DEV_WORK_BATCH_COLLS = 8  # device.h 389-390: 1024 bytes / sizeof(ncclDevWorkColl)
SM80_NVLINK_BW = 20.0  # topo.h, GB/s per NVLink (A100/A800)
SM90_NVLINK_BW = 20.6  # topo.h, GB/s per NVLink (H100)
SM90_SPEED_INTRA = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)  # search.cc 1057
SM90_SPEED_INTER = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
                    0.12)  # search.cc 1058-1059
SPEED_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)  # search.cc 1051 (below sm_90)
SPEED_INTER = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24,
               0.12)  # search.cc 1052-1053
SM90_MAX_INTER_SPEED = SM90_SPEED_INTER[0]  # GB/s per channel across nodes
NVLINKS = {"hopper": 18, "ampere": 12}  # NVLinks per GPU: H100/H200 SXM, A100 SXM (the A800 has 8)
NIC_BW = 48.0  # GB/s: one 400 Gb/s NIC per GPU, as NCCL rates it (the inter-node speed it starts its search at)

P2P_MAX_PER_BATCH = 8  # device.h 391 NCCL_MAX_DEV_WORK_P2P_PER_BATCH: p2p operations one channel runs at once
P2P_PER_CHANNEL_NET_BW = 14.0  # paths.cc 918 NCCL_P2P_PER_CHANNEL_NET_BW (GB/s one p2p channel is sized for)
MAX_CHANNELS = 64  # device.h MAXCHANNELS
SORTER_MAX_BYTES = 1 << 30  # comm.h 368-369
SORTER_UNIT_LOG2 = 10
SORTER_BITS_PER_POW2 = 2

KINDS = COLLECTIVES  # the call kinds NCCL's model costs, in the order its planner takes its functions


@dataclass(frozen=True)
class Topology:
    """What NCCL's model needs: ranks, nodes, the ring graph's channels and per-channel bandwidth inside / across
    nodes, the communicator's channels, NVLS (NVSwitch multicast) and its graph, and each GPU's links."""

    name: str
    gpus_per_node: int
    nodes: int
    channels: int  # the ring (and tree) graph's channels
    bw_intra: float  # GB/s per graph channel inside a node (used when nodes <= 2, as tuning.cc does)
    bw_inter: float  # GB/s per graph channel across nodes (used when nodes > 2)
    generation: str  # "ampere" or "hopper"
    same_channels: bool = False  # see Note (Reduce latency)
    comm_channels: int = 0  # the communicator's channels (0: twice the graph's); numPipeOps divides by these
    nvls: bool = False  # NVSwitch multicast: NVLS in one node, NVLS_TREE across nodes (Hopper and later)
    nvls_channels: int = 0  # the NVLS graph's channels (one head per GPU of a node; 0: gpus_per_node)
    nvls_bw: float = 0.0  # GB/s per NVLS graph channel, intra = inter as the search sets them
    nvlink_bw: float = 0.0  # GB/s of one GPU's NVLinks (a p2p transfer inside a node)
    nic_bw: float = NIC_BW  # GB/s of one GPU's NIC (a p2p transfer across nodes)
    world_size: int = 0  # 0: nodes x GPUs per node; else the ranks of a network whose last node is partly filled

    def __post_init__(self) -> None:
        if self.generation not in LL_MAX_BW or self.generation == "intel-cpu":
            raise ValueError(f"GPU generation must be 'ampere' or 'hopper', got {self.generation!r}")
        if self.nvls and self.generation != "hopper":
            raise ValueError("NVLS needs Hopper or later (search.cc returns no NVLS graph below sm_90)")

    @property
    def ranks(self) -> int:
        return self.world_size or self.gpus_per_node * self.nodes

    @property
    def bus_bw(self) -> float:
        return self.channels * (self.bw_intra if self.nodes <= 2 else self.bw_inter)

    @property
    def n_comm_channels(self) -> int:
        return self.comm_channels or min(MAX_CHANNELS, 2 * self.channels)


def _per_link(generation: str) -> float:
    """GB/s of one NVLink (topo.h ``SM90_NVLINK_BW`` / ``SM80_NVLINK_BW``)."""
    return SM90_NVLINK_BW if generation == "hopper" else SM80_NVLINK_BW


def nvlinks_of(topo: Topology) -> int | None:
    """The NVLinks per GPU ``topo`` was made with (None: none recorded)."""
    return round(topo.nvlink_bw / _per_link(topo.generation)) if topo.nvlink_bw else None


def _nvls_speed(nvlink: float, heads: int, speeds: Sequence[float], cap: float) -> float:
    """The NVLS graph's speed per head: the first of ``speeds`` (search.cc 1160-1168) at most ``cap`` whose ``heads``
    fit the NVLinks as search.cc 1151 inflates them for non-ring patterns (by n / (n - 1))."""
    total = nvlink * heads / max(heads - 1, 1)
    return next((s for s in speeds if s <= cap and s * heads <= total), speeds[-1])


def nvlink_node(gpus: int = 8, *, generation: str = "hopper", links: int | None = None, channels: int | None = None,
                nvls: bool | None = None) -> Topology:
    """One node of ``gpus`` GPUs on NVSwitch, ``links`` NVLinks per GPU (default: 18 on Hopper, H100/H200; 12 on
    Ampere, A100 SXM; the A800 has 8). The ring graph as ``ring_channels`` finds it (Hopper: 6 rings at 60 GB/s
    duplicated into 12 at 30; A100: 6 at 40 into 12 at 20), unless ``channels`` says. NVLS on Hopper unless told
    otherwise."""
    per_link = _per_link(generation)
    if links is None:
        links = NVLINKS[generation]
    nvlink = links * per_link
    if channels is None:
        channels = ring_channels(nvlink, generation)[0]
    nvls = generation == "hopper" if nvls is None else nvls
    heads = gpus
    nvls_bw = _nvls_speed(nvlink, heads, SM90_SPEED_INTRA, nvlink)
    return Topology(name=f"{gpus}-GPU NVLink node ({generation}, {links} links x {per_link:g} GB/s"
                         f"{', NVLS' if nvls and gpus > 1 else ''})",
                    gpus_per_node=gpus, nodes=1, channels=channels, bw_intra=nvlink / channels, bw_inter=0.0,
                    generation=generation, nvls=nvls and gpus > 1, nvls_channels=heads, nvls_bw=nvls_bw,
                    nvlink_bw=nvlink)


def ring_channels(nvlink: float, generation: str) -> tuple[int, float]:
    """(channels, GB/s each) of NCCL's ring graph inside one NVSwitch node whose GPUs have ``nvlink`` GB/s of
    NVLinks: the search starts at the fastest speed a GPU's NVLinks carry (search.cc 1160-1168: ``sm90SpeedArrayIntra``
    on Hopper, ``speedArrayIntra`` below, 1051-1057) and fits as many rings as they hold (a ring through the switch
    takes its speed from every GPU's links once), then ``ncclTopoDupChannels`` (search.cc 1036-1049) doubles them when
    a ring carries 25 GB/s or more, except on sm_90+ below 50 GB/s with more than 4 rings."""
    speeds = SM90_SPEED_INTRA if generation == "hopper" else SPEED_INTRA
    speed = next((s for s in speeds if s <= nvlink), speeds[-1])
    rings = max(1, int(nvlink // speed))
    return _dup_channels(rings, speed, generation)


def network_channels(nvlink: float, gpus_per_node: int, nic_bw: float, generation: str) -> tuple[int, float]:
    """(channels, GB/s each) of NCCL's ring graph across nodes of ``gpus_per_node`` GPUs (``nvlink`` GB/s of NVLinks
    each, one NIC of ``nic_bw`` per GPU). A channel enters a node at one NIC, passes every GPU through the switch and
    leaves at another NIC, taking its speed from the links of every GPU but the last. The search (search.cc
    1160-1258) starts at the fastest inter-node speed a NIC carries (``sm90SpeedArrayInter`` / ``speedArrayInter``,
    1052-1059) and fits as many channels as the NICs and NVLinks hold: ``G`` channels (one per NIC) need
    ``(G - 1) x speed`` of a GPU's links, fewer need ``channels x speed``. It stops once channels x speed reaches the
    GPU's total NVLink bandwidth (``system->totalBw``, search.cc 30-38 and 1198), else tries the next lower speed
    while it is above 0.49x the best found (1245-1248), keeping the best total; then ``ncclTopoDupChannels`` (1258).
    Hopper, 18 NVLinks: 8 x 48 GB/s, not duplicated; A100, 12 NVLinks: 5 x 48 (the NVLinks' 240 GB/s bound the
    ring), duplicated into 10 x 24; A800, 8 NVLinks: 8 x 20; H800, 8 NVLinks: 8 x 22. Simplified: one channel per NIC
    (the search stops at the NVLinks' total before a NIC would carry two here), no PXN, no cross-NIC rings."""
    speeds = SM90_SPEED_INTER if generation == "hopper" else SPEED_INTER
    g = gpus_per_node
    best = (0, 0.0)
    for speed in (s for s in speeds if s <= nic_bw):
        if best[0] and speed / best[1] <= 0.49:
            break
        fits = g if (g - 1) * speed <= nvlink else min(g - 1, int(nvlink // speed))
        if fits * speed > best[0] * best[1]:
            best = (fits, speed)
        if best[0] * best[1] >= nvlink:
            break
    if not best[0]:
        raise ValueError(f"no ring fits NVLinks of {nvlink:g} GB/s and NICs of {nic_bw:g} GB/s")
    return _dup_channels(best[0], best[1], generation)


def _dup_channels(channels: int, speed: float, generation: str) -> tuple[int, float]:
    """search.cc 1036-1049 ``ncclTopoDupChannels`` (maxChannels is not reached here)."""
    if speed < 25.0 or (generation == "hopper" and speed < 50.0 and channels > 4):
        return channels, speed
    return 2 * channels, speed / 2


def network(nodes: int, gpus_per_node: int = 8, *, nvls: bool = True, generation: str = "hopper",
            links: int | None = None) -> Topology:
    """``nodes`` NVLink nodes of ``gpus_per_node`` GPUs over a network, one 400 Gb/s NIC per GPU: the ring graph's
    channels as ``network_channels`` finds them (Hopper: 8 at 48 GB/s); NVLS_TREE for AllReduce when ``nvls``."""
    intra = nvlink_node(gpus_per_node, generation=generation, links=links)
    nvls = nvls and generation == "hopper" and gpus_per_node > 1
    channels, per_channel = network_channels(intra.nvlink_bw, gpus_per_node, NIC_BW, generation)
    # The NVLS graph across nodes: one head per GPU at an inter-node speed a NIC carries: 48 GB/s with 18 NVLinks, 22
    # with an H800's 8.
    nvls_bw = _nvls_speed(intra.nvlink_bw, gpus_per_node, SM90_SPEED_INTER, NIC_BW)
    links = nvlinks_of(intra)
    shown = "" if links == NVLINKS[generation] else f" ({links} NVLinks each)"
    return Topology(name=f"{nodes} nodes x {gpus_per_node} GPUs{shown}, network ({channels} x {per_channel:g} GB/s"
                         f"{', NVLS_TREE' if nvls else ', no NVLS'})",
                    gpus_per_node=gpus_per_node, nodes=nodes, channels=channels,
                    bw_intra=intra.bus_bw / channels, bw_inter=per_channel, generation=generation,
                    nvls=nvls, nvls_channels=gpus_per_node, nvls_bw=nvls_bw,
                    nvlink_bw=intra.nvlink_bw)


def rail(nodes: int, *, generation: str = "hopper", same_channels: bool = True) -> Topology:
    """A rail: one GPU on each of ``nodes`` nodes (a two-level flush's second level, ``two_level``), each reaching the
    others through its own 400 Gb/s NIC. NCCL's search for one GPU per node: ``ncclTopoCompute`` starts at the first
    inter-node speed the GPU-NIC path carries (search.cc 1160-1172: 48 GB/s, ``sm90SpeedArrayInter[0]``; the same
    first speed in ``speedArrayInter``), which fills the NIC with one channel; ``ncclTopoDupChannels`` (search.cc
    1036-1049) then doubles it into 2 channels of 24 GB/s (bwIntra 48 >= 25, not more than 4 channels); the
    communicator runs twice the graph's channels (connect.cc 460). No NVLS (one GPU per node), ``nodes`` ranks: PAT
    for a ReduceScatter (tuning.cc 534-545, ``ncclPatEnable``), the ring for a Reduce. The ring graph has
    ``sameChannels``: the search tries it first (search.cc 1105-1106) and drops it only when that pass finds no ring
    (search.cc 1204-1207), while one GPU per node has a single GPU order, found at once. So NCCL's table picks a rail
    Reduce's protocol with one hop of latency (tuning.cc 394-396), while its time pays a hop per node (Note (Reduce
    latency), ``physical_latency_us``). ``same_channels=False``: the protocol as a graph without it would pick (the
    sizing's ``--rail-without-same-channels``)."""
    if nodes < 1:
        raise ValueError(f"a rail needs at least one node, got {nodes}")
    graph_channels, per_channel = 2, SM90_MAX_INTER_SPEED / 2
    return Topology(name=f"rail of {nodes} nodes (one GPU per node, {graph_channels} x {per_channel:g} GB/s)",
                    gpus_per_node=1, nodes=nodes, channels=graph_channels, bw_intra=per_channel,
                    bw_inter=per_channel, generation=generation, same_channels=same_channels, nvls=False,
                    nvls_channels=0, nvls_bw=0.0, nvlink_bw=0.0)


A800_NODE = nvlink_node(8, generation="ampere", links=8)  # the published measurement's machine: 8 x 20 GB/s


def named_topology(world_size: int, *, nvls: bool = True) -> Topology | None:
    """The sizing's topology for a world size (``topology_of`` with nodes of 8 GPUs), or None for one rank."""
    if world_size <= 1:
        return None
    return topology_of(world_size, 8, nvls=nvls)


def topology_for(world_size: int) -> Topology:
    """One NVLink node up to 8 GPUs, whole nodes of 8 over a network above (ValueError otherwise)."""
    if world_size > 8 and world_size % 8:
        raise ValueError(f"world size {world_size}: nodes of 8 GPUs need a multiple of 8")
    return topology_of(world_size, 8)


def topology_of(world_size: int, gpus_per_node: int, generation: str = "hopper", *, nvls: bool = True,
                links: int | None = None) -> Topology:
    """The topology for ``world_size`` ranks with ``gpus_per_node`` on each node: one NVLink node when they all fit,
    else nodes over a network. A world size that is not a whole number of nodes keeps ``gpus_per_node`` per node
    and rounds the node count up (NCCL's model sees the node count and ranks; the last node is partly filled).
    ``links``: NVLinks per GPU (default: the generation's, ``NVLINKS``)."""
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world size {world_size} and GPUs per node {gpus_per_node} must be at least 1")
    nvls = nvls and generation == "hopper"
    if world_size <= gpus_per_node:
        return nvlink_node(world_size, generation=generation, nvls=nvls, links=links)
    nodes = -(-world_size // gpus_per_node)
    topo = network(nodes, gpus_per_node, nvls=nvls, generation=generation, links=links)
    if nodes * gpus_per_node != world_size:
        topo = _partial(topo, world_size)
    return topo


def _partial(topo: Topology, world_size: int) -> Topology:
    return replace(topo, name=f"{topo.name}, {world_size} ranks (last node partly filled)", world_size=world_size)


def _steps(kind: str, n: int) -> int:
    return _KIND[kind].steps(n)


def _log2i(x: int) -> int:
    return max(x, 1).bit_length() - 1


def _algorithms(kind: str, topo: Topology) -> tuple[str, ...]:
    """tuning.cc 300-312 and 534-545, enqueue.cc 2000-2007: which algorithms NCCL costs for ``kind`` here."""
    return _KIND[kind].algorithms(topo)


def _reduce_algorithms(topo: Topology) -> tuple[str, ...]:
    return (RING,)


def _reduce_scatter_algorithms(topo: Topology) -> tuple[str, ...]:
    algos = [RING]
    if topo.nvls and topo.nodes == 1:
        algos.append(NVLS)
    if topo.nodes == topo.ranks and topo.nodes > 1:  # ncclPatEnable: one GPU per node
        algos.append(PAT)
    return tuple(algos)


def _allreduce_algorithms(topo: Topology) -> tuple[str, ...]:
    algos = [TREE, RING]
    if topo.nvls:
        algos.append(NVLS if topo.nodes == 1 else NVLS_TREE)
    return tuple(algos)


@dataclass(frozen=True)
class _NcclKind:
    """What NCCL's model needs of one call kind: its ring steps on ``n`` ranks (tuning.cc ``nsteps``), its traffic per
    byte of input (enqueue.cc 91-102 ``trafficBytes``) and the algorithms tuning.cc costs for it here."""

    steps: Callable[[int], int]
    traffic: int
    algorithms: Callable[[Topology], tuple[str, ...]]


# The kinds NCCL's model costs (``calls`` Note (no fall-through)): a hand-off is sends and receives, costed as a p2p
# round (Note (send/recv)), never as a collective.
_KIND: KindTable[str, _NcclKind] = KindTable("NCCL's cost model (planning.collective_time)", {
    ALLREDUCE: _NcclKind(lambda n: 2 * (n - 1), 2, _allreduce_algorithms),
    REDUCE: _NcclKind(lambda n: n, 1, _reduce_algorithms),
    REDUCE_SCATTER: _NcclKind(lambda n: n - 1, 1, _reduce_scatter_algorithms),
}, complete_for=KINDS)


@lru_cache(maxsize=4096)
def table(kind: str, topo: Topology) -> dict[tuple[str, int], tuple[float, float]]:
    """``ncclTopoTuneModel``'s (latency us, algorithm bandwidth GB/s) per (algorithm, protocol) for ``kind``."""
    n, nodes = topo.ranks, topo.nodes
    ppn = n / nodes
    gen = topo.generation
    index2 = min(nodes, 3) - 1
    ll_max = LL_MAX_BW[gen if nodes == 1 else "intel-cpu"][index2]
    nsteps = _steps(kind, n)
    hw = "nvlink" if nodes == 1 else "net"
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for algo in _algorithms(kind, topo):
        for p in (LL, LL128, SIMPLE):
            if algo in (NVLS, NVLS_TREE, PAT) and p != SIMPLE:
                continue
            if algo in (NVLS, NVLS_TREE):
                ch = topo.nvls_channels or topo.gpus_per_node
                if ch < 2:
                    continue
                intra = topo.nvls_bw * NVLS_EFFICIENCY[gen] * (ch - 1) / ch
                intra *= 2.0 if kind == ALLREDUCE else (ppn - 1) / ppn
                inter = topo.nvls_bw * (2 if nodes <= 2 and algo == NVLS_TREE else 1)
                cap = PER_CHANNEL_MAX_NVLS_TREE_BW[gen][index2] if algo == NVLS_TREE else float("inf")
                bus = ch * min(intra, inter, cap)
            else:
                ch = topo.channels
                bus = topo.bus_bw
            if algo == RING and p == LL:
                bus = min(ll_max, bus * 0.5)
            if algo == RING and p == LL128:
                bus = min(bus * 0.92, ch * PER_CHANNEL_MAX_RING_LL128_BW[gen][index2])
            if algo == TREE and kind == ALLREDUCE:
                bus = min(bus * 0.92, ch * PER_CHANNEL_MAX_TREE_BW[gen][index2])
            if algo == TREE and p == LL:
                bus = min(bus / 3.8, ll_max)
            if algo == TREE and p == LL128:
                bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                          ch * PER_CHANNEL_MAX_TREE_LL128_BW[gen][index2])
            if algo == PAT:
                bus *= 0.75
            if not (algo != RING and kind == REDUCE_SCATTER):
                bus *= n / nsteps if algo in (RING, NVLS, NVLS_TREE) else 0.5
            lat = BASE_LATENCY[algo][p]
            intra_lat = HW_LATENCY[("nvlink", algo)][p]
            inter_lat = HW_LATENCY[("net", TREE if ppn == 1 else algo)][p]  # latencyInter: 0
            if algo == RING:
                hop = HW_LATENCY[(hw, RING)][p]
                if kind == REDUCE:
                    if topo.same_channels:
                        lat += hop
                    else:
                        lat += nsteps * (HW_LATENCY[(hw, TREE)][p] if p == SIMPLE else hop)
                else:
                    overhead = NET_OVERHEAD_US * (3 if p == SIMPLE else 1) if nodes > 1 else 0.0
                    intra_lat = max(intra_lat, overhead)
                    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if kind == ALLREDUCE else nodes - 1)
                    lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
            elif algo == TREE:
                lat += 2 * ((n // nodes - 1) * intra_lat + _log2i(nodes) * inter_lat)
            elif algo == NVLS:
                lat = intra_lat + (inter_lat if nodes > 1 else 0.0)
            elif algo == NVLS_TREE:
                lat += intra_lat + 2 * _log2i(nodes) * inter_lat
            elif algo == PAT:
                lat += _log2i(nodes) * (inter_lat / 3.5) + n * 2.8
            if bus > 0:
                out[(algo, p)] = (lat, bus)
    return out


def physical_latency_us(kind: str, algo: str, protocol: int, topo: Topology) -> float:
    """The latency of one call as the data moves: NCCL's (``table``) except where its table takes a shortcut. A ring
    Reduce (or Broadcast) is a chain: every partial sum passes every rank before it reaches the root, so the first byte
    arrives after a hop per rank, ``nsteps`` hops, whatever the graph's ``sameChannels`` (tuning.cc 389-396 charges one
    hop with it: a rule for picking a protocol, not a time). Charged as tuning.cc's own chain branch (389-396 without
    ``sameChannels``: ``nsteps`` x the ring's per-hop latency, the tree's for Simple). See Note (Reduce latency)."""
    lat, _ = table(kind, topo)[(algo, protocol)]
    if kind == REDUCE and algo == RING and topo.same_channels:
        hw = "nvlink" if topo.nodes == 1 else "net"
        hop = HW_LATENCY[(hw, TREE if protocol == SIMPLE else RING)][protocol]
        lat = BASE_LATENCY[RING][protocol] + _steps(kind, topo.ranks) * hop
    return lat


def algo_time_us(kind: str, algo: str, protocol: int, nbytes: int, topo: Topology, pipe_ops: int = 1,
                 physical: bool = False) -> float:
    """``ncclTopoGetAlgoTime``: one (aggregated) task of ``nbytes`` (``ncclFuncMaxSendRecvCount`` bytes: a
    ReduceScatter's whole input) with ``pipe_ops`` pipelined operations; inf where NCCL has no such algorithm.
    ``physical``: with ``physical_latency_us`` in place of NCCL's table latency (the time, not the choice)."""
    entry = table(kind, topo).get((algo, protocol))
    if entry is None:
        return float("inf")
    lat, bw = entry
    if physical:
        lat = physical_latency_us(kind, algo, protocol, topo)
    log_size = _log2i(nbytes >> 6) if nbytes >> 6 else -1
    if algo == TREE and kind == ALLREDUCE and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[protocol][log_size]
    if (algo == RING and protocol == SIMPLE and topo.nodes > 1 and kind == ALLREDUCE
            and nbytes / (topo.n_comm_channels * topo.ranks) >= 64):
        lat *= RING_PLATEAU
    lat_count = pipe_ops if algo == RING else -(-pipe_ops // MAX_DEV_WORK_BATCH_COLLS)
    return lat * lat_count + nbytes / (1000.0 * bw)


def best_algo(kind: str, nbytes: int, topo: Topology, pipe_ops: int = 1, physical: bool = True
              ) -> tuple[float, str, str]:
    """(time us, algorithm, protocol) of what NCCL picks for one task: the fastest by its own table
    (``topoGetAlgoInfo``, enqueue.cc 2028-2045, first minimum in algorithm then protocol order), timed as the data
    moves (``physical``, the default: ``physical_latency_us``) or as NCCL's table says."""
    best = (float("inf"), "", "")
    choice = (RING, SIMPLE)
    for algo in ALGORITHMS:
        for p in (LL, LL128, SIMPLE):
            t = algo_time_us(kind, algo, p, nbytes, topo, pipe_ops)
            if t < best[0]:
                best, choice = (t, algo, PROTOCOLS[p]), (algo, p)
    if physical and best[1]:
        best = (algo_time_us(kind, *choice, nbytes, topo, pipe_ops, physical=True), best[1], best[2])
    return best


def call_time_us(kind: str, nbytes: int, topo: Topology, pipe_ops: int = 1, physical: bool = True) -> float:
    """One call alone in its group (``nbytes``: a ReduceScatter's whole input)."""
    if topo.ranks <= 1 or nbytes <= 0:
        return 0.0
    return best_algo(kind, nbytes, topo, pipe_ops, physical)[0]


def latency_us(kind: str, topo: Topology, protocol: int, algo: str = RING) -> float:
    """tuning.cc's latency of one call by ``algo`` (before the ring plateau factor)."""
    return table(kind, topo)[(algo, protocol)][0]


def traffic_bytes(kind: str, nbytes: int) -> int:
    """enqueue.cc 91-102 ``trafficBytes``: AllReduce 2x, ReduceScatter nRanks x its receive count (its input)."""
    return _KIND[kind].traffic * nbytes


def sorter_bin(traffic: int) -> int:
    """comm.h 381-388: the collective sorter's bin (u32fpEncode of KiB with 4 bins per power of two)."""
    x = min(SORTER_MAX_BYTES, traffic) >> SORTER_UNIT_LOG2
    log2x = _log2i(x | 1)
    bits = SORTER_BITS_PER_POW2
    mantissa = (x >> (log2x - bits if log2x >= bits else 0)) & ((1 << bits) - 1)
    exponent = log2x - (bits - 1) if log2x >= bits else 0
    return exponent << bits | mantissa


@dataclass(frozen=True)
class Aggregate:
    """One aggregated task of a group as NCCL's planner forms it: ``tasks`` calls of ``kind`` and their bytes."""

    kind: str
    tasks: int
    nbytes: int


def aggregates(calls: Iterable[tuple[str, int]]) -> tuple[Aggregate, ...]:
    """``ncclPrepareTasks``: per function, tasks in the sorter's ascending order (descending bins dequeued, then
    reversed per function; within a bin, last inserted first), aggregated while the next task's traffic is under
    4x the aggregate's first."""
    by_kind: dict[str, list[tuple[int, int, int]]] = {}
    for index, (kind, nbytes) in enumerate(calls):
        if nbytes <= 0:
            continue
        by_kind.setdefault(kind, []).append((sorter_bin(traffic_bytes(kind, nbytes)), index, nbytes))
    out: list[Aggregate] = []
    for kind in (k for k in KINDS if k in by_kind):
        tasks = sorted(by_kind[kind], key=lambda t: (t[0], -t[1]))
        i = 0
        while i < len(tasks):
            first = traffic_bytes(kind, tasks[i][2])
            j, total = i, 0
            while j < len(tasks) and (j == i or traffic_bytes(kind, tasks[j][2]) < 4 * first):
                total += tasks[j][2]
                j += 1
            out.append(Aggregate(kind, j - i, total))
            i = j
    return tuple(out)


def group_time_us(calls: Iterable[tuple[str, int]], topo: Topology | None, physical: bool = True) -> float:
    """One ``ncclGroupStart/End`` of (kind, bytes) calls as NCCL plans it: the sum of its aggregates' times, each
    with ``numPipeOps = DIVUP(tasks in the group, communicator channels)``, each as NCCL picks it and timed as the
    data moves (``physical``) or as NCCL's table says."""
    if topo is None or topo.ranks <= 1:
        return 0.0
    return _group_time_us(tuple(calls), topo, physical)


@lru_cache(maxsize=65536)
def _group_time_us(calls: tuple[tuple[str, int], ...], topo: Topology, physical: bool) -> float:
    """``group_time_us`` (cached: the planner costs the same groups for many stage counts and flushes)."""
    aggs = aggregates(calls)
    if not aggs:
        return 0.0
    pipe_ops = -(-sum(a.tasks for a in aggs) // topo.n_comm_channels)
    return sum(best_algo(a.kind, a.nbytes, topo, pipe_ops, physical)[0] for a in aggs)


flush_time_us = group_time_us  # a flush's calls are one group (z1.cpp, and the runtime's ``comm.group``)


@lru_cache(maxsize=256)
def p2p_channels(topo: Topology) -> tuple[int, int]:
    """(p2p channels, channels per peer) as paths.cc 961-1003 computes them: ``pow2Up(nChannels)``; per peer the
    fewest any peer gets (NVLink: 2 x links; network: max(NICs, bandwidth / 14 GB/s)), halved across nodes until
    every peer fits one round of ``DIVUP(nRanks, 8)`` batches. Cached: a topology's channels are fixed, and the
    planner costs a hand-off round per rail and stage of every two-level option."""
    channels = min(MAX_CHANNELS, 1 << max(topo.n_comm_channels - 1, 0).bit_length())
    if topo.nodes > 1:
        per_peer = max(1, -(-int(topo.nic_bw) // int(P2P_PER_CHANNEL_NET_BW)))
        per_peer = 1 << max(per_peer - 1, 0).bit_length()
        while per_peer * -(-topo.ranks // P2P_MAX_PER_BATCH) > channels and per_peer > 1:
            per_peer //= 2
    else:
        links = max(1, nvlinks_of(topo) or 0)
        per_peer = min(channels, 1 << max(2 * links - 1, 0).bit_length())
    return channels, per_peer


@dataclass(frozen=True)
class P2pLoad:
    """The busiest rank of a send/recv round: its peers, the bytes it sends or receives across nodes (through its
    one NIC) and inside its node (NVLink), and the largest single transfer across nodes."""

    peers: int
    remote_bytes: int
    local_bytes: int
    largest_remote: int = 0


def p2p_round_parts(load: P2pLoad, topo: Topology, bw_scale: float = 1.0) -> tuple[float, float]:
    """(latency us, transfer us) of one grouped send/recv round; see Note (send/recv)."""
    if load.peers <= 0 or topo.ranks <= 1:
        return 0.0, 0.0
    channels, per_peer = p2p_channels(topo)
    concurrent = max(1, channels // per_peer) * P2P_MAX_PER_BATCH  # enqueue.cc 1055 maxConcurrent
    waves = -(-load.peers // concurrent)
    hop = HW_LATENCY[("net" if load.remote_bytes else "nvlink", RING)][SIMPLE]
    latency = BASE_LATENCY[RING][SIMPLE] + waves * hop
    remote = 0.0
    if load.remote_bytes:
        nic = topo.nic_bw * bw_scale
        per_peer_bw = per_peer * P2P_PER_CHANNEL_NET_BW * bw_scale
        remote = max(load.remote_bytes / (1000.0 * nic), load.largest_remote / (1000.0 * per_peer_bw))
    local = load.local_bytes / (1000.0 * topo.nvlink_bw * bw_scale) if load.local_bytes else 0.0
    return latency, max(remote, local)


def p2p_round_us(load: P2pLoad, topo: Topology, bw_scale: float = 1.0) -> float:
    """One grouped send/recv round (a hand-off): latency plus transfer (see Note (send/recv))."""
    return sum(p2p_round_parts(load, topo, bw_scale))


def p2p_load(transfers: Sequence[tuple[int, int, int]], ranks_per_node: int, world_size: int) -> P2pLoad:
    """The busiest rank of a round of (src, dst, bytes) transfers: peers and bytes per direction, across nodes and
    inside, maximised over ranks (a receiver's incast counts every sender to it)."""
    peers = [0] * (2 * world_size)
    remote = [0] * (2 * world_size)
    local = [0] * (2 * world_size)
    largest = 0
    for src, dst, nbytes in transfers:
        for slot in (src, world_size + dst):
            peers[slot] += 1
        if src // ranks_per_node != dst // ranks_per_node:
            remote[src] += nbytes
            remote[world_size + dst] += nbytes
            largest = max(largest, nbytes)
        else:
            local[src] += nbytes
            local[world_size + dst] += nbytes
    return P2pLoad(max(peers, default=0), max(remote, default=0), max(local, default=0), largest)


NOTES = """
Note (send/recv): NCCL has no time model for point-to-point operations. A grouped round is charged as NCCL schedules
it: p2p channels and channels per peer as paths.cc 961-1003 computes them (``P2P_PER_CHANNEL_NET_BW`` 14 GB/s per
channel, paths.cc 918), up to ``p2pnChannels / channelsPerPeer * NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` peers at once
(enqueue.cc 1051-1057), each wave of concurrent peers one Simple ring hop (``hwLatencies[NET or NVLINK][RING]
[Simple]``) after one Simple base latency; bytes across nodes leave and arrive through the rank's one NIC (the
busiest sender or receiver, so a receiver's incast is counted), one transfer at most at its channels' 14 GB/s each;
bytes inside a node move over the GPU's NVLinks. ``bw_scale`` (0.5, 0.25) is the sensitivity the docs show.

Note (Reduce latency): tuning.cc 389-396 charges a ring Reduce (or Broadcast) one hop when the ring graph has
``sameChannels`` and ``nsteps`` hops otherwise. A Reduce is a chain: every partial sum passes every rank of the ring
before it reaches the root, on every call and every pipeline stage, so its first byte arrives after a hop per rank.
The one-hop rule exists for NCCL to pick a protocol; it does not time the call. So NCCL's table, shortcut included,
picks the algorithm and protocol (``best_algo``, as the judge of a schedule must: it is what NCCL will run), and the
time is charged with ``nsteps`` hops of that protocol (``physical_latency_us``). Only a graph with ``sameChannels``
differs: every one-GPU-per-node rail (``rail``); every other ring here has none. At 64 and 128 nodes that is
8.4 + 64 x 14 = 904 us and 1.8 ms per Simple rail Reduce (LL128: 0.27 and 0.53 ms), against NCCL's 22 us.
"""
