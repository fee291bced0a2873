"""A flush as this rank's program (``planning.program``), as pure logic with no tensors: each rank's steps issue
exactly the layout's calls on their communicators (its own rail's only), in the layout's order, in one group per
level and stage, with the hand-off rounds after the calls they read and every send met by its peer's receive; the
collective log and the counters follow from the program; the copy-out covers what the rank keeps. Negative control:
programs compiled with the wrong local rank issue some rail's calls twice and another's never, which the check finds."""

from __future__ import annotations

import pytest

from owner_reduce.planning import two_level
from owner_reduce.planning.calls import HANDOFF, NODE, NODE_HANDOFF, RAIL, REDUCE, WORLD
from owner_reduce.planning.collective_time import topology_of
from owner_reduce.planning.collectives import ALLREDUCE, Collective, collectives_of
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.flush_plan import FlushRange
from owner_reduce.planning.owner_layout import plan_owner_layout
from owner_reduce.planning.program import (
    CopySegment,
    Group,
    LevelRanks,
    P2pOp,
    P2pRound,
    Stage,
    compile_program,
    copy_segments,
    split_sizes,
)
from tests.support.fakes import flat_map

NUMELS = [37, 5, 64, 3, 90, 11, 26, 8, 55]


def _layout(world_size: int, force: str, per_node: int = 0, monkeypatch=None, step: str = "reduce",
            layout: str = "by_owner"):
    """A flush of part of the model (its owner regions unequal, so a hand-off's chunks cut them), laid out for
    ``force``; two-level on nodes of ``per_node`` with ``step`` and ``layout`` its only rail step and layout."""
    owner_map = flat_map(NUMELS, world_size)
    grads = [(p.param_id, p.numel) for p in owner_map][1:8][::-1]
    topology = topology_of(world_size, per_node or world_size)
    levels = two_level.two_level_of(topology, per_node) if per_node else None
    if monkeypatch is not None:
        monkeypatch.setattr(two_level, "RAIL_STEPS", (step,))
        monkeypatch.setattr(two_level, "RAIL_LAYOUTS", (layout,))
        from owner_reduce.planning import owner_layout

        monkeypatch.setattr(owner_layout, "TWO_LEVEL_MAX_PADDING_SHARE", 4.0)  # a few elements: any padding goes
    return plan_owner_layout(grads, owner_map, cost=FlushCost(topology, 4, force=force, two_level=levels))


def _program(layout, rank: int, levels: LevelRanks | None = None):
    return compile_program(layout.collectives, layout.transfers, rank, padding=layout.padding, span=layout.total,
                           levels=levels)


def test_a_reduce_flush_is_one_group_on_the_data_parallel_communicator():
    layout = _layout(4, "reduce")
    program = _program(layout, 2)
    assert program.steps == (Group(WORLD, layout.collectives),) and program.collectives == layout.collectives
    assert program.log == tuple(("reduce" if c.kind == REDUCE else "all_reduce", c.root, c.count)
                                for c in layout.collectives)
    counts = program.counts
    assert (counts.collectives, counts.reduce_calls, counts.handoff_rounds, counts.two_level_stages) == (
        len(layout.collectives), sum(c.kind == REDUCE for c in layout.collectives), 0, 0)
    assert program.algo == layout.algo == "reduce" and not program.two_level
    assert program.padding == layout.padding and program.span == layout.total


def test_an_arrival_order_plan_is_its_calls_in_one_group():
    calls = collectives_of([FlushRange(0, 8, 1), FlushRange(8, 4, None), FlushRange(12, 6, 0)])
    program = compile_program(calls, (), 0, span=18)
    assert program.steps == (Group(WORLD, calls),)
    assert program.log == (("reduce", 1, 8), ("all_reduce", None, 4), ("reduce", 0, 6))
    assert (program.counts.reduce_calls, program.counts.all_reduce_calls, program.algo) == (2, 1, "reduce+allreduce")


@pytest.mark.parametrize("world_size", [3, 4, 6])
def test_a_hand_off_is_the_reduce_scatter_then_this_ranks_round_every_send_met_by_a_receive(world_size):
    layout = _layout(world_size, "handoff")
    assert layout.transfers and layout.collectives[-1].kind == HANDOFF
    programs = [_program(layout, r) for r in range(world_size)]
    sent, received = set(), set()
    for rank, program in enumerate(programs):
        group, *rest = program.steps
        assert group == Group(WORLD, tuple(c for c in layout.collectives if c.kind != HANDOFF))
        mine = [t for t in layout.transfers if rank in (t.src, t.dst)]
        assert rest == ([P2pRound(WORLD, tuple(P2pOp(t.src == rank, t.dst if t.src == rank else t.src, t.offset,
                                                       t.count) for t in mine))] if mine else [])
        for op in (rest[0].ops if rest else ()):
            (sent if op.send else received).add((rank, op.peer, op.offset, op.count) if op.send
                                               else (op.peer, rank, op.offset, op.count))
        counts = program.counts
        assert (counts.handoff_rounds, counts.sends + counts.recvs) == (int(bool(mine)), len(mine))
        assert program.log[-1] == ("handoff", None, layout.collectives[-1].count)  # the round's marker
    assert sent == received == {(t.src, t.dst, t.offset, t.count) for t in layout.transfers}


def _rails_issued_once(layout, programs, per_node: int) -> list[str]:
    """Problems with ``programs`` (one per rank) against ``layout``: each stage's node group the layout's node calls
    on every rank; each rank's rail group its own rail's calls of that stage, so that every rail call is issued by
    exactly the ranks of its rail (one per node); hand-off rounds on the rail stream after their stage's calls."""
    problems = []
    issued: dict[tuple[int, Collective], int] = {}
    for rank, program in enumerate(programs):
        stages = [s for s in program.steps if isinstance(s, Stage)]
        if len(stages) != layout.stages:
            problems.append(f"rank {rank}: {len(stages)} stages, the layout has {layout.stages}")
        for stage in stages:
            want = tuple(c for c in layout.collectives if c.comm == NODE and c.stage == stage.index)
            if stage.node != Group(NODE, want, NODE):
                problems.append(f"rank {rank} stage {stage.index}: node group {stage.node}")
            for c in stage.rail.calls if stage.rail is not None else ():
                issued[c.rail, c] = issued.get((c.rail, c), 0) + 1
                if c.rail != rank % per_node:
                    problems.append(f"rank {rank} issues rail {c.rail}'s call {c}")
            for round_ in (stage.rail_handoff, stage.node_handoff):
                if round_ is not None and round_.stream != RAIL:
                    problems.append(f"rank {rank} stage {stage.index}: {round_.level} round on {round_.stream}")
        tail = program.steps[len(stages):]
        if tail and tail != (Group(WORLD, tuple(c for c in layout.collectives if c.comm == WORLD), RAIL),):
            problems.append(f"rank {rank}: after the stages {tail}")
    nodes = len(programs) // per_node
    for c in layout.collectives:
        if c.comm == RAIL and c.kind != HANDOFF and issued.get((c.rail, c), 0) != nodes:
            problems.append(f"{c} issued {issued.get((c.rail, c), 0)} times, by {nodes} ranks on its rail")
    return problems


@pytest.mark.parametrize(("step", "rail_layout"), [("reduce", "by_owner"), ("scatter", "by_owner"),
                                                   ("reduce", "balanced"), ("scatter", "balanced")])
@pytest.mark.parametrize(("world_size", "per_node"), [(4, 2), (8, 4), (6, 2)])
def test_a_two_level_flush_is_its_stages_then_the_data_parallel_group(world_size, per_node, step, rail_layout,
                                                                      monkeypatch):
    layout = _layout(world_size, "two_level", per_node, monkeypatch, step, rail_layout)
    assert layout.choice == "two_level" and layout.rail_step == step and layout.rail_layout == rail_layout
    programs = [_program(layout, r, LevelRanks(r % per_node, per_node)) for r in range(world_size)]
    assert _rails_issued_once(layout, programs, per_node) == []
    for rank, program in enumerate(programs):
        assert program.two_level and program.counts.two_level_stages == layout.stages
        local, node = rank % per_node, rank // per_node
        mine = tuple(c for c in layout.collectives if c.comm != RAIL or c.rail == local)
        assert program.collectives == mine and program.algo == layout.algo
        rail_moves = [t for t in layout.transfers if t.comm == RAIL and rank in (t.src, t.dst)]
        node_moves = [t for t in layout.transfers if t.comm == NODE_HANDOFF and rank in (t.src, t.dst)]
        stages = [s for s in program.steps if isinstance(s, Stage)]
        rail_ops = [op for s in stages if s.rail_handoff is not None for op in s.rail_handoff.ops]
        node_ops = [op for s in stages if s.node_handoff is not None for op in s.node_handoff.ops]
        assert len(rail_ops) == len(rail_moves) and len(node_ops) == len(node_moves)
        assert all(0 <= op.peer < world_size // per_node and op.peer != node for op in rail_ops)  # node indices
        assert all(0 <= op.peer < per_node and op.peer != local for op in node_ops)  # local ranks
        assert (bool(rail_ops), bool(node_ops)) == (bool(rail_moves), bool(node_moves))
        assert program.counts.node_handoff_sends + program.counts.node_handoff_recvs == len(node_moves)
    if rail_layout == "balanced":
        assert any(s.node_handoff for p in programs for s in p.steps if isinstance(s, Stage))
    if step == "scatter":
        assert any(s.rail_handoff for p in programs for s in p.steps if isinstance(s, Stage))


def test_negative_control_programs_compiled_for_the_wrong_rail_are_found(monkeypatch):
    layout = _layout(8, "two_level", 4, monkeypatch)
    wrong = [_program(layout, r, LevelRanks(0, 4)) for r in range(8)]  # every rank as if on rail 0
    problems = _rails_issued_once(layout, wrong, 4)
    assert any("issues rail 0's call" in p for p in problems) and any("issued 0 times" in p for p in problems)


def test_the_copy_out_lists_what_this_rank_keeps_in_bucket_order():
    # Gradient 7 whole at 40; gradient 3 in two segments (a two-level flush cut its region at a stage), 5 not kept.
    where = [(7, lambda offset, numel: [(40 + offset, numel)]),
             (3, lambda offset, numel: [(10 + offset, 4), (30 + offset, numel - 4)]),
             (5, lambda offset, numel: [(0, numel)])]
    segments = copy_segments(where, {7: (0, 6), 3: (2, 9)})
    assert segments == (CopySegment(3, 12, 0, 4, False, False), CopySegment(3, 32, 4, 5, False, True),
                        CopySegment(7, 40, 0, 6, True, True))
    assert split_sizes(segments, 50) == (12, 4, 16, 5, 3, 6, 4)
    program = compile_program([Collective(ALLREDUCE, 0, 50)], (), 0, span=50, copy_out=segments)
    assert program.kept == 15 and program.split_sizes == (12, 4, 16, 5, 3, 6, 4)
