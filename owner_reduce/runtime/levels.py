"""The two-level flush's communicators: made, warmed and connected at init, closed with the runtime.

Why at init, on every rank alike: a node or rail communicator is made by a collective of its members
(``ncclCommInitRank``), and its connections take device memory and seconds; made inside a flush they would stall the
first backward, and a rank that decided differently would hang its peers. So the decision comes from the agreement's
rows (``agreement``), the same on every rank, and rank 0 says once what was made (its time and device memory) or why
none was. The hand-offs' peers are connected as a schedule is learned, before its first flush (``comm`` Note (lazy
connections)).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..planning.collectives import NODE, RAIL, TWO_LEVEL, WORLD
from ..planning.connections import KINDS_BY_COMM, handoff_peers
from ..planning.flush_choice import AUTO, FlushCost
from ..planning.settings import ALGO, CALIBRATION, key_name
from ..planning.two_level import TwoLevel, two_level_of
from .comm import ReduceComm
from .flush import Levels
from .schedule import Schedule
from .stats import RuntimeStats, emit, emit_detail

NODE_HANDOFF_ROLE = "node hand-off"  # the communicator's name in messages (``comm`` ``role``)


def make_levels(comm: ReduceComm, cost: FlushCost, facts: list[tuple[int, int]], *, owner_path: bool,
                double_buffer: bool, bucket_size: int, stats: RuntimeStats) -> tuple[FlushCost, Levels | None]:
    """The node and rail communicators (``planning.two_level``) and the cost model that may use them, where a
    two-level flush can run: the owner path on, the algorithm ``auto`` (without a calibration) or ``two_level``, ranks
    in whole nodes of more than one rank on more than one node, and in launcher order (global rank = node x ranks per
    node + local rank, each node on one host: ``facts``, every rank's (local rank, host digest)). Otherwise two-level
    stays off (``cost`` unchanged, no levels); when it was asked for (``two_level``) or the order is not the
    launcher's, rank 0 says why, once. Every input is the same on every rank (the agreement's rows), so every rank
    takes the same branch. A failure after the first split leaves the made communicators to ``close_levels``."""
    force = cost.force
    if cost.topology is None or not owner_path or force not in (AUTO, TWO_LEVEL):
        return cost, None
    if cost.calibration is not None and force != TWO_LEVEL:
        # Not a candidate (``FlushCost``: a calibration times the data-parallel communicator only): no communicator
        # that no flush can use (their creations, their device memory).
        if comm.rank == 0:
            emit(f"owner_reduce: the two-level flush is not a candidate under {key_name(CALIBRATION)} (a calibration "
                 f"times the data-parallel communicator only; {key_name(ALGO)} \"two_level\" forces it): no node or "
                 f"rail communicator made")
        return cost, None
    per_node = cost.topology.gpus_per_node
    levels = two_level_of(cost.topology, per_node)
    if levels is None:
        why = f"{comm.world_size} ranks in nodes of {per_node} are not two or more whole nodes of two or more ranks"
    else:
        why = order_problem(levels, facts)
    if why is not None:
        from deepspeed.utils import logger

        if force == TWO_LEVEL and comm.rank == 0:
            logger.warning(f"owner_reduce: {key_name(ALGO)} \"two_level\" cannot take effect: {why}; each flush takes "
                           f"the cost model's choice among the other algorithms")
        elif levels is not None and comm.rank == 0:
            logger.warning(f"owner_reduce: the two-level flush is off: {why}")
        return cost, None
    started = time.monotonic()
    before = nccl_memory_mark()
    node = comm.split(levels.node_groups(), NODE)  # a failure later in init closes it (``close_levels``)
    rail = comm.split(levels.rail_groups(), RAIL)
    handoff = comm.split(levels.node_groups(), NODE_HANDOFF_ROLE)  # two_level Note (balanced rails)
    node.warm_up(KINDS_BY_COMM[NODE], bucket_size)  # their connections and memory now: the figure below holds them
    rail.warm_up(KINDS_BY_COMM[RAIL], bucket_size)
    seconds = time.monotonic() - started
    used = nccl_memory_since(before)
    memory = "" if used is None else f", {used / 2**20:.0f} MiB of device memory"  # None: no CUDA device
    if not double_buffer:
        buffering = "flushes run in turn on 1 bucket per dtype (double_buffer false)"
    elif before is None:  # no CUDA streams (gloo on CPU): nothing overlaps
        buffering = "flushes run in turn over 2 buckets per dtype (double_buffer true; no CUDA streams here)"
    else:
        buffering = "flushes may overlap over 2 buckets per dtype (double_buffer true)"
    # Under 30 words for rank 0's INFO line; which communicators of what size, and the overlap, at DEBUG.
    line = (f"owner_reduce: two-level flush ready: {levels.nodes} nodes x {per_node} ranks ({comm.name}), "
            f"made in {seconds:.2f} s{memory}; {buffering}")
    detail = (f"owner_reduce: two-level flush: {levels.nodes} node communicators of {per_node} ranks, {per_node} "
              f"rail communicators of {levels.nodes} ranks and {levels.nodes} node hand-off communicators of "
              f"{per_node} ranks (balanced rails); with double_buffer true the node stage of one flush runs under "
              f"the rail stage of the one before")
    stats.two_level_line = line
    if comm.rank == 0:
        emit(line)
        emit_detail(detail)
    return replace(cost, two_level=levels), Levels(node, rail, handoff)


def close_levels(comm: ReduceComm | None) -> None:
    """Close the node and rail communicators (the data-parallel one stays)."""
    if comm is not None:
        comm.close_subs()


def connect_handoffs(comm: ReduceComm | None, levels: Levels | None, schedule: Schedule) -> None:
    """Every rank, as it learns a schedule: the hand-offs' peers connected before its first flush (``comm`` Note (lazy
    connections)); the peers' own ranks learn the same schedule at the same point of the same step."""
    if comm is None or not comm.connects_lazily:
        return
    transfers = [t for flushes in schedule.flushes.values() for f in flushes for t in f.layout.transfers]
    per_node = levels.node.world_size if levels is not None else 1
    for peers in handoff_peers(transfers, comm.rank, per_node):
        target = comm if peers.comm == WORLD else levels.rail if peers.comm == RAIL else levels.handoff
        target.connect_peers(peers.sends, peers.recvs)


def order_problem(levels: TwoLevel, facts: list[tuple[int, int]]) -> str | None:
    """Why the ranks are not in launcher order for ``levels`` given every rank's (local rank, host digest), or None."""
    per_node = levels.ranks_per_node
    wrong = [r for r, (local, _) in enumerate(facts) if local != r % per_node]
    if wrong:
        shown = ", ".join(f"rank {r} has local rank {facts[r][0]}" for r in wrong[:4])
        return (f"ranks are not in launcher order (rank = node x {per_node} + local rank): {shown}"
                + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""))
    split = [m for m, members in enumerate(levels.node_groups()) if len({facts[r][1] for r in members}) > 1]
    if split:
        return (f"the ranks of node {split[0]} ({', '.join(map(str, levels.node_groups()[split[0]]))}) run on "
                f"different hosts")
    return None


def nccl_memory_mark() -> tuple[int, int] | None:
    """(the current CUDA device's free memory, what torch's caching allocator has reserved), or None without CUDA: what
    ``nccl_memory_since`` counts from. No device synchronization: ``ncclCommInitRank`` and a connection setup allocate
    before they return, and a wait on the device here would be the one wait of init without the deadline."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())


def nccl_memory_since(before: tuple[int, int] | None) -> int | None:
    """The device memory taken since ``before`` outside torch's caching allocator: NCCL's communicators and their
    connections (the warm-up's buffer, reserved by torch and kept for the buckets, is not theirs)."""
    after = nccl_memory_mark()
    if before is None or after is None:
        return None
    return max(0, (before[0] - after[0]) - (after[1] - before[1]))
