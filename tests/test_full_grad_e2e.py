"""``deepspeed.utils.safe_get_full_grad`` between backward and step (issue 23 item 10), on real gloo ranks.

Plain ZeRO-1/2 returns every parameter's full reduced gradient on every rank; under DeepCompile the fragment
mapping reads a dict DeepCompile has replaced (``owner_reduce/wiring/full_grad.py``), so a rank holding a fragment
raises while a rank without one waits in an all_reduce for ever. With owner_reduce on, every rank gets the same full
gradient as plain ZeRO, bitwise on identical data, and no rank is left waiting (the launch has a hard timeout).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_e2e import _run_with_reference

from owner_reduce.harness.toy_training import TrainSpec


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,grad_accum", [(1, 1), (2, 2)])
def test_safe_get_full_grad_returns_plain_zeros_full_gradients_on_every_rank(stage, grad_accum):
    spec = TrainSpec(mode="owner", backend="eager", model="few_big_tensors", zero_stage=stage, grad_accum=grad_accum,
                     steps=2, full_grads=True, reduce_bucket_size=2500)
    owner, plain = _run_with_reference(3, spec)  # plain ZeRO (eager hooks) then the owner run, in one launch
    for rank, (o, p) in enumerate(zip(owner, plain, strict=True)):
        assert o["stats"].scheduled_flushes > 0 and o["stats"].owner_elems > 0, o["stats"]
        assert len(o["full_grads"]) == len(p["full_grads"]) == spec.steps
        for micro, (og, pg) in enumerate(zip(o["full_grads"], p["full_grads"], strict=True)):
            assert og.keys() == pg.keys()
            for name in pg:
                assert og[name].abs().sum() > 0, (rank, micro, name)
                assert torch.equal(og[name], pg[name]), (rank, micro, name, (og[name] - pg[name]).abs().max())
        # every rank assembled the same full gradient (the all_reduce met on every rank)
        assert all(torch.equal(o["full_grads"][-1][n], owner[0]["full_grads"][-1][n]) for n in o["full_grads"][-1])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("load_before_compile", [False, True], ids=["compile-then-load", "load-then-compile"])
def test_after_a_resume_safe_get_full_grad_returns_plain_zeros_full_gradients(load_before_compile, tmp_path):
    """``load_checkpoint`` re-links ZeRO's gradient fragments to the dict of that moment (``full_grad`` Note
    (re-links)); resumed in fresh processes, in either order with ``engine.compile()``, every rank still gets plain
    ZeRO's full gradients (before the fix: a crash on the ranks holding a fragment, a hang on the others)."""
    import dataclasses

    from owner_reduce.harness.launch import run_ranks
    from owner_reduce.harness.toy_training import train_each

    owner = TrainSpec(mode="owner", backend="eager", model="few_big_tensors", zero_stage=1, steps=4,
                      reduce_bucket_size=2500, checkpoint_dir=str(tmp_path / "owner"))
    plain = dataclasses.replace(owner, mode="plain", reduce_to_owner=False, reduce_probe=False,
                                checkpoint_dir=str(tmp_path / "plain"))
    saving = (dataclasses.replace(plain, save_at=2),
              dataclasses.replace(plain, resume=True, full_grads=True),
              dataclasses.replace(owner, save_at=2))
    first = run_ranks(train_each, 3, args=(saving,), timeout=300)
    resumed = dataclasses.replace(owner, resume=True, full_grads=True, load_before_compile=load_before_compile)
    second = run_ranks(train_each, 3, args=((resumed,),), timeout=200)
    for rank, (o, p) in enumerate(zip([r[0] for r in second], [r[1] for r in first], strict=True)):
        assert o["first_step"] == p["first_step"] == 2 and o["stats"].scheduled_flushes > 0, (rank, o["stats"])
        assert len(o["full_grads"]) == len(p["full_grads"]) == 2
        for og, pg in zip(o["full_grads"], p["full_grads"], strict=True):
            for name in pg:
                assert og[name].abs().sum() > 0, (rank, name)
                assert torch.equal(og[name], pg[name]), (rank, name, (og[name] - pg[name]).abs().max())
