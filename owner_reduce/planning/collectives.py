"""The calls a flush issues, as plain data: one ``Collective`` per call, and the hand-off's transfers.

Why a module of its own: the flush's layout (``owner_layout``, ``algorithms``), its cost-based choice
(``flush_choice``), its program (``program``) and the sizing that times it all read these records; none of them owns
them. Their kinds and communicators are the vocabulary's (``calls``). Pure: no torch.distributed, no cupy, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .calls import (
    ALLREDUCE,
    HANDOFF,
    KINDS,
    NATIVE,
    NODE,
    NODE_HANDOFF,
    RAIL,
    REDUCE,
    REDUCE_SCATTER,
    TWO_LEVEL,
    WORLD,
    CallKind,
    Level,
)
from .flush_plan import FlushRange

# The vocabulary is defined in ``calls``; its names stay importable from here, beside the records that use them.
__all__ = ["ALLREDUCE", "HANDOFF", "KINDS", "NATIVE", "NODE", "NODE_HANDOFF", "RAIL", "REDUCE", "REDUCE_SCATTER",
           "TWO_LEVEL", "WORLD", "Collective", "Transfer", "algo_of", "algo_of_calls", "collectives_of"]


@dataclass(frozen=True)
class Collective:
    """One call of the flush: ``kind`` over bucket elements ``[offset, offset + count)``.

    ``reduce_scatter``: ``count`` is ``world_size * per_rank``; rank r keeps ``[offset + r * per_rank, +per_rank)``.
    ``reduce``: to ``root``. ``allreduce``: to every rank. ``handoff``: one grouped send/recv round over
    ``[offset, offset + count)`` (the ReduceScatter's span) that moves reduced pieces to their owners; what moves is
    the layout's ``transfers``. It runs after every other call of the flush has completed.

    ``comm``: ``world`` (the data-parallel communicator), ``node`` (the ranks of this rank's node; ``per_rank`` as
    above, over the node's ranks) or ``rail`` (the ranks of every node with the same local rank; ``root`` is a node
    index, and only the ranks whose local rank is ``rail`` issue the call). ``stage``: the two-level pipeline stage.
    """

    kind: CallKind
    offset: int
    count: int
    root: int | None = None
    per_rank: int = 0
    comm: Level = WORLD
    rail: int = -1
    stage: int = 0


@dataclass(frozen=True)
class Transfer:
    """After the flush's ReduceScatter, rank ``src`` holds the reduced bucket elements ``[offset, offset + count)``
    and sends them to rank ``dst``, which keeps them and receives them at the same offsets of its bucket. ``src`` and
    ``dst`` are data-parallel ranks; ``comm`` ``rail``: a two-level flush's hand-off along a rail after its rail
    ReduceScatter in stage ``stage`` (both ranks on that rail; the runtime sends on the rail communicator);
    ``node_handoff``: a balanced two-level flush's hand-off inside a node after stage ``stage``'s rail step (both ranks
    on that node; the runtime sends on the node hand-off communicator, from the rail stream)."""

    src: int
    dst: int
    offset: int
    count: int
    comm: Level = WORLD
    stage: int = 0


def algo_of(kinds: Iterable[str]) -> str:
    """The probe's ``algo=`` value: the kinds of call a flush issued, in a fixed order, ``+``-joined."""
    present = set(kinds)
    return "+".join(k for k in KINDS if k in present) or "none"


def algo_of_calls(collectives: Iterable[Collective]) -> str:
    """The probe's ``algo=`` value of a flush's calls: ``two_level`` when it runs on the node and rail communicators
    (then ``+allreduce`` for gradients that reach every rank), else ``algo_of`` their kinds."""
    calls = list(collectives)
    if any(c.comm != WORLD for c in calls):
        rest = algo_of(c.kind for c in calls if c.comm == WORLD)
        return TWO_LEVEL if rest == "none" else f"{TWO_LEVEL}+{rest}"
    return algo_of(c.kind for c in calls)


def collectives_of(ranges: Sequence[FlushRange]) -> tuple[Collective, ...]:
    """The calls of a plain (arrival-order) flush plan: one per range."""
    return tuple(Collective(ALLREDUCE, r.offset, r.count) if r.root is None else Collective(REDUCE, r.offset, r.count,
                                                                                           r.root) for r in ranges)
