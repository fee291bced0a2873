"""``deepspeed.utils.safe_get_full_grad`` between backward and step (issue 23 item 10), on real gloo ranks.

Plain ZeRO-1/2 returns every parameter's full reduced gradient on every rank; under DeepCompile the fragment
mapping reads a dict DeepCompile has replaced (``owner_reduce/wiring/full_grad.py``), so a rank holding a fragment
raises while a rank without one waits in an all_reduce for ever. With owner_reduce on, every rank gets the same full
gradient as plain ZeRO, bitwise on identical data, and no rank is left waiting (the launch has a hard timeout).

After a resume in fresh processes, in either order of ``load_checkpoint`` and ``engine.compile()`` (``full_grad`` Note
(re-links)): the resumed owner runs of ``test_compile_schedule_e2e.py`` read every full gradient and compare it with
plain ZeRO's uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from harness.toy_training import TrainSpec
from tests.processes.test_runtime_e2e import _run_with_reference


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
