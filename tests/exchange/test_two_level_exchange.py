"""Two-level flushes between in-process ranks that really exchange data over their data-parallel, node and rail
communicators (``ExchangeWorld`` with ``split``), ranks grouped as nodes: every call is matched across the ranks of
its communicator, a rank of one rail issuing another call is reported, and every owner receives the full sum."""

from __future__ import annotations

import pytest
import torch

from tests.support.fakes import (
    ExchangeMismatch,
    ExchangeWorld,
    exchange_backward,
    flat_map,
    group_threads_as_nodes,
    mirror_runtime,
)

NUMELS = [3 + (5 * i) % 13 for i in range(30)]
GRAPH = 11


def _grads(ws: int, rank: int, step: int) -> dict[int, torch.Tensor]:
    """Multiples of ``ws``, different per rank and step: pre-division and every partial sum are exact, so any order of
    addition gives the true sum, and a share lost, doubled or sent to the wrong owner shows."""
    return {pid: ws * (torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1) + 100 * step + 10 * pid)
            for pid, n in enumerate(NUMELS)}


def _world(ws: int, per_node: int, monkeypatch, bucket: int = 64):
    group_threads_as_nodes(monkeypatch, per_node)
    world = ExchangeWorld(ws, timeout_s=20)
    owner_map = flat_map(NUMELS, ws)
    runtimes = world.run(lambda rank: mirror_runtime(owner_map, rank=rank, graph_id=GRAPH, comm=world.comm(rank),
                                                     algo="two_level", bucket=bucket)[0])
    for rt in runtimes:
        rt.record_collectives = True
    return world, runtimes


def _step(world, runtimes, ws: int, step: int) -> None:
    def exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert torch.equal(got, want), f"step {step}, {what}"

    exchange_backward(world, runtimes, lambda rank: _grads(ws, rank, step), GRAPH, list(reversed(range(len(NUMELS)))),
                      exact)


def _rail_layout(monkeypatch, layout: str) -> None:
    from owner_reduce.planning import two_level

    monkeypatch.setattr(two_level, "RAIL_LAYOUTS", (layout,))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["by_owner", "balanced"])
@pytest.mark.parametrize(("ws", "per_node"), [(4, 2), (6, 2), (8, 4)])
def test_two_level_flushes_exchange_over_node_and_rail_communicators(ws, per_node, layout, monkeypatch):
    """By owner (each region on its owner's rail) and balanced (each region cut over every rail, then handed to its
    owner inside the node on the node hand-off communicator: ``two_level`` Note (balanced rails))."""
    _rail_layout(monkeypatch, layout)
    world, runtimes = _world(ws, per_node, monkeypatch)
    for step in range(3):  # learning (arrival order), then the two-level schedule twice
        _step(world, runtimes, ws, step)
    nodes = ws // per_node
    for rank, rt in enumerate(runtimes):
        levels = rt.flusher.levels
        assert (levels.node.role, levels.rail.role, levels.handoff.role) == ("node", "rail", "node hand-off")
        assert levels.handoff.members == levels.node.members
        s = rt.stats
        moved = s.node_handoff_sends + s.node_handoff_recvs
        assert len(levels.handoff.calls) == moved and (moved > 0) == (layout == "balanced"), s
        assert levels.node.members == tuple(range(rank // per_node * per_node, (rank // per_node + 1) * per_node))
        assert levels.rail.members == tuple(range(rank % per_node, ws, per_node))
        assert (levels.node.world_size, levels.rail.world_size) == (per_node, nodes)
        s = rt.stats
        assert s.two_level_flushes > 0 and s.node_calls > 0 and s.rail_calls > 0, s
        # Every call this rank counted went to its node or rail communicator, and met its peers' there.
        assert len(levels.node.calls) == s.node_calls and len(levels.rail.calls) == s.rail_calls
        assert {kind for kind, *_ in rt.comm.calls} <= {"all_reduce", "reduce", "reduce_scatter"}  # arrival order only
    # Ranks of one rail issued the same calls (ExchangeWorld matched each); and so did the ranks of one node.
    for rail in range(per_node):
        members = [runtimes[r].flusher.levels.rail.calls for r in range(rail, ws, per_node)]
        assert all(c == members[0] for c in members), rail


@pytest.mark.timeout(120)
def test_negative_control_a_rank_of_one_rail_issuing_another_call_is_reported(monkeypatch):
    world, runtimes = _world(4, 2, monkeypatch)
    _step(world, runtimes, 4, 0)  # learning
    rail = runtimes[3].flusher.levels.rail  # data-parallel rank 3: rail 1 (ranks 1, 3)
    honest = rail.reduce
    rail.reduce = lambda buf, root: honest(buf, 1 - root)  # the other root
    with pytest.raises(ExchangeMismatch, match=r"on the rail communicator of data-parallel ranks 1, 3 differs across "
                                               r"ranks"):
        _step(world, runtimes, 4, 1)


@pytest.mark.timeout(120)
def test_negative_control_a_balanced_part_handed_to_the_wrong_owner_is_reported(monkeypatch):
    """One rank of a node sends a part to another local rank than its owner: its owner waits for a receive that no
    send matches, and the world reports it."""
    _rail_layout(monkeypatch, "balanced")
    world, runtimes = _world(8, 4, monkeypatch)
    _step(world, runtimes, 8, 0)  # learning
    handoff = runtimes[1].flusher.levels.handoff  # data-parallel rank 1: local rank 1 of node 0
    honest = handoff.send
    handoff.send = lambda buf, peer: honest(buf, (peer + 1) % 4 if (peer + 1) % 4 != 1 else (peer + 2) % 4)
    # The owner's unmatched receive is reported when its wait runs out: 5 s, not the 20 s the learning step was given
    # on a loaded host (the report is the claim, not its timing); every sub-world was made at the split with 20 s.
    for w in (world, *world._subworlds.values()):
        w.timeout_s = 5.0
    with pytest.raises(AssertionError, match=r"node hand-off"):
        _step(world, runtimes, 8, 1)
