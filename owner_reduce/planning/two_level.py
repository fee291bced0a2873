"""The two-level flush: a ReduceScatter inside each node, then each owner's region reduced across nodes on its rail,
pipelined so that the two levels overlap.

Why: at 512-1024 ranks native's AllReduce runs as NVLS_TREE (the node's reduction in the switch, the node's share up
and down a log-depth tree across nodes), while every one-level candidate of the owner path is a ring over all ranks
(NCCL has no NVLS or tree for a ReduceScatter or a Reduce across nodes): its latency grows with the ranks and eats
the 2x it saves in bytes. ZeRO's owners come in runs of consecutive ranks, and consecutive ranks share a node, so a
flush can be reduced in two steps that each run on a short communicator:

1. **node**: one ReduceScatter on the node communicator (the ``ranks_per_node`` ranks of one node; NVLink, NVLS where
   NCCL has it). The flush is laid out so that local rank ``l``'s block holds the regions of the flush's owners whose
   local rank is ``l`` (every node's), padded to equal blocks; afterwards local rank ``l`` of each node holds its
   node's partial sums of exactly those regions;
2. **rail**: on the rail communicator of local rank ``l`` (rank ``l`` of every node), one Reduce per owner region to
   the owner's node. Each NIC then carries the flush's bytes divided by the ranks per node once (NVLS_TREE carries
   them twice), on a ring ``ranks_per_node`` times shorter.

Pipelined: the blocks are cut into ``stages`` equal slices; stage ``k`` is one node ReduceScatter over slice ``k`` of
every block (laid out contiguously: ``[stage][local rank][slice]``) and then its rail Reduces, so stage ``k + 1``'s
node step overlaps stage ``k``'s rail step (two streams, ordered by events; ``runtime.streams``). The flush costs
about the slower level plus one stage of the other, not their sum. The stage count is the cost model's: each stage
pays its calls' latencies, so more stages hide more of the rail step but pay more latency.

Unequal blocks (``TwoLevelGeometry`` Note (unequal blocks)): a flush's owners rarely fall evenly on the local ranks;
the first ``scattered`` stages run the node ReduceScatter (shorter blocks padded, at most an eighth of the flush), the
rest reduce only the longer blocks' tails, each with a node Reduce to its local rank; the rail step is the same.

Cost (``TwoLevel.time_us``): node stage ``a_k`` = one ReduceScatter of ``ranks_per_node x slice`` elements on the
node topology (a tail stage: its node Reduces, grouped); rail stage ``b_k`` = the slowest rail's grouped Reduces of
its owners' parts in stage ``k`` on the rail topology (``collective_time.rail``), both as NCCL's planner costs a group
(``collective_time.group_time_us``); the node steps run back to back and rail step ``k`` starts when node step ``k``
and rail step ``k - 1`` have ended: ``node_end[k] = node_end[k-1] + a_k``,
``rail_end[k] = max(node_end[k], rail_end[k-1]) + b_k``. Assumed: the levels use disjoint links (NVLink / NVSwitch
for the node, the NIC for the rail), and the SMs both levels' kernels take (one block per channel) are free; neither
is in NCCL's model, which costs one call at a time. The host issues the stages back to back, each its node group, its
rail group(s) and (balanced) its node hand-off round, and node step ``k`` starts no earlier than the host has issued
stages ``1..k`` (``step_plan`` Note (host)): each stage pays its groups' and calls' issue (``host_cost``,
``TwoLevelOption.stage_issue``), so more stages hide more of the rail step but pay more issue as well as latency.

Aligned (``alignment``): every owner region takes a slot of its size rounded up to 16 bytes (``align`` elements) in its
block, the slice width is a multiple of the alignment (a rail ReduceScatter's: of ``nodes`` alignments, so its parts
are too), and a balanced layout cuts a slot at multiples of it; so every node and rail call and every hand-off piece
starts 16-byte aligned. The layout and its cost see the slots: a slot's padding (fewer than ``align`` elements) is
reduced with its region, zero-filled, never received.

Rank order (``requires``): global rank = node x ranks_per_node + local rank, as torchrun and DeepSpeed's launcher set
it, whole nodes only. Pure: numbers in, a layout out; no torch.distributed, no cupy.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .alignment import align_elems, align_up, aligned_cut, slots
from .collective_time import (
    REDUCE,
    REDUCE_SCATTER,
    P2pLoad,
    Topology,
    group_time_us,
    nvlink_node,
    nvlinks_of,
    p2p_round_us,
    rail,
)
from .collectives import HANDOFF, NODE, NODE_HANDOFF, RAIL, Collective, Transfer
from .flush_plan import ALL, FlushRange
from .host_cost import NONE as NO_HOST_COST
from .host_cost import HostCost

STAGE_COUNTS = (1, 2, 4, 8, 16, 32)  # the pipeline depths the model compares (ties: fewer stages)
RAIL_REDUCE, RAIL_SCATTER = "reduce", "scatter"  # a two-level flush's rail step: Note (rail step)
RAIL_STEPS = (RAIL_REDUCE, RAIL_SCATTER)
BY_OWNER, BALANCED = "by_owner", "balanced"  # where an owner's region crosses the nodes: Note (balanced rails)
RAIL_LAYOUTS = (BY_OWNER, BALANCED)


@dataclass(frozen=True)
class TwoLevel:
    """The two communicators of a two-level flush and NCCL's model of each."""

    ranks_per_node: int
    nodes: int
    node: Topology
    rail: Topology
    p2p_bw_scale: float = 1.0  # the rail hand-off's share of its modelled network bandwidth (the sizing's sensitivity)

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    def node_groups(self) -> tuple[tuple[int, ...], ...]:
        """The node communicators' members (data-parallel ranks), in creation order."""
        g = self.ranks_per_node
        return tuple(tuple(range(m * g, (m + 1) * g)) for m in range(self.nodes))

    def rail_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rail communicators' members, in creation order (rail ``l``: local rank ``l`` of every node)."""
        g = self.ranks_per_node
        return tuple(tuple(m * g + local for m in range(self.nodes)) for local in range(g))

    def options(self, sizes: Sequence[int], dtype_bytes: int, max_padding: int | None = None,
                host: HostCost = NO_HOST_COST) -> tuple[TwoLevelOption, ...]:
        """Every pipeline worth comparing for owner regions of ``sizes`` elements (by rank) that pads at most
        ``max_padding`` elements (None: any): per stage count of ``STAGE_COUNTS`` and rail step (Note (rail step)),
        the one whose flush alone is fastest (for the Reduce chains: over how many leading stages run a node
        ReduceScatter, see Note (unequal blocks); ties: more of them), each stage's issue costed by ``host``. The
        step's plan picks among them (``step_plan``), as the flush alone does (``time_us``). Laid out and costed on
        the regions' aligned slots (``alignment``), slices a multiple of the alignment."""
        out: list[TwoLevelOption] = []
        align = align_elems(dtype_bytes)
        slotted = slots(sizes, align)
        for layout in RAIL_LAYOUTS:
            owners = balanced_sizes(slotted, self.ranks_per_node, align) if layout == BALANCED else slotted
            blocks = rail_blocks(owners, self.ranks_per_node)
            lengths = tuple(sum(b) for b in blocks)
            longest = max(lengths, default=0)
            if not longest:
                return ()
            for step in RAIL_STEPS:
                tried = set()
                for count in STAGE_COUNTS:
                    width = align_up(-(-longest // count), align)
                    if step == RAIL_SCATTER:  # every rail rank gets an equal, aligned part
                        width = align_up(width, self.nodes * align)
                    stages = -(-longest // width)  # every stage holds part of the longest block
                    if stages in tried:
                        continue
                    tried.add(stages)
                    option = self._best_option(step, blocks, lengths, width, stages, dtype_bytes, max_padding,
                                               slotted if layout == BALANCED else None, host)
                    if option is not None:
                        out.append(option)
        return tuple(out)

    def time_us(self, sizes: Sequence[int], dtype_bytes: int, max_padding: int | None = None,
                host: HostCost = NO_HOST_COST) -> tuple[float, TwoLevelOption | None]:
        """(modelled time, option) of the fastest pipeline for a flush alone (``options``); ties go to the Reduce
        chains, then fewer stages."""
        best: TwoLevelOption | None = None
        for option in self.options(sizes, dtype_bytes, max_padding, host):
            if best is None or option.alone_us < best.alone_us:
                best = option
        return (best.alone_us, best) if best is not None else (0.0, None)

    def recost(self, sizes: Sequence[int], option: TwoLevelOption, dtype_bytes: int,
               host: HostCost = NO_HOST_COST) -> TwoLevelOption:
        """``option``'s pipeline (its geometry and rail step, as chosen under another model) costed on this one's
        topology: what a choice made at one bandwidth costs at another (the sizing's hand-off sensitivity)."""
        geometry = option.geometry
        balanced = option.rail_layout == BALANCED
        sizes = slots(sizes, geometry.align)
        blocks = rail_blocks(balanced_sizes(sizes, self.ranks_per_node, geometry.align) if balanced else sizes,
                             self.ranks_per_node)
        node_rs, node_tail, rail_us, rail_issue = self._stage_costs(option.rail_step, blocks, geometry.lengths,
                                                                    geometry.width, geometry.stages, dtype_bytes)
        handoff = (self._node_handoff_us(sizes, geometry.width, geometry.stages, dtype_bytes) if balanced
                   else None)
        return replace(option, stage_us=_with_handoff(
            [(node_rs if stage < geometry.scattered else node_tail[stage], rail_us[stage])
             for stage in range(geometry.stages)], handoff[0] if handoff else None),
            stage_issue=_stage_issue(host, geometry, rail_issue, handoff[1] if handoff else None))

    def _best_option(self, step: str, blocks: Sequence[Sequence[int]], lengths: Sequence[int], width: int,
                     stages: int, dtype_bytes: int, max_padding: int | None,
                     balanced: Sequence[int] | None = None, host: HostCost = NO_HOST_COST) -> TwoLevelOption | None:
        """The fastest option of ``stages`` stages of ``width`` for this rail step, alone with its issue, or None where
        every one pads past ``max_padding``. A rail ReduceScatter needs every block's slice whole: node ReduceScatter
        stages only. ``balanced``: the owner regions' sizes, the blocks being their balanced parts (Note (balanced
        rails))."""
        node_rs, node_tail, rail_us, rail_issue = self._stage_costs(step, blocks, lengths, width, stages, dtype_bytes)
        handoff = self._node_handoff_us(balanced, width, stages, dtype_bytes) if balanced is not None else None
        layout = BY_OWNER if balanced is None else BALANCED
        # Each stage's (node, rail) us and issue, as a ReduceScatter stage and as a tail stage: the options below differ
        # only in which of the two each stage takes (the first ``scattered`` the former), so they are computed once.
        scattered_us = _with_handoff([(node_rs, rail_us[stage]) for stage in range(stages)],
                                     handoff[0] if handoff else None)
        tail_us = _with_handoff([(node_tail[stage], rail_us[stage]) for stage in range(stages)],
                                handoff[0] if handoff else None)
        tails = [sum(1 for n in lengths if _slice(n, stage, width)) for stage in range(stages)]
        handoff_calls = handoff[1] if handoff else None
        scattered_issue = [_issue_of(host, 1, rail_issue[stage], handoff_calls, stage) for stage in range(stages)]
        tail_issue = [_issue_of(host, tails[stage], rail_issue[stage], handoff_calls, stage) for stage in range(stages)]
        best: tuple[float, int, tuple[tuple[float, float], ...], tuple[float, ...]] | None = None
        fits = max_padding is None
        for scattered in (range(stages, -1, -1) if step == RAIL_REDUCE else (stages,)):
            # The padding grows with ``scattered``: once within the bound (counting down), it stays within it.
            if not fits:
                if sum(max(0, scattered * width - n) for n in lengths) > max_padding:
                    continue
                fits = True
            stage_us = (*scattered_us[:scattered], *tail_us[scattered:])
            stage_issue = (*scattered_issue[:scattered], *tail_issue[scattered:])
            alone = pipelined_us(stage_us, stage_issue)
            if best is None or alone < best[0]:
                best = (alone, scattered, stage_us, stage_issue)
        if best is None:
            return None
        _, scattered, stage_us, stage_issue = best
        geometry = TwoLevelGeometry(self.ranks_per_node, stages, width, scattered, tuple(lengths),
                                    align_elems(dtype_bytes))
        return TwoLevelOption(geometry, step, stage_us, layout, stage_issue)

    def _node_handoff_us(self, sizes: Sequence[int], width: int, stages: int, dtype_bytes: int
                         ) -> tuple[list[float], list[int]]:
        """Per stage of a balanced layout (Note (balanced rails)): the NVLink hand-off round that moves each owner's
        parts from the other local ranks of its node to it, as the busiest rank of any node sends or receives (one
        grouped send/recv round on the node, ``p2p_round_us`` on the node topology: NVLink bytes, incast counted). Not
        scaled by ``p2p_bw_scale``: that is the sizing's sensitivity to the network's point-to-point bandwidth. Also,
        per stage, the most sends and receives one rank issues in it (its host issue)."""
        out, calls = [], []
        for busiest, peers, issued in _node_handoff_loads(tuple(sizes), self.ranks_per_node, align_elems(dtype_bytes),
                                                          width, stages):
            load = P2pLoad(peers, 0, busiest * dtype_bytes)
            out.append(p2p_round_us(load, self.node) if busiest else 0.0)
            calls.append(issued)
        return out, calls

    def _stage_costs(self, step: str, blocks: Sequence[Sequence[int]], lengths: Sequence[int], width: int,
                     stages: int, dtype_bytes: int
                     ) -> tuple[float, list[float], list[float], list[tuple[int, int]]]:
        """Per stage of ``width``: the node ReduceScatter's time (the same in every stage), the node Reduces' time if
        the stage is a tail stage, the slowest rail's step (the same either way): its grouped Reduces, or its
        ReduceScatter of the stage's slice and then its hand-off round; and the busiest rail's (calls, groups) a rank
        issues for it (a hand-off's sends and receives bounded by twice its busiest rank's peers)."""
        g = self.ranks_per_node
        node_rs = group_time_us([(REDUCE_SCATTER, g * width * dtype_bytes)], self.node)
        node_tail = [group_time_us([(REDUCE, _slice(n, stage, width) * dtype_bytes) for n in lengths
                                    if _slice(n, stage, width)], self.node) for stage in range(stages)]
        rail_us = [0.0] * stages
        issued = [(0, 0)] * stages
        if step == RAIL_SCATTER:
            scatter = group_time_us([(REDUCE_SCATTER, width * dtype_bytes)], self.rail)
            rounds: dict[P2pLoad, float] = {}  # the rails' loads repeat: each distinct one costed once
            for block in blocks:
                for stage, load in enumerate(_rail_handoff_loads(tuple(block), width, stages, self.nodes,
                                                                 dtype_bytes)):
                    handoff = rounds.get(load)
                    if handoff is None:
                        handoff = rounds[load] = p2p_round_us(load, self.rail, self.p2p_bw_scale) if load.peers else 0.0
                    rail_us[stage] = max(rail_us[stage], scatter + handoff)
                    issued[stage] = max(issued[stage], (1 + 2 * load.peers, 1 + (load.peers > 0)))
            return node_rs, node_tail, rail_us, issued
        for block in blocks:
            parts: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
            for stage, _, count in _parts(block, width):
                parts[stage].append((REDUCE, count * dtype_bytes))
            for stage, calls in enumerate(parts):
                if calls:
                    rail_us[stage] = max(rail_us[stage], group_time_us(calls, self.rail))
                    issued[stage] = max(issued[stage], (len(calls), 1))
        return node_rs, node_tail, rail_us, issued


@dataclass(frozen=True)
class TwoLevelOption:
    """One way to run a two-level flush: its layout (``geometry``), its rail step (Note (rail step)) and each stage's
    modelled (node step, rail step) microseconds, which the step's plan schedules on the node and rail streams."""

    geometry: TwoLevelGeometry
    rail_step: str
    stage_us: tuple[tuple[float, float], ...]
    rail_layout: str = BY_OWNER  # where an owner's region crosses the nodes: Note (balanced rails)
    stage_issue: tuple[float, ...] = ()  # the host's us to issue each stage (``host_cost``; empty: none charged)

    @property
    def alone_us(self) -> float:
        """The flush alone: ``pipelined_us`` of its stages behind their issue."""
        return pipelined_us(self.stage_us, self.stage_issue)


@lru_cache(maxsize=1024)
def _node_handoff_loads(sizes: tuple[int, ...], ranks_per_node: int, align: int, width: int, stages: int
                        ) -> tuple[tuple[int, int, int], ...]:
    """Per stage of a balanced layout of owner regions of ``sizes`` (slots) cut in stages of ``width``: the elements
    the busiest rank of any node sends or receives in the node hand-off round, its peers, and the most sends and
    receives one rank issues (``TwoLevel._node_handoff_us``). Cached: the layout's, not the topology's, so a flush's
    pipelines of the same width and the same flush on several clusters count it once."""
    # Per stage, by rank (only the ranks that send or receive: a flush touches few of a large world's owners).
    sent: list[dict[int, int]] = [{} for _ in range(stages)]
    received: list[dict[int, int]] = [{} for _ in range(stages)]
    sends: list[dict[int, int]] = [{} for _ in range(stages)]
    receives: list[dict[int, int]] = [{} for _ in range(stages)]
    for owner, local, part, position, count in _balanced_parts_of(sizes, ranks_per_node, align):
        if part == local:
            continue
        holder = owner - local + part
        for stage in range(position // width, (position + count - 1) // width + 1):
            moved = min(position + count, (stage + 1) * width) - max(position, stage * width)
            sent[stage][holder] = sent[stage].get(holder, 0) + moved
            received[stage][owner] = received[stage].get(owner, 0) + moved
            sends[stage][holder] = sends[stage].get(holder, 0) + 1
            receives[stage][owner] = receives[stage].get(owner, 0) + 1
    return tuple((max([0, *sent[stage].values(), *received[stage].values()]),
                  max([0, *sends[stage].values(), *receives[stage].values()]),
                  max([0, *(sends[stage].get(r, 0) + receives[stage].get(r, 0)
                            for r in sends[stage].keys() | receives[stage].keys())]))
                 for stage in range(stages))


@lru_cache(maxsize=64)
def _balanced_parts_of(sizes: tuple[int, ...], ranks_per_node: int, align: int
                       ) -> tuple[tuple[int, int, int, int, int], ...]:
    """``balanced_parts``, cached for ``_node_handoff_loads``' stage counts of one flush."""
    return tuple(balanced_parts(sizes, ranks_per_node, align))


def _issue_of(host: HostCost, node_calls: int, rail: tuple[int, int], handoff: Sequence[int] | None, stage: int
              ) -> float:
    """One stage's issue (``_stage_issue``): ``node_calls`` node calls in one group, the busiest rail's (calls, groups)
    and a balanced layout's node hand-off sends and receives in one more group."""
    calls, groups = node_calls + rail[0], 1 + rail[1]
    if handoff is not None and handoff[stage]:
        calls, groups = calls + handoff[stage], groups + 1
    return host.issue_us(calls, groups, stages=1)


def _stage_issue(host: HostCost, geometry: TwoLevelGeometry, rail: Sequence[tuple[int, int]],
                 handoff: Sequence[int] | None) -> tuple[float, ...]:
    """The host's us to issue each stage: the node group (one ReduceScatter, or a tail stage's node Reduces, one per
    block reaching it), the busiest rail's group(s) (``rail``: (calls, groups) per stage) and a balanced layout's node
    hand-off round (``handoff``: its busiest rank's sends and receives per stage), ``host_cost.HostCost.issue_us``."""
    out = []
    for stage in range(geometry.stages):
        node_calls = 1 if stage < geometry.scattered else sum(
            1 for n in geometry.lengths if _slice(n, stage, geometry.width))
        out.append(_issue_of(host, node_calls, rail[stage], handoff, stage))
    return tuple(out)


def _with_handoff(stage_us: Sequence[tuple[float, float]], handoff: Sequence[float] | None
                  ) -> tuple[tuple[float, float], ...]:
    """Stage times with a balanced layout's NVLink hand-off (Note (balanced rails)) charged to both streams: it runs
    on the rail stream after the stage's rail step, and its NVLink bytes compete with the node stream's next node
    step, which the schedule does not model as shared links: counted on each, an upper bound."""
    if handoff is None:
        return tuple(stage_us)
    return tuple((node + extra, rail_ + extra) for (node, rail_), extra in zip(stage_us, handoff, strict=True))


def balanced_sizes(sizes: Sequence[int], ranks_per_node: int, align: int = 1) -> list[int]:
    """Per data-parallel rank ``node x G + j``: the elements of rail ``j``'s share of node ``node``'s owner regions
    in a balanced layout (part ``j`` of each, ``alignment.aligned_cut`` into ``G`` parts): what a two-level layout of
    these sizes reduces to that rank (Note (balanced rails))."""
    out = [0] * len(sizes)
    for owner, size in enumerate(sizes):
        if size:
            first = owner - owner % ranks_per_node
            for part, count in enumerate(aligned_cut(size, ranks_per_node, align)):
                out[first + part] += count
    return out


def balanced_parts(sizes: Sequence[int], ranks_per_node: int, align: int = 1) -> list[tuple[int, int, int, int, int]]:
    """(owner, its local rank, part ``j``, position in block ``j``, elements) of every non-empty part of every owner
    region in a balanced layout: block ``j`` holds, node by node, node ``m``'s chunk (``balanced_sizes``' rank
    ``m x G + j``): part ``j`` of each of node ``m``'s owners, by local rank. Part ``j`` of a region is its ``j``-th
    slice of ``alignment.aligned_cut(size, G, align)``, in region order (of a slot: every part aligned)."""
    g = ranks_per_node
    at = [0] * g  # where the next chunk part starts in each block
    out = []
    for first in range(0, len(sizes), g):
        for local in range(g):
            size = sizes[first + local]
            if not size:
                continue
            for part, count in enumerate(aligned_cut(size, g, align)):
                if count:
                    out.append((first + local, local, part, at[part], count))
                    at[part] += count
    return out


def pipelined_us(stage_us: Sequence[tuple[float, float]], issue: Sequence[float] = ()) -> float:
    """Stages of (node, rail) microseconds, node steps back to back, node step ``k`` no earlier than the host has
    issued stages ``1..k`` (``issue``: the host's us per stage, none where left out), rail step ``k`` after node step
    ``k`` and rail step ``k - 1``: when the last rail step ends (``step_plan`` Note (host))."""
    node_end = rail_end = host = 0.0
    for k, (node, rail_) in enumerate(stage_us):
        host += issue[k] if k < len(issue) else 0.0
        node_end = max(node_end, host) + node
        rail_end = max(node_end, rail_end) + rail_
    return rail_end


@lru_cache(maxsize=4096)
def _rail_handoff_loads(block: tuple[int, ...], width: int, stages: int, nodes: int, dtype_bytes: int
                        ) -> tuple[P2pLoad, ...]:
    """``_rail_handoff_load`` of every stage of a block. Cached: the load is the layout's, not the topology's, so the
    same flush sized on several clusters (the tests' Hopper and Ampere nodes, the hand-off sensitivity) costs it
    once."""
    return tuple(_rail_handoff_load(block, stage, width, nodes, dtype_bytes) for stage in range(stages))


def _rail_handoff_load(block: Sequence[int], stage: int, width: int, nodes: int, dtype_bytes: int) -> P2pLoad:
    """The busiest rail rank of ``_rail_transfers``' round (``collective_time.p2p_load`` of it, every peer on another
    node), counted without listing the transfers: a receiver gets its region's part of the slice from every other
    holder of it; a holder sends its part of each region it covers. Regions do not overlap, so a holder inside a
    region (a whole part) sends to that owner only, and only a holder at a region's end can send to two."""
    part = width // nodes
    lo, hi = stage * width, (stage + 1) * width
    end_peers: dict[int, int] = {}
    end_bytes: dict[int, int] = {}
    peers = moved = largest = 0
    key = tuple(block)
    spans = _spans(key)
    # The regions that end at or before the stage's slice hold nothing of it: start at the first that ends past it.
    for owner_node, at, size in spans[bisect_right(_span_ends(key), lo):]:
        if at >= hi:
            break
        start, end = max(at, lo), min(at + size, hi)
        if start >= end:
            continue
        first, last = (start - lo) // part, (end - 1 - lo) // part
        received = senders = 0
        for holder in (first, last) if last > first else (first,):
            if holder != owner_node:
                count = min(end, lo + (holder + 1) * part) - max(start, lo + holder * part)
                end_peers[holder] = end_peers.get(holder, 0) + 1
                end_bytes[holder] = end_bytes.get(holder, 0) + count
                received += count
                senders += 1
                largest = max(largest, count)
        inner = last - first - 1 - (1 if first < owner_node < last else 0)  # whole parts held by others
        if inner > 0:
            peers, moved, largest = max(peers, 1), max(moved, part), max(largest, part)
            received += inner * part
            senders += inner
        peers, moved = max(peers, senders), max(moved, received)
    peers = max([peers, *end_peers.values()])
    moved = max([moved, *end_bytes.values()])
    return P2pLoad(peers, moved * dtype_bytes, 0, largest * dtype_bytes)


@lru_cache(maxsize=4096)
def _spans(block: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(node, start, size) of a block's non-empty regions, in block order."""
    out, at = [], 0
    for node, size in enumerate(block):
        if size:
            out.append((node, at, size))
        at += size
    return tuple(out)


@lru_cache(maxsize=4096)
def _span_ends(block: tuple[int, ...]) -> tuple[int, ...]:
    """Where each of ``_spans``' regions ends in the block (ascending)."""
    return tuple(at + size for _, at, size in _spans(block))


def _rail_transfers(block: Sequence[int], stage: int, width: int, nodes: int, bucket_at: int, dp_of_node: int,
                    local: int = 0) -> list[Transfer]:
    """A rail's hand-off in ``stage`` (rail step ``scatter``): its block's slice ``[stage x width, +width)`` was reduced
    and scattered over the rail, node ``j`` holding its ``j``-th part of ``width / nodes``; every piece of node ``m``'s
    owner region that node ``j != m`` holds moves to node ``m``. ``bucket_at``: where the slice starts in the bucket;
    ranks are ``node x dp_of_node + local``. Ordered by (destination, source)."""
    part = width // nodes
    lo, hi = stage * width, (stage + 1) * width
    moves = []
    key = tuple(block)
    # Only the regions that reach the slice hold pieces of it: from the first that ends past its start.
    for owner_node, at, size in _spans(key)[bisect_right(_span_ends(key), lo):]:
        if at >= hi:
            break
        start, end = max(at, lo), min(at + size, hi)
        while start < end:
            holder = (start - lo) // part
            stop = min(end, lo + (holder + 1) * part)
            if holder != owner_node:
                moves.append(Transfer(holder * dp_of_node + local, owner_node * dp_of_node + local,
                                      bucket_at + start - lo, stop - start, comm=RAIL, stage=stage))
            start = stop
    return sorted(moves, key=lambda t: (t.dst, t.src))


def two_level_of(topology: Topology | None, ranks_per_node: int, *, rail_same_channels: bool = True,
                 p2p_bw_scale: float = 1.0) -> TwoLevel | None:
    """The two-level communicators for ``topology``'s ranks in nodes of ``ranks_per_node``, or None where there is no
    second level to save on: one node, one rank per node, or a last node partly filled (rails of unequal length)."""
    if topology is None or ranks_per_node < 2:
        return None
    n = topology.ranks
    if n % ranks_per_node or n // ranks_per_node < 2:
        return None
    nodes = n // ranks_per_node
    return TwoLevel(ranks_per_node, nodes, nvlink_node(ranks_per_node, generation=topology.generation,
                                                       nvls=topology.nvls, links=nvlinks_of(topology)),
                    rail(nodes, generation=topology.generation, same_channels=rail_same_channels), p2p_bw_scale)


def rail_blocks(sizes: Sequence[int], ranks_per_node: int) -> list[list[int]]:
    """Per local rank ``l``: the region sizes of owners ``l, l + G, l + 2G, ...`` in node order (``G`` ranks per
    node): what local rank ``l``'s block holds, back to back."""
    return [list(sizes[local::ranks_per_node]) for local in range(ranks_per_node)]


def _parts(block: Sequence[int], width: int) -> list[tuple[int, int, int]]:
    """(stage, node index, elements) of each owner region of ``block`` cut at the stage boundaries (``width``)."""
    out = []
    at = 0
    for node, size in enumerate(block):
        end = at + size
        while at < end:
            stage = at // width
            stop = min(end, (stage + 1) * width)
            out.append((stage, node, stop - at))
            at = stop
    return out


def _slice(length: int, stage: int, width: int) -> int:
    """Elements of a block of ``length`` in stage ``stage`` (slices of ``width``)."""
    return min(max(length - stage * width, 0), width)


@dataclass(frozen=True)
class TwoLevelGeometry:
    """Where a two-level flush puts local rank ``l``'s block position ``p``: stage ``s = p // width``; in the first
    ``scattered`` stages at slice ``l`` of the stage's ReduceScatter (``[stage][local rank][slice]``), after them
    packed: each tail stage holds, local rank by local rank, only the blocks that reach it.

    Note (unequal blocks): a node ReduceScatter needs equal blocks, but a flush's owners rarely fall evenly on the
    local ranks (about 20 owners of a 5e8 bucket over 8 local ranks: some blocks hold 3 regions, others 2). Padding
    every block to the longest would grow the bucket and the node step by up to a third; so the stages past
    ``scattered`` carry only the longer blocks' tails, each reduced to its local rank by a node Reduce (grouped, one
    per block that reaches the stage), and the rail step is the same either way. The cost model picks ``scattered``
    (all stages: today's padded layout where its padding is within the bound; none: Reduces only).

    ``align``: the alignment the blocks were laid out for (``alignment``): the width and each block's length (its
    regions' slots) are multiples of it, so every slice and tail starts aligned."""

    ranks_per_node: int
    stages: int
    width: int  # elements of one block's slice per stage (the node ReduceScatter's per-rank count)
    scattered: int  # the leading stages that run a node ReduceScatter; the rest run node Reduces
    lengths: tuple[int, ...]  # each block's elements (local rank order): its regions' slots
    align: int = 1  # elements per 16 bytes of the flush's dtype
    tail_starts: tuple[tuple[int, ...], ...] = field(init=False)  # tail stage, local rank -> bucket offset
    span: int = field(init=False)  # the bucket elements the blocks take, padding included

    def __post_init__(self) -> None:
        if self.width % self.align or any(n % self.align for n in self.lengths):
            raise ValueError(f"owner_reduce: a two-level layout of width {self.width} and blocks {self.lengths} is not "
                             f"aligned to {self.align} elements")
        at = self.scattered * self.ranks_per_node * self.width
        starts = []
        for stage in range(self.scattered, self.stages):
            row = []
            for length in self.lengths:
                row.append(at)
                at += _slice(length, stage, self.width)
            starts.append(tuple(row))
        object.__setattr__(self, "tail_starts", tuple(starts))
        object.__setattr__(self, "span", at)

    def offset(self, local: int, position: int) -> int:
        stage, within = divmod(position, self.width)
        if stage < self.scattered:
            return (stage * self.ranks_per_node + local) * self.width + within
        return self.tail_starts[stage - self.scattered][local] + within

    def segments(self, local: int, position: int, length: int) -> list[tuple[int, int, int]]:
        """(bucket offset, block position, elements) of block ``local``'s ``[position, +length)``, cut per stage."""
        out = []
        end = position + length
        while position < end:
            stop = min(end, (position // self.width + 1) * self.width)
            out.append((self.offset(local, position), position, stop - position))
            position = stop
        return out

    def padding(self, local: int) -> int:
        """Zeros at the end of block ``local`` (its part of the ReduceScatter stages it does not fill)."""
        return max(0, self.scattered * self.width - self.lengths[local])


def two_level_calls(sizes: Sequence[int], geo: TwoLevelGeometry, rail_step: str = RAIL_REDUCE,
                    rail_layout: str = BY_OWNER) -> tuple[tuple[Collective, ...], tuple[FlushRange, ...],
                                                          tuple[FlushRange, ...], tuple[Transfer, ...]]:
    """The calls (per stage: the node ReduceScatter or the node Reduces of the blocks that reach a tail stage, then
    every rail's step: its Reduces, or its ReduceScatter and hand-off; balanced: then the node hand-off round), the
    ranges each owner receives, the padding and the hand-offs' transfers of owner regions of ``sizes`` laid out by
    ``geo``. Each region lies in its slot (``alignment``): the calls and the hand-offs cover the slot, the owner
    receives the region, and the slot's tail is padding (its owner as root)."""
    if rail_layout == BALANCED:
        return _balanced_calls(sizes, geo, rail_step)
    g, w = geo.ranks_per_node, geo.width
    nodes = len(sizes) // g
    slotted = slots(sizes, geo.align)
    calls: list[list[Collective]] = [[Collective(REDUCE_SCATTER, s * g * w, g * w, per_rank=w, comm=NODE, stage=s)]
                                     for s in range(geo.scattered)]
    for s in range(geo.scattered, geo.stages):
        calls.append([Collective(REDUCE, geo.offset(local, s * w), _slice(n, s, w), root=local, comm=NODE, stage=s)
                      for local, n in enumerate(geo.lengths) if _slice(n, s, w)])
    received: list[FlushRange] = []
    padding: list[FlushRange] = []
    transfers: list[Transfer] = []
    for local, block in enumerate(rail_blocks(slotted, g)):
        if rail_step == RAIL_SCATTER:
            for stage in range(geo.stages):
                at = geo.offset(local, stage * w)
                calls[stage].append(Collective(REDUCE_SCATTER, at, w, per_rank=w // nodes, comm=RAIL, rail=local,
                                               stage=stage))
                moves = _rail_transfers(block, stage, w, nodes, at, g, local)
                if moves:
                    calls[stage].append(Collective(HANDOFF, at, w, comm=RAIL, rail=local, stage=stage))
                    transfers += moves
        at = 0
        for node, slot in enumerate(block):
            owner = node * g + local
            if rail_step == RAIL_REDUCE:
                for offset, position, count in geo.segments(local, at, slot):
                    calls[position // w].append(Collective(REDUCE, offset, count, root=node, comm=RAIL, rail=local,
                                                           stage=position // w))
            size = sizes[owner]
            received += [FlushRange(offset, count, owner) for offset, _, count in geo.segments(local, at, size)]
            padding += [FlushRange(offset, count, owner) for offset, _, count in geo.segments(local, at + size,
                                                                                              slot - size)]
            at += slot
        for offset, _, count in geo.segments(local, at, geo.padding(local)):
            padding.append(FlushRange(offset, count, ALL))
    return (tuple(c for stage in calls for c in stage), tuple(sorted(received, key=lambda r: r.offset)),
            tuple(sorted(padding, key=lambda r: r.offset)), tuple(transfers))


def _balanced_calls(sizes: Sequence[int], geo: TwoLevelGeometry, rail_step: str
                    ) -> tuple[tuple[Collective, ...], tuple[FlushRange, ...], tuple[FlushRange, ...],
                               tuple[Transfer, ...]]:
    """``two_level_calls`` of a balanced layout (Note (balanced rails)): the node and rail calls of the layout whose
    owners are the parts' ranks (``balanced_sizes``: rail ``j`` reduces node ``m``'s chunk to local rank ``j`` of node
    ``m``), then per stage one node hand-off round (a ``handoff`` marker on ``node_handoff``) that moves each part to
    its owner at the same bucket offsets; each owner receives its parts where they lie."""
    g, w, align = geo.ranks_per_node, geo.width, geo.align
    slotted = slots(sizes, align)
    calls, _, block_padding, transfers = two_level_calls(balanced_sizes(slotted, g, align), geo, rail_step)
    padding = list(block_padding)
    received: list[FlushRange] = []
    moves: list[Transfer] = []
    before = [0] * len(sizes)  # elements of the owner's slot in its earlier parts
    for owner, local, part, position, count in balanced_parts(slotted, g, align):
        held = min(count, max(0, sizes[owner] - before[owner]))  # the region's elements in this part; then padding
        before[owner] += count
        for offset, at, n in geo.segments(part, position, count):
            if part != local:
                moves.append(Transfer(owner - local + part, owner, offset, n, comm=NODE_HANDOFF, stage=at // w))
        received += [FlushRange(offset, n, owner) for offset, _, n in geo.segments(part, position, held)]
        padding += [FlushRange(offset, n, owner) for offset, _, n in geo.segments(part, position + held, count - held)]
    markers = [Collective(HANDOFF, 0, 0, comm=NODE_HANDOFF, stage=stage) for stage in sorted({t.stage for t in moves})]
    ordered = sorted((*calls, *markers), key=lambda c: c.stage)  # stable: each stage's node, rail, then hand-off
    return (tuple(ordered), tuple(sorted(received, key=lambda r: r.offset)), tuple(sorted(padding,
                                                                                         key=lambda r: r.offset)),
            (*transfers, *sorted(moves, key=lambda t: (t.dst, t.src, t.offset))))


NOTES = """
Note (rail step): a two-level flush's rail step, chosen per flush by the model (``RAIL_STEPS``): ``reduce``, each
owner region's part in the stage reduced to the owner's node by one ring Reduce on its rail (a chain: a hop per
node, ``collective_time`` Note (Reduce latency)); or ``scatter``, the stage's slice of the rail's block reduced and
scattered over the rail by one ReduceScatter (PAT or ring, as NCCL picks on one GPU per node), then one grouped
send/recv round along the rail (the rail hand-off) that moves each piece to its owner's node.

Note (balanced rails): an owner's local rank fixes the rail its region crosses the nodes on, so a flush whose owners
fall unevenly on the local ranks loads its rails unevenly (Llama-13B at ws 1024: the busiest block 6% above the mean;
a flush of 2-3 owners at ws 64 crosses the network on 2-3 of a node's 8 rails), and the busiest rail bounds the
flush. Balanced (``BALANCED``), every owner region's slot is cut into ``G`` parts (``alignment.aligned_cut``), part
``j`` laid out in block ``j`` (node by node, a node's owners by local rank: ``balanced_parts``), so every rail carries
a ``G``-th of every region; the node and rail steps are those of a layout whose owners are the parts' ranks
(``balanced_sizes``), and after each stage's rail step one grouped send/recv round inside each node moves every part to
its owner over NVLink (local rank ``j`` of the owner's node holds part ``j``, reduced there by rail ``j``), at the same
bucket offsets. That round runs on the rail stream (after the rail step it reads) on a node communicator of its own,
which the node stream never uses: NCCL serialises the calls of one communicator across streams, so on the node
communicator the next flush's node step would wait for this flush's rail step, the overlap that pays for the chain
(``step_plan``). Costed as the busiest rank of any node sends or receives (``p2p_round_us``, NVLink), on both
streams (``_with_handoff``); the model chooses it like any option, per flush.
"""
