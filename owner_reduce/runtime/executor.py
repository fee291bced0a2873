"""Runs a flush's program (``planning.program``) on the communicators: the one place that turns a step into calls.

Why one executor: the flush used to issue its calls in two loops of its own, each branching on the call's kind with a
last ``else`` that issued whatever it did not name as an AllReduce or a Reduce. Here every step type and every call
kind is looked up in an explicit table: an unknown step raises ``UnknownStepError``, an unknown kind
``UnknownCallKindError`` (``planning.calls`` Note (no fall-through)), both when the program is bound to a buffer,
before any call of the flush is issued.

Hot path (per flush): ``bind`` makes, once per (program, buffer), every call's view of the buffer and looks its kind's
issuer up; the flusher keeps the result with the bucket (``runtime.flush`` ``_views``). ``run`` then only walks the
steps: a group per step, an issuer call per call. The communicators' methods are looked up at each call, so a
communicator whose method was replaced (a test's negative control) is called as it is now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from ..errors import UnknownStepError
from ..planning.calls import ALLREDUCE, NODE, NODE_HANDOFF, RAIL, REDUCE, REDUCE_SCATTER, WORLD, KindTable, Level
from ..planning.collectives import Collective
from ..planning.program import FlushProgram, Group, P2pRound, Stage
from .comm import ReduceComm


class Levels(NamedTuple):
    """A two-level flush's communicators (``planning.two_level``): this rank's node and rail, and its node's
    hand-off communicator (the same ranks as the node's, used only from the rail stream: ``two_level`` Note (balanced
    rails))."""

    node: ReduceComm
    rail: ReduceComm
    handoff: ReduceComm | None = None

    @property
    def local(self) -> int:
        """This rank's local rank, the rail it is on: its rank in its node communicator (nodes are consecutive)."""
        return self.node.rank




def _reduce(comm: ReduceComm, view: torch.Tensor, call: Collective) -> None:
    comm.reduce(view, call.root)


def _all_reduce(comm: ReduceComm, view: torch.Tensor, call: Collective) -> None:
    comm.all_reduce(view)


def _reduce_scatter(comm: ReduceComm, view: torch.Tensor, call: Collective) -> None:
    comm.reduce_scatter(view, call.per_rank)


# The communicator method each call kind of a group runs as (a hand-off is a ``P2pRound``, never a group's call).
ISSUERS: KindTable[str, Callable[[ReduceComm, torch.Tensor, Collective], None]] = KindTable(
    "the flush executor (runtime.executor)", {REDUCE: _reduce, ALLREDUCE: _all_reduce, REDUCE_SCATTER: _reduce_scatter})

LevelRange = Callable[[int, Level, Sequence[Collective]], AbstractContextManager[Any]]  # (stage, level, calls)


class Executor:
    """Runs programs on this rank's data-parallel communicator and, where a two-level flush can run, its ``levels``."""

    def __init__(self, comm: ReduceComm, levels: Levels | None = None) -> None:
        self._comms: dict[Level, ReduceComm] = {WORLD: comm}
        if levels is not None:
            self._comms[NODE], self._comms[RAIL] = levels.node, levels.rail
            if levels.handoff is not None:
                self._comms[NODE_HANDOFF] = levels.handoff
        self._binders: dict[type, Callable[[Any, torch.Tensor], Any]] = {
            Group: self._bind_group, P2pRound: self._bind_round, Stage: self._bind_stage}
        self._runners: dict[type, Callable[..., None]] = {
            Group: self._group, P2pRound: self._round, Stage: self._stage}

    # ---- binding: once per (program, buffer) -------------------------------------------------------------------

    def bind(self, program: FlushProgram, buffer: torch.Tensor) -> tuple[Any, ...]:
        """Per step, what ``run`` issues it with: each call's issuer, view of ``buffer`` and call; each send or
        receive's direction, view and peer. Raises for a step, a kind or a communicator it lacks."""
        return tuple(self._binder(step)(step, buffer) for step in program.steps)

    def _binder(self, step: Any) -> Callable[[Any, torch.Tensor], Any]:
        binder = self._binders.get(type(step))
        if binder is None:
            raise UnknownStepError(step, tuple(t.__name__ for t in self._binders))
        return binder

    def _comm(self, level: Level) -> ReduceComm:
        comm = self._comms.get(level)
        if comm is None:
            raise RuntimeError(f"owner_reduce: a flush step on the {Level(level).role} communicator, which this rank "
                               f"does not have (a two-level flush without its node and rail communicators)")
        return comm

    def _bind_group(self, step: Group, buffer: torch.Tensor) -> tuple[tuple[Any, torch.Tensor, Collective], ...]:
        self._comm(step.level)
        return tuple((ISSUERS[c.kind], buffer.narrow(0, c.offset, c.count), c) for c in step.calls)

    def _bind_round(self, step: P2pRound, buffer: torch.Tensor) -> tuple[tuple[bool, torch.Tensor, int], ...]:
        self._comm(step.level)
        return tuple((op.send, buffer.narrow(0, op.offset, op.count), op.peer) for op in step.ops)

    def _bind_stage(self, step: Stage, buffer: torch.Tensor) -> tuple[Any, Any, Any, Any]:
        return (self._bind_group(step.node, buffer),
                self._bind_group(step.rail, buffer) if step.rail is not None else None,
                self._bind_round(step.rail_handoff, buffer) if step.rail_handoff is not None else None,
                self._bind_round(step.node_handoff, buffer) if step.node_handoff is not None else None)

    # ---- running: every flush -----------------------------------------------------------------------------------

    def run(self, program: FlushProgram, bound: Sequence[Any], streams: Any, index: int,
            level_range: LevelRange | None = None) -> None:
        """Issue ``program``'s steps (``bound`` by ``bind``) as flush ``index``; ``level_range``: a profiler range
        around each two-level stage's node and rail step (None: none)."""
        runners = self._runners
        for step, views in zip(program.steps, bound, strict=True):
            runner = runners.get(type(step))
            if runner is None:
                raise UnknownStepError(step, tuple(t.__name__ for t in runners))
            runner(step, views, streams, index, level_range)

    def _group(self, step: Group, views: Sequence[Any], streams: Any, index: int, level_range: Any = None) -> None:
        """One group of calls; on its stream where it names one."""
        comm = self._comms[step.level]
        if step.stream is None:  # (no context to enter: this is the one-level flush's every call)
            with comm.group(flush=index):
                for issue, view, call in views:
                    issue(comm, view, call)
            return
        with streams.level(step.stream), comm.group(flush=index):
            for issue, view, call in views:
                issue(comm, view, call)

    def _round(self, step: P2pRound, views: Sequence[Any], streams: Any, index: int, level_range: Any = None) -> None:
        """One grouped send/recv round; on its stream where it names one."""
        comm = self._comms[step.level]
        if step.stream is None:
            with comm.group(flush=index):
                _sends_and_receives(comm, views)
            return
        with streams.level(step.stream), comm.group(flush=index):
            _sends_and_receives(comm, views)

    def _stage(self, step: Stage, views: Sequence[Any], streams: Any, index: int,
               level_range: LevelRange | None = None) -> None:
        """The stage's node group (node stream); the rail stream waits for it (``streams`` Note (two levels)); this
        rank's rail group and then its rail hand-off round (a second group: ``runtime.flush`` Note (two groups for a
        hand-off)), one range on the rail stream; then its node hand-off round (rail stream, node hand-off
        communicator: ``streams`` Note (node hand-off))."""
        node_views, rail_views, handoff_views, parts_views = views
        node = self._comms[NODE]
        with (level_range(step.index, NODE, step.node.calls) if level_range is not None else nullcontext()), \
                streams.level(NODE), node.group(flush=index):
            for issue, view, call in node_views:
                issue(node, view, call)
        streams.node_stage_done()
        if step.rail is not None:
            rail = self._comms[RAIL]
            with (level_range(step.index, RAIL, step.rail.calls) if level_range is not None else nullcontext()), \
                    streams.level(RAIL):
                with rail.group(flush=index):
                    for issue, view, call in rail_views:
                        issue(rail, view, call)
                if step.rail_handoff is not None:
                    with rail.group(flush=index):
                        _sends_and_receives(rail, handoff_views)
        if step.node_handoff is not None:
            self._round(step.node_handoff, parts_views, streams, index)


def _sends_and_receives(comm: ReduceComm, views: Sequence[tuple[bool, torch.Tensor, int]]) -> None:
    for send, view, peer in views:
        if send:
            comm.send(view, peer)
        else:
            comm.recv(view, peer)
