"""The vocabulary (``planning.calls``) as pure logic: call kinds, levels and algorithm names read as the strings they
replaced (plans, logs, JSON, reprs), each kind carries its other spellings, and a call kind a site's table lacks
raises ``UnknownCallKindError`` naming the kind and the site, at every site that maps kinds (Note (no fall-through)):
NCCL's cost model, the calibration and its timed calls, the sizing, the collective log, the executor. The executor
runs on a recording communicator and a CPU tensor: no collective, no process."""

from __future__ import annotations

import contextlib
import json
import pickle
from dataclasses import replace

import pytest
import torch

from owner_reduce.planning import collective_time as ct
from owner_reduce.planning.calibration import Calibration, KindFit
from owner_reduce.planning.calls import (
    ALLREDUCE,
    COLLECTIVES,
    HANDOFF,
    KINDS,
    LOG_NAMES,
    NODE,
    NODE_HANDOFF,
    RAIL,
    REDUCE,
    REDUCE_SCATTER,
    WORLD,
    Algo,
    KindTable,
    Level,
    UnknownCallKindError,
)
from owner_reduce.planning.collectives import Collective, algo_of, algo_of_calls
from owner_reduce.planning.flush_choice import FlushCost
from owner_reduce.planning.owner_layout import plan_owner_layout
from owner_reduce.planning.program import FlushProgram, Group, ProgramCounts, compile_program
from owner_reduce.planning.sizing import issued_groups
from owner_reduce.runtime.executor import Executor, UnknownStepError
from tests.support.fakes import flat_map

NEW = "all_gather"  # a call kind no table holds: what a kind added to the vocabulary is at every site that lacks it

# ---- the spellings ----------------------------------------------------------------------------------------------


def test_each_kind_is_its_string_everywhere_it_shows():
    for kind, value in ((REDUCE_SCATTER, "reduce_scatter"), (HANDOFF, "handoff"), (REDUCE, "reduce"),
                        (ALLREDUCE, "allreduce")):
        assert kind == value and hash(kind) == hash(value) and {value: 1}[kind] == 1
        assert str(kind) == f"{kind}" == f"{kind:s}" == value and repr(kind) == repr(value)
        assert json.dumps({kind: [kind]}) == json.dumps({value: [value]})
    assert f"{ALLREDUCE:>12}|" == f"{'allreduce':>12}|"
    # A plan's repr reads as before: the members print as the strings they replaced.
    assert repr(Collective(REDUCE, 0, 4, 1, comm=RAIL)) == repr(Collective("reduce", 0, 4, 1, comm="rail"))
    assert pickle.loads(pickle.dumps(ALLREDUCE)) is ALLREDUCE


def test_each_kind_carries_its_other_spellings():
    assert [(k.log, k.nccl) for k in (ALLREDUCE, REDUCE, REDUCE_SCATTER)] == [
        ("all_reduce", "allReduce"), ("reduce", "reduce"), ("reduce_scatter", "reduceScatter")]
    assert KINDS == (REDUCE_SCATTER, HANDOFF, REDUCE, ALLREDUCE) and COLLECTIVES == (ALLREDUCE, REDUCE, REDUCE_SCATTER)
    assert [level.role for level in Level] == ["data-parallel", "node", "rail", "node hand-off"]
    assert [a.value for a in Algo] == ["reduce_scatter", "reduce", "allreduce", "handoff", "native", "two_level"]
    # The probe's algo= values, as DESIGN.md's formats give them.
    assert algo_of([ALLREDUCE, HANDOFF, REDUCE_SCATTER]) == "reduce_scatter+handoff+allreduce"
    assert algo_of_calls([Collective(REDUCE_SCATTER, 0, 8, per_rank=4, comm=NODE),
                          Collective(ALLREDUCE, 8, 4)]) == "two_level+allreduce"
    assert [LOG_NAMES[WORLD, k] for k in KINDS] == ["reduce_scatter", "handoff", "reduce", "all_reduce"]
    assert (LOG_NAMES[NODE, REDUCE_SCATTER], LOG_NAMES[RAIL, HANDOFF], LOG_NAMES[NODE_HANDOFF, HANDOFF]) == (
        "node_reduce_scatter", "rail_handoff", "node_handoff")


# ---- the tables ---------------------------------------------------------------------------------------------------


def test_a_table_names_its_site_and_the_kind_it_lacks():
    table = KindTable("the test's site", {REDUCE: 1})
    assert table[REDUCE] == table["reduce"] == 1 and table.get(NEW) is None and NEW not in table
    with pytest.raises(UnknownCallKindError, match=r"the test's site has no entry for the call kind 'all_gather'"):
        table[NEW]
    error = pickle.loads(pickle.dumps(UnknownCallKindError(NEW, "the test's site")))  # crosses process boundaries
    assert (error.kind, error.site) == (NEW, "the test's site") and "the test's site" in str(error)


def test_a_table_that_must_be_complete_fails_when_it_is_made():
    """A kind added to the vocabulary and missing from a table that must hold every kind fails at import."""
    with pytest.raises(UnknownCallKindError, match=r"a complete site has no entry for the call kind 'reduce_scatter'"):
        KindTable("a complete site", {ALLREDUCE: 1, REDUCE: 2}, complete_for=COLLECTIVES)
    assert len(KindTable("a complete site", dict.fromkeys(COLLECTIVES, 0), complete_for=COLLECTIVES)) == 3


# ---- every site, one kind it lacks ------------------------------------------------------------------------------

def _raises_naming(site: str, call, kind=NEW):
    with pytest.raises(UnknownCallKindError) as error:
        call()
    assert error.value.site.startswith(site) and error.value.kind == kind, error.value
    assert site in str(error.value) and repr(kind) in str(error.value)


def test_the_cost_model_refuses_a_kind_it_does_not_cost():
    topo = ct.topology_of(16, 8)
    assert ct.group_time_us([(REDUCE, 1 << 20)], topo) > 0  # a kind it costs
    _raises_naming("NCCL's cost model", lambda: ct.group_time_us([(NEW, 1 << 20)], topo))
    _raises_naming("NCCL's cost model", lambda: ct.call_time_us(NEW, 1 << 20, topo))
    _raises_naming("NCCL's cost model", lambda: ct.group_time_us([(HANDOFF, 1 << 20)], topo), HANDOFF)  # a p2p round


def test_the_calibration_refuses_a_kind_it_does_not_time():
    calibration = Calibration(world_size=2, backend="test", device="cpu", fits=tuple(
        KindFit(k, 10.0, 100.0) for k in COLLECTIVES), p2p=None, measured_at="2026-12-06T00:00:00Z")
    assert calibration.call_us(REDUCE, 1000) == pytest.approx(10.01)
    _raises_naming("the calibration", lambda: calibration.call_us(NEW, 1000))
    cost = FlushCost(ct.topology_of(2, 2), calibration=calibration)  # its calls grouped as NCCL's planner does first
    _raises_naming("NCCL's cost model", lambda: cost.calls_us([(NEW, 1000)]))


def test_the_calibrations_timed_calls_refuse_a_kind_they_do_not_issue():
    from owner_reduce.runtime import calibrate

    comm = _Recording()
    send = torch.zeros(64)
    calibrate._issuer(comm, calibrate._Measurement(REDUCE, 64 * 4), send, send, 1)()
    assert comm.calls == [("reduce", 0, 64)]
    _raises_naming("the calibration's timed calls", lambda: calibrate._issuer(
        comm, calibrate._Measurement(NEW, 64 * 4), send, send, 1))


def test_the_sizing_refuses_a_kind_it_cannot_list():
    layout = plan_owner_layout([(0, 8), (1, 8)], flat_map([8, 8], 2), cost=FlushCost(ct.topology_of(2, 2),
                                                                                      force="reduce"))
    assert [c.kind for c in issued_groups(layout, 2)[0]] == [REDUCE, REDUCE]
    strange = replace(layout, collectives=(*layout.collectives, Collective(NEW, 0, 16)))
    _raises_naming("the sizing's issued calls", lambda: issued_groups(strange, 2))


def test_the_collective_log_refuses_a_kind_it_has_no_name_for():
    assert compile_program([Collective(REDUCE, 0, 8, 1)], (), 0).log == (("reduce", 1, 8),)
    _raises_naming("the collective log", lambda: compile_program([Collective(NEW, 0, 8)], (), 0), (WORLD, NEW))
    _raises_naming("the collective log", lambda: compile_program([Collective(ALLREDUCE, 0, 8, comm=NODE)], (), 0),
                   (NODE, ALLREDUCE))  # no flush issues an AllReduce on a node communicator


class _Recording:
    """A communicator that records its calls (the executor's seam): nothing is reduced."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None, int]] = []

    @contextlib.contextmanager
    def group(self, flush=None):  # noqa: ANN001, ANN202
        yield

    def reduce(self, buf, root):  # noqa: ANN001, ANN201
        self.calls.append(("reduce", root, buf.numel()))

    def all_reduce(self, buf):  # noqa: ANN001, ANN201
        self.calls.append(("all_reduce", None, buf.numel()))

    def reduce_scatter(self, buf, per_rank):  # noqa: ANN001, ANN201
        self.calls.append(("reduce_scatter", per_rank, buf.numel()))


def _program(*steps) -> FlushProgram:
    return FlushProgram(steps=steps, collectives=(), log=(), counts=ProgramCounts(0, 0, 0, 0, 0, 0, 0), algo="",
                        padding=(), span=16)


def test_the_executor_refuses_a_kind_or_a_step_it_does_not_know_before_it_issues_anything():
    comm = _Recording()
    executor = Executor(comm)
    buffer = torch.zeros(16)
    good = _program(Group(WORLD, (Collective(REDUCE, 0, 8, 1), Collective(ALLREDUCE, 8, 8),
                                  Collective(REDUCE_SCATTER, 0, 16, per_rank=8))))
    executor.run(good, executor.bind(good, buffer), streams=None, index=1)
    assert comm.calls == [("reduce", 1, 8), ("all_reduce", None, 8), ("reduce_scatter", 8, 16)]
    for kind in (NEW, HANDOFF):  # a hand-off is a round of sends and receives, never a group's call
        strange = _program(Group(WORLD, (Collective(REDUCE, 0, 8, 1), Collective(kind, 8, 8))))
        _raises_naming("the flush executor", lambda strange=strange: executor.bind(strange, buffer), kind)
    assert len(comm.calls) == 3  # nothing of the refused programs was issued
    with pytest.raises(UnknownStepError, match=r"no entry for the step tuple .* it runs Group, P2pRound, Stage"):
        executor.bind(_program(("reduce", 0, 8)), buffer)
    with pytest.raises(UnknownStepError, match=r"no entry for the step tuple"):
        executor.run(_program(("reduce", 0, 8)), ((),), streams=None, index=1)
    with pytest.raises(RuntimeError, match=r"on the rail communicator, which this rank does not have"):
        executor.bind(_program(Group(RAIL, (Collective(REDUCE, 0, 8, 0, comm=RAIL),))), buffer)
    assert isinstance(pickle.loads(pickle.dumps(UnknownStepError(("x",), ("Group",)))), UnknownStepError)
