"""A flush as this rank's program: its calls, hand-off rounds and two-level stages as ordered, named steps.

Why: the runtime used to issue a cached plan by reading anonymous tuples (a stage as a 4-tuple, a hand-off as
(send, peer, offset, count)) and by branching on each call's kind as it went, a kind it did not name falling through
to another call. ``compile_program`` turns a flush plan (its calls, transfers, padding, span and staging moves) into
this rank's steps once per cached plan; ``runtime.executor`` runs any program and refuses a step or a call kind it
does not know. The program holds no tensors, so a flush can be checked here call by call with no device.

The steps (``FlushProgram.steps``), in issue order:
- one-level: a ``Group`` of this rank's calls on the data-parallel communicator, then a ``P2pRound`` for its part of
  the hand-off (a second group: ``runtime.flush`` Note (two groups for a hand-off));
- two-level: a ``Stage`` per pipeline stage (its node ``Group`` on the node stream, then, on the rail stream after
  that stage's node step, this rank's rail ``Group`` and its rail hand-off ``P2pRound``, then its node hand-off
  ``P2pRound`` on the node hand-off communicator: ``two_level`` Note (balanced rails)), then the data-parallel
  ``Group`` on the rail stream.
A rank issues only its own rail's calls; a rail's peers are node indices, a node hand-off's local ranks. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .calls import ALLREDUCE, HANDOFF, LOG_NAMES, NODE, NODE_HANDOFF, RAIL, REDUCE, REDUCE_SCATTER, WORLD, Level
from .collectives import Collective, Transfer, algo_of_calls
from .flush_plan import FlushRange


class P2pOp(NamedTuple):
    """One send (``send``) or receive of a hand-off round: bucket elements ``[offset, +count)`` to or from ``peer``, a
    rank of the round's communicator."""

    send: bool
    peer: int
    offset: int
    count: int


@dataclass(frozen=True)
class Group:
    """One group of calls on the ``level`` communicator, issued on ``stream``'s stream (None: the flush's own)."""

    level: Level
    calls: tuple[Collective, ...]
    stream: Level | None = None


@dataclass(frozen=True)
class P2pRound:
    """One grouped send/recv round on the ``level`` communicator, issued on ``stream``'s stream (None: the flush's)."""

    level: Level
    ops: tuple[P2pOp, ...]
    stream: Level | None = None


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` of a two-level flush: its ``node`` group (always issued, on the node stream); then the rail
    stream waits for it, and issues this rank's ``rail`` group and its ``rail_handoff`` round (None where this rank's
    rail has no call in the stage) and its ``node_handoff`` round (None where it moves nothing)."""

    index: int
    node: Group
    rail: Group | None = None
    rail_handoff: P2pRound | None = None
    node_handoff: P2pRound | None = None


Step = Group | P2pRound | Stage


class StagingMove(NamedTuple):
    """Before a staged flush's calls (``runtime.flush`` Note (staging)): bucket elements ``[src, +count)`` copied to
    the staging buffer's ``[dst, +count)``."""

    src: int
    dst: int
    count: int


class CopySegment(NamedTuple):
    """After the calls: bucket elements ``[src_offset, +count)`` copied into gradient ``param_id``'s grad buffer at
    ``at`` (``whole``: the whole buffer, one segment); ``last``: the buffer's last segment (stage 2 accumulates once
    every segment of the flush has overwritten it)."""

    param_id: int
    src_offset: int
    at: int
    count: int
    whole: bool
    last: bool


@dataclass(frozen=True)
class ProgramCounts:
    """What one run of the program adds to the runtime's counters (``runtime.stats.RuntimeStats``)."""

    collectives: int
    reduce_calls: int
    all_reduce_calls: int
    reduce_scatter_calls: int
    handoff_rounds: int
    sends: int
    recvs: int
    two_level_stages: int = 0
    node_calls: int = 0
    rail_calls: int = 0
    rail_handoffs: int = 0
    node_handoffs: int = 0
    node_handoff_sends: int = 0
    node_handoff_recvs: int = 0


@dataclass(frozen=True)
class FlushProgram:
    """This rank's flush: ``steps`` in issue order; ``collectives`` every call it issues (the hand-off rounds as their
    markers), in the layout's order, and ``log`` their collective-log entries (name, root, count); ``padding``
    zero-filled and ``span`` pre-divided before the steps; ``staged`` the staging moves (none: the calls run on the
    bucket itself); ``copy_out`` and ``split_sizes`` (the span cut into (gap, kept) pairs and a tail) what this rank
    keeps afterwards, in bucket order."""

    steps: tuple[Step, ...]
    collectives: tuple[Collective, ...]
    log: tuple[tuple[str, int | None, int], ...]
    counts: ProgramCounts
    algo: str
    padding: tuple[FlushRange, ...]
    span: int
    staged: tuple[StagingMove, ...] = ()
    copy_out: tuple[CopySegment, ...] = ()
    split_sizes: tuple[int, ...] = ()
    kept: int = 0  # elements this rank keeps (copies into its grad buffers): counted per flush, so summed once here

    @property
    def two_level(self) -> bool:
        return self.counts.two_level_stages > 0



class LevelRanks(NamedTuple):
    """Where this rank sits in a two-level flush: its local rank (the rail it is on) and the ranks per node."""

    local: int
    per_node: int


def compile_program(collectives: Sequence[Collective], transfers: Sequence[Transfer], rank: int, *,
                    padding: Sequence[FlushRange] = (), span: int = 0, levels: LevelRanks | None = None,
                    staged: Sequence[StagingMove] = (), copy_out: Sequence[CopySegment] = ()) -> FlushProgram:
    """Data-parallel rank ``rank``'s program of a flush of ``collectives`` and hand-off ``transfers`` (a layout's, or an
    arrival-order plan's calls with none). ``levels``: this rank's place in a two-level flush (None where there are no
    node and rail communicators: a two-level flush then runs nowhere). ``copy_out``: what it keeps
    (``copy_segments``)."""
    world_p2p = tuple(P2pOp(t.src == rank, t.dst if t.src == rank else t.src, t.offset, t.count)
                      for t in transfers if t.comm == WORLD and rank in (t.src, t.dst))
    steps: list[Step] = []
    counts: dict[str, int] = {}
    two_level = any(c.comm != WORLD for c in collectives)
    if two_level:
        local, per_node = levels if levels is not None else (-1, 1)
        stages = _stages(collectives, transfers, rank, local, per_node)
        collectives = tuple(c for c in collectives if c.comm != RAIL or c.rail == local)  # what this rank issues
        for index, (node, rail, handoff, parts) in enumerate(stages):
            steps.append(Stage(index, Group(NODE, node, NODE),
                               Group(RAIL, rail, RAIL) if rail else None,
                               P2pRound(RAIL, handoff, RAIL) if rail and handoff else None,
                               P2pRound(NODE_HANDOFF, parts, RAIL) if parts else None))
        sends = sum(op.send for _, _, _, parts in stages for op in parts)
        counts = dict(two_level_stages=len(stages), node_calls=sum(len(s[0]) for s in stages),
                      rail_calls=sum(len(s[1]) for s in stages), rail_handoffs=sum(bool(s[2]) for s in stages),
                      node_handoffs=sum(bool(s[3]) for s in stages), node_handoff_sends=sends,
                      node_handoff_recvs=sum(len(s[3]) for s in stages) - sends)
    calls = tuple(c for c in collectives if c.kind != HANDOFF and c.comm == WORLD)
    if calls:
        steps.append(Group(WORLD, calls, RAIL if two_level else None))  # two-level: after the stages, rail stream
    if world_p2p and not two_level:
        steps.append(P2pRound(WORLD, world_p2p))
    kinds = [c.kind for c in collectives if c.comm == WORLD]
    sends = sum(op.send for op in world_p2p)
    return FlushProgram(
        steps=tuple(steps), collectives=tuple(collectives),
        log=tuple((LOG_NAMES[c.comm, c.kind], c.root, c.count) for c in collectives),
        counts=ProgramCounts(len(collectives), kinds.count(REDUCE), kinds.count(ALLREDUCE),
                             kinds.count(REDUCE_SCATTER), int(bool(world_p2p)), sends, len(world_p2p) - sends,
                             **counts),
        algo=algo_of_calls(collectives), padding=tuple(padding), span=span, staged=tuple(staged),
        copy_out=tuple(copy_out), split_sizes=split_sizes(copy_out, span), kept=sum(s.count for s in copy_out))


def _stages(collectives: Sequence[Collective], transfers: Sequence[Transfer], rank: int, local: int, per_node: int
            ) -> list[tuple[tuple[Collective, ...], tuple[Collective, ...], tuple[P2pOp, ...], tuple[P2pOp, ...]]]:
    """Per stage: its node calls, this rank's rail's calls (not its hand-off marker), its rail hand-off's sends and
    receives (peers as rail ranks: node indices) and its node hand-off's (peers as local ranks)."""
    count = 1 + max(c.stage for c in collectives if c.comm == NODE)
    node: list[list[Collective]] = [[] for _ in range(count)]
    rail: list[list[Collective]] = [[] for _ in range(count)]
    handoff: list[list[P2pOp]] = [[] for _ in range(count)]
    parts: list[list[P2pOp]] = [[] for _ in range(count)]
    for c in collectives:
        if c.comm == NODE:
            node[c.stage].append(c)
        elif c.comm == RAIL and c.rail == local and c.kind != HANDOFF:
            rail[c.stage].append(c)
    for t in transfers:
        if rank in (t.src, t.dst) and t.comm in (RAIL, NODE_HANDOFF):
            peer = t.dst if t.src == rank else t.src
            if t.comm == RAIL:
                handoff[t.stage].append(P2pOp(t.src == rank, peer // per_node, t.offset, t.count))
            else:
                parts[t.stage].append(P2pOp(t.src == rank, peer % per_node, t.offset, t.count))
    return [(tuple(node[k]), tuple(rail[k]), tuple(handoff[k]), tuple(parts[k])) for k in range(count)]


def copy_segments(where: Iterable[tuple[int, Callable[[int, int], list[tuple[int, int]]]]],
                  kept: Mapping[int, tuple[int, int]]) -> tuple[CopySegment, ...]:
    """What this rank keeps of a flush, in bucket order: for each ``(param_id, locate)`` (``locate(offset, numel)``: the
    (bucket offset, elements) segments of the gradient's elements ``[offset, +numel)``) whose grad buffer is in
    ``kept`` (param_id -> (its offset in the gradient, its elements); non-empty buffers only), one ``CopySegment`` per
    segment."""
    out = []
    for param_id, locate in where:
        buffer = kept.get(param_id)
        if buffer is None:
            continue
        segments = locate(*buffer)
        at = 0
        for i, (offset, count) in enumerate(segments):
            out.append(CopySegment(param_id, offset, at, count, len(segments) == 1, i == len(segments) - 1))
            at += count
    out.sort(key=lambda s: s.src_offset)
    return tuple(out)


def split_sizes(copy_out: Sequence[CopySegment], span: int) -> tuple[int, ...]:
    """``span`` cut into (gap, kept) pairs, one per segment in bucket order, and a tail: one split yields every
    segment's source."""
    sizes, cursor = [], 0
    for s in copy_out:
        sizes += [s.src_offset - cursor, s.count]
        cursor = s.src_offset + s.count
    sizes.append(span - cursor)
    return tuple(sizes)
