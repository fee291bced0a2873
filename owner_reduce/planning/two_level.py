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
is in NCCL's model, which costs one call at a time.

Rank order (``requires``): global rank = node x ranks_per_node + local rank, as torchrun and DeepSpeed's launcher set
it, whole nodes only. Pure: numbers in, a layout out; no torch.distributed, no cupy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .collective_time import REDUCE, REDUCE_SCATTER, Topology, group_time_us, nvlink_node, nvlinks_of, rail
from .collectives import NODE, RAIL, Collective
from .flush_plan import ALL, FlushRange

STAGE_COUNTS = (1, 2, 4, 8, 16, 32)  # the pipeline depths the model compares (ties: fewer stages)


@dataclass(frozen=True)
class TwoLevel:
    """The two communicators of a two-level flush and NCCL's model of each."""

    ranks_per_node: int
    nodes: int
    node: Topology
    rail: Topology

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

    def time_us(self, sizes: Sequence[int], dtype_bytes: int, max_padding: int | None = None
                ) -> tuple[float, TwoLevelGeometry]:
        """(modelled time, layout) of the cheapest pipeline for owner regions of ``sizes`` elements (by rank) that pads
        at most ``max_padding`` elements (None: any). Compared: every stage count of ``STAGE_COUNTS`` and, for each,
        every number of leading stages that run a node ReduceScatter (see Note (unequal blocks)); ties go to fewer
        stages, then to more ReduceScatter stages."""
        blocks = rail_blocks(sizes, self.ranks_per_node)
        lengths = tuple(sum(b) for b in blocks)
        longest = max(lengths, default=0)
        best: tuple[float, TwoLevelGeometry] | None = None
        tried = set()
        for count in STAGE_COUNTS:
            width = -(-longest // count) if longest else 0
            stages = -(-longest // width) if width else 0  # every stage holds part of the longest block
            if not stages or stages in tried:
                continue
            tried.add(stages)
            node_rs, node_tail, rail_us = self._stage_costs(blocks, lengths, width, stages, dtype_bytes)
            for scattered in range(stages, -1, -1):
                if max_padding is not None and sum(max(0, scattered * width - n) for n in lengths) > max_padding:
                    continue
                node_end = rail_end = 0.0
                for stage in range(stages):
                    node_end += node_rs if stage < scattered else node_tail[stage]
                    rail_end = max(node_end, rail_end) + rail_us[stage]
                if best is None or rail_end < best[0]:
                    best = (rail_end, TwoLevelGeometry(self.ranks_per_node, stages, width, scattered, lengths))
        return best if best is not None else (0.0, TwoLevelGeometry(self.ranks_per_node, 0, 0, 0, lengths))

    def _stage_costs(self, blocks: Sequence[Sequence[int]], lengths: Sequence[int], width: int, stages: int,
                     dtype_bytes: int) -> tuple[float, list[float], list[float]]:
        """Per stage of ``width``: the node ReduceScatter's time (the same in every stage), the node Reduces' time if
        the stage is a tail stage, and the slowest rail's grouped Reduces (the same either way)."""
        g = self.ranks_per_node
        node_rs = group_time_us([(REDUCE_SCATTER, g * width * dtype_bytes)], self.node)
        node_tail = [group_time_us([(REDUCE, _slice(n, stage, width) * dtype_bytes) for n in lengths
                                    if _slice(n, stage, width)], self.node) for stage in range(stages)]
        rail_us = [0.0] * stages
        for block in blocks:
            parts: list[list[tuple[str, int]]] = [[] for _ in range(stages)]
            for stage, _, count in _parts(block, width):
                parts[stage].append((REDUCE, count * dtype_bytes))
            for stage, calls in enumerate(parts):
                if calls:
                    rail_us[stage] = max(rail_us[stage], group_time_us(calls, self.rail))
        return node_rs, node_tail, rail_us


def two_level_of(topology: Topology | None, ranks_per_node: int, *, rail_same_channels: bool = True
                 ) -> TwoLevel | None:
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
                    rail(nodes, generation=topology.generation, same_channels=rail_same_channels))


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
    (all stages: today's padded layout where its padding is within the bound; none: Reduces only)."""

    ranks_per_node: int
    stages: int
    width: int  # elements of one block's slice per stage (the node ReduceScatter's per-rank count)
    scattered: int  # the leading stages that run a node ReduceScatter; the rest run node Reduces
    lengths: tuple[int, ...]  # each block's elements (local rank order)
    tail_starts: tuple[tuple[int, ...], ...] = field(init=False)  # tail stage, local rank -> bucket offset
    span: int = field(init=False)  # the bucket elements the blocks take, padding included

    def __post_init__(self) -> None:
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


def two_level_calls(sizes: Sequence[int], geo: TwoLevelGeometry) -> tuple[tuple[Collective, ...],
                                                                          tuple[FlushRange, ...],
                                                                          tuple[FlushRange, ...]]:
    """The calls (per stage: the node ReduceScatter or the node Reduces of the blocks that reach a tail stage, then
    every rail's Reduces), the ranges each owner receives, and the padding of owner regions of ``sizes`` laid out by
    ``geo``."""
    g, w = geo.ranks_per_node, geo.width
    calls: list[list[Collective]] = [[Collective(REDUCE_SCATTER, s * g * w, g * w, per_rank=w, comm=NODE, stage=s)]
                                     for s in range(geo.scattered)]
    for s in range(geo.scattered, geo.stages):
        calls.append([Collective(REDUCE, geo.offset(local, s * w), _slice(n, s, w), root=local, comm=NODE, stage=s)
                      for local, n in enumerate(geo.lengths) if _slice(n, s, w)])
    received: list[FlushRange] = []
    padding: list[FlushRange] = []
    for local, block in enumerate(rail_blocks(sizes, g)):
        at = 0
        for node, size in enumerate(block):
            owner = node * g + local
            for offset, position, count in geo.segments(local, at, size):
                calls[position // w].append(Collective(REDUCE, offset, count, root=node, comm=RAIL, rail=local,
                                                       stage=position // w))
                received.append(FlushRange(offset, count, owner))
            at += size
        for offset, _, count in geo.segments(local, at, geo.padding(local)):
            padding.append(FlushRange(offset, count, ALL))
    return (tuple(c for stage in calls for c in stage), tuple(sorted(received, key=lambda r: r.offset)),
            tuple(sorted(padding, key=lambda r: r.offset)))
