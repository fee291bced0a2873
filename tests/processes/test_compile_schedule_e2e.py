"""DeepCompile's compile schedule end to end on gloo, as a DeepSpeed user meets it: a multi-step
``engine.compile(schedule=...)`` (every graph recompiled and registered again at the later step) and a run resumed from
a checkpoint in fresh ranks (``load_checkpoint`` after ``engine.compile()``, so the first forward is at the
checkpoint's step), each bitwise equal to plain ZeRO, which never recompiles.

Four cases cover ZeRO stages 1 and 2 and gradient accumulation 1 and 2 at ws 2, each resumed at step 3 and trained to
step 8 in new processes (a process that ran an engine before has DeepCompile's passes already set, which hides the
failure). Two resume a checkpoint written with the flags on, and also resume it with the flags off (plain ZeRO, the
guide's rollback), first in those processes, before anything installs owner_reduce; two resume one written with the
flags off (plain ZeRO), one of them loading it before ``engine.compile()``. DeepCompile's
own runtime (flags off, compiled) cannot run on CPU, and upstream it fails to resume in a fresh process the same way;
owner_reduce is not wired in then (see the guide).

The resumed owner runs also read ``deepspeed.utils.safe_get_full_grad`` of every parameter between each boundary
backward and its step, and must get plain ZeRO's full gradients of the same steps bitwise, on every rank: after a
resume, in either order of ``load_checkpoint`` and ``engine.compile()`` (``full_grad`` Note (re-links): before that
fix, a crash on the ranks holding a fragment, a hang on the others). Without a resume: ``test_full_grad_e2e.py``.

Each case is two launches: one writes the checkpoint and the uninterrupted references (plain ZeRO to step 8, with its
full gradients; for the flags-on writer also the owner path to step 8 through a recompile), one resumes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from harness.launch import run_ranks
from harness.toy_training import TrainSpec, train

WORLD_SIZE = 2
STEPS = 8
SAVE_AT = 3
N_PARAMS = 6  # OddMLP: three weights, three biases


class Case(NamedTuple):
    stage: int
    grad_accum: int
    writer: str  # "owner": the checkpoint is written with the flags on; "plain": with them off (plain ZeRO)
    compile_steps: tuple[int, ...] = ()  # the owner path's compile schedule (also in the resumed run)
    reuse_graph_ids: bool = False  # rank 0 reuses its graph ids after a recompile, rank 1 does not (graph_ids.py)
    load_before_compile: bool = False  # the owner run resumes with load_checkpoint before engine.compile()

    @property
    def name(self) -> str:
        return f"stage{self.stage}-ga{self.grad_accum}-{self.writer}-ckpt" + \
            (f"-compile-at-{'-'.join(map(str, self.compile_steps))}" if self.compile_steps else "") + \
            ("-ids-reused-on-rank-0" if self.reuse_graph_ids else "") + \
            ("-loaded-before-compile" if self.load_before_compile else "")


CASES = (
    # Recompiled at step 2, before the save: resumed at 3, it compiles once. DeepCompile's own graph ids.
    Case(1, 1, "owner", (0, 2)),
    # Recompiled at step 5, after the save: the resumed run recompiles there too. Rank 0's recompiled graph gets its
    # old graph's id, rank 1's a new one (what id(gm.graph) allows): before the reset forgot what was learned per
    # graph id, rank 0 followed the old graph's schedule while rank 1 recorded in arrival order.
    Case(2, 2, "owner", (0, 5), reuse_graph_ids=True),
    Case(1, 2, "plain", load_before_compile=True),
    Case(2, 1, "plain"),
)
OWNER_CASES = tuple(c for c in CASES if c.writer == "owner")


def _specs(case: Case, checkpoint_dir: str) -> dict[str, TrainSpec]:
    base = TrainSpec(mode="plain", steps=STEPS, grad_accum=case.grad_accum, zero_stage=case.stage, reduce_probe=False,
                     checkpoint_dir=checkpoint_dir)
    # A bounded wait on owner_reduce's collectives: ranks that diverge fail, naming the call, within a minute.
    owner = dataclasses.replace(base, mode="owner", compile_steps=case.compile_steps, record_collectives=True,
                                reuse_graph_ids=case.reuse_graph_ids, compile_keys=(("reduce_to_owner_timeout_s", 60),))
    save = {"save_at": SAVE_AT}
    return {
        "plain": dataclasses.replace(base, full_grads=True, **(save if case.writer == "plain" else {})),
        "owner": dataclasses.replace(owner, **save),
        "owner resumed": dataclasses.replace(owner, resume=True, full_grads=True,
                                             load_before_compile=case.load_before_compile),
        "plain resumed": dataclasses.replace(base, resume=True),
    }


def _run_each(rank: int, world_size: int, specs: tuple[TrainSpec, ...]) -> list[dict]:
    """Several runs, one after the other, in these ranks (the first owner run is the first DeepCompile engine)."""
    return [train(rank, world_size, spec) for spec in specs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(case, launch)``: the results (by rank) of a case's ``"write"`` launch (the references and the checkpoint)
    or its ``"resume"`` launch (fresh ranks, as a user resuming in a new job), each launched once, on first use."""
    done: dict[tuple[Case, str], dict[str, tuple]] = {}
    dirs: dict[Case, str] = {}

    def get(case: Case, launch: str) -> dict[str, tuple]:
        if (case, launch) not in done:
            if launch == "resume":
                get(case, "write")
            directory = dirs.setdefault(case, str(tmp_path_factory.mktemp(case.name)))
            specs = _specs(case, directory)
            names = {("write", "owner"): ("plain", "owner"), ("write", "plain"): ("plain",),
                     ("resume", "owner"): ("plain resumed", "owner resumed"),  # plain first: owner_reduce not installed
                     ("resume", "plain"): ("owner resumed",)}[launch, case.writer]
            by_rank = run_ranks(_run_each, WORLD_SIZE, args=(tuple(specs[n] for n in names),), timeout=240)
            done[case, launch] = {name: tuple(r[i] for r in by_rank) for i, name in enumerate(names)}
        return done[case, launch]

    return get


def _assert_bitwise(run: tuple, reference: tuple, first_step: int, grad_accum: int, what: str) -> None:
    for rank, (r, p) in enumerate(zip(run, reference, strict=True)):
        assert (r["first_step"], r["global_steps"]) == (first_step, STEPS), (what, rank)
        assert r["losses"] == p["losses"][first_step * grad_accum:], f"{what}, rank {rank}: losses differ"
        differ = [k for k in p["params"] if not torch.equal(r["params"][k], p["params"][k])]
        assert not differ, f"{what}, rank {rank}: parameters {differ} differ"


def _assert_owner_ran(run: tuple, steps: int, grad_accum: int, resets: int, stage: int) -> None:
    """The owner runtime reduced every gradient of every micro-step, with the owner path, through ``resets``
    launches of DeepCompile's passes (each resets the handle; each later one recompiles every graph, which then learns
    its schedule again), and both ranks issued the same collectives."""
    micro_steps = steps * grad_accum
    for rank, r in enumerate(run):
        s = r["stats"]
        assert s.reduce_grad_calls == micro_steps * N_PARAMS and s.end_backward_calls == micro_steps, (rank, s)
        assert s.accumulated_calls == (0 if stage == 2 else (micro_steps - steps) * N_PARAMS), (rank, s)
        assert s.owner_elems > 0 and s.reduce_calls + s.reduce_scatter_calls > 0, (rank, s)
        assert s.resets == resets and s.schedules_learned == resets and s.schedule_fallbacks == 0, (rank, s)
    assert len(run[0]["stats"].schedule_lines) == resets  # one graph, learned again after each launch
    assert run[0]["collective_log"] and run[0]["collective_log"] == run[1]["collective_log"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", OWNER_CASES, ids=lambda c: c.name)
def test_multi_step_compile_schedule_trains_bitwise_equal_to_plain_zero_across_the_recompile(runs, case):
    """``engine.compile(schedule=[(0, [add_z?_reduce]), (k, [add_z?_reduce])])``: at step k DeepCompile resets the
    handle and recompiles; the owner path runs through it and stays bitwise equal to plain ZeRO to step 8."""
    results = runs(case, "write")
    _assert_bitwise(results["owner"], results["plain"], 0, case.grad_accum, "owner path across the recompile")
    _assert_owner_ran(results["owner"], STEPS, case.grad_accum, resets=len(case.compile_steps), stage=case.stage)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_resume_in_fresh_ranks_trains_bitwise_equal_to_an_uninterrupted_run(runs, case):
    """``install()``, ``deepspeed.initialize``, ``engine.compile()``, ``engine.load_checkpoint`` (step 3; or loaded
    before ``engine.compile()``), then training to step 8 in new ranks: the first forward is at step 3 and the owner
    path's compile schedule starts there (DeepCompile's default schedule launches only at step 0: the first forward
    failed with ``TypeError: 'NoneType' object is not iterable``). Bitwise equal to plain ZeRO's uninterrupted run,
    and so are the full gradients ``safe_get_full_grad`` returns; a checkpoint written with the flags on also resumes
    with them off."""
    results = {**runs(case, "write"), **runs(case, "resume")}
    resumed = results["owner resumed"]
    _assert_bitwise(resumed, results["plain"], SAVE_AT, case.grad_accum, f"owner path resumed from a {case.writer} "
                    "checkpoint")
    launches = 1 + sum(step > SAVE_AT for step in case.compile_steps)  # at the first step, then any later entry
    _assert_owner_ran(resumed, STEPS - SAVE_AT, case.grad_accum, resets=launches, stage=case.stage)
    # safe_get_full_grad after the resume: plain ZeRO's full gradients of the same steps, on every rank
    for rank, (o, p) in enumerate(zip(resumed, results["plain"], strict=True)):
        assert len(o["full_grads"]) == STEPS - SAVE_AT and len(p["full_grads"]) == STEPS, rank
        for step, (og, pg) in enumerate(zip(o["full_grads"], p["full_grads"][SAVE_AT:], strict=True), SAVE_AT + 1):
            assert og.keys() == pg.keys()
            for name in pg:
                assert og[name].abs().sum() > 0, (rank, step, name)
                assert torch.equal(og[name], pg[name]), (rank, step, name, (og[name] - pg[name]).abs().max())
    if case.writer == "owner":
        _assert_bitwise(results["plain resumed"], results["plain"], SAVE_AT, case.grad_accum,
                        "plain ZeRO resumed from an owner checkpoint")
        assert all(r["stats"] is None and not r["installed"] for r in results["plain resumed"])  # no owner_reduce
