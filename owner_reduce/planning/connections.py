"""What each communicator is made to connect at init, and at the learning of a schedule, so that no flush pays NCCL's
lazy connections (issue 46, finding 5).

Why: with ``NCCL_RUNTIME_CONNECT=1`` (the default since NCCL 2.22: ``init.cc`` sets ``comm->runtimeConn``) a
communicator connects nothing at ``ncclCommInitRank``. A collective's first task with an algorithm not yet connected
(``enqueue.cc`` ``ncclPrepareTasks``: ``initAlgoChannels[task->algorithm] == false`` sets ``algoNeedConnect``) and a
send or receive to a peer not seen before (``sendSeen``/``recvSeen``, then every one of ``p2pnChannelsPerPeer``
channels marked for that direction) are connected inside that ``ncclGroupEnd``, on the host: a bootstrap exchange
with the peers and device allocations. A flush would carry that time (and the measured guard might time it), an
out-of-memory would come at the first flush instead of at init, and the init line's memory figure would leave it out.

So at init every collective kind any flush may issue on a communicator runs once at each size of a doubling ladder up
to the bucket (``warm_up_counts``): NCCL picks the algorithm by size (``tuning.cc``), and every band of its choice
that is at least twice as wide as it starts gets a call. Sends and receives connect per peer and direction whatever
the size, so each pair a learned schedule's hand-offs use is connected with one element when the schedule is learned,
before its first flush (``handoff_peers``). Pure: no torch.distributed, no cupy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .collectives import ALLREDUCE, NODE, NODE_HANDOFF, RAIL, REDUCE, REDUCE_SCATTER, WORLD, Transfer

# The collective kinds a flush may issue on each communicator (``flush`` issues: a one-level flush's calls and the
# arrival-order flushes' on the data-parallel one, a two-level flush's node stage and rail step on the others); the
# node hand-off communicator only sends and receives.
KINDS_BY_COMM = {WORLD: (REDUCE, ALLREDUCE, REDUCE_SCATTER), NODE: (REDUCE_SCATTER, REDUCE),
                 RAIL: (REDUCE, REDUCE_SCATTER), NODE_HANDOFF: ()}
NATIVE_KINDS = (ALLREDUCE,)  # the data-parallel communicator's with the owner path off: native's AllReduces only


def warm_up_counts(max_count: int, world_size: int) -> tuple[int, ...]:
    """The element counts of each kind's warm-up calls: one element per rank, doubling, up to ``max_count`` (the
    bucket's elements: no flush call is larger), each a multiple of ``world_size`` (a ReduceScatter's input)."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    top = max(world_size, -(-max_count // world_size) * world_size)
    counts = []
    count = world_size
    while count < top:
        counts.append(count)
        count *= 2
    counts.append(top)
    return tuple(counts)


@dataclass(frozen=True)
class Peers:
    """One communicator's point-to-point connections a schedule needs: the ranks (of that communicator) this rank
    sends to and receives from."""

    comm: str
    sends: tuple[int, ...]
    recvs: tuple[int, ...]


def handoff_peers(transfers: Iterable[Transfer], rank: int, ranks_per_node: int) -> tuple[Peers, ...]:
    """The peers of ``rank`` (a data-parallel rank) in ``transfers``, by communicator, as that communicator numbers
    its ranks: the data-parallel one's as they are, a rail's by node (``rank // ranks_per_node``), a node hand-off's
    by local rank (``rank % ranks_per_node``), as the flush issues them (``flush._make``)."""
    sends: dict[str, set[int]] = {}
    recvs: dict[str, set[int]] = {}
    for t in transfers:
        if rank not in (t.src, t.dst) or t.src == t.dst:
            continue
        peer = t.dst if t.src == rank else t.src
        local = peer // ranks_per_node if t.comm == RAIL else peer % ranks_per_node if t.comm == NODE_HANDOFF else peer
        (sends if t.src == rank else recvs).setdefault(t.comm, set()).add(local)
    return tuple(Peers(comm, tuple(sorted(sends.get(comm, ()))), tuple(sorted(recvs.get(comm, ()))))
                 for comm in (WORLD, RAIL, NODE_HANDOFF) if comm in sends or comm in recvs)
