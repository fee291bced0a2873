"""Engine lifecycle in one process: a second live owner engine is refused, so is uninstall() while one is live;
destroy() hands everything back."""

import pytest

from owner_reduce.harness.launch import run_ranks


def _lifecycle_worker(rank, world_size):
    import deepspeed
    import deepspeed.compile.util as dc_util
    import torch

    import owner_reduce
    from owner_reduce.harness.toy_models import OddMLP
    from owner_reduce.wiring import ops

    owner_reduce.install()
    hooks_before = len(dc_util.pre_backward_hooks)

    def engine():
        torch.manual_seed(0)
        model = OddMLP()
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "compile": {"deepcompile": True, "reduce_to_owner": True}}
        e, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        e.compile(backend="eager")
        return e

    def step(e):
        loss = e(torch.randn(4, 12), torch.randn(4, 5))
        e.backward(loss)
        e.step()
        return ops.active_runtime().stats.reduce_grad_calls

    out = {}
    first = engine()
    out["first_calls"] = step(first)
    try:
        owner_reduce.uninstall()
        out["uninstall_error"] = None
    except owner_reduce.OwnerReduceInUseError as error:
        out["uninstall_error"] = str(error)
    out["still_installed"] = owner_reduce.is_installed()
    out["calls_after_refusal"] = step(first)  # the engine still trains (an uninstall here broke its forward)
    second = None
    try:
        second = engine()
        out["second_error"] = None
    except RuntimeError as error:
        out["second_error"] = str(error)
    if second is not None:
        second.destroy()
    first.destroy()
    out["after_destroy"] = (dc_util.dc_handle, ops.active_runtime_or_none(), hasattr(torch.ops.dc, "reduce_grad"),
                            len(dc_util.pre_backward_hooks) - hooks_before)
    third = engine()
    out["third_calls"] = step(third)
    third.destroy()
    owner_reduce.uninstall()
    return out


@pytest.mark.timeout(300)
def test_second_live_engine_refused_and_destroy_releases_everything():
    (out,) = run_ranks(_lifecycle_worker, 1, timeout=240)
    assert out["first_calls"] == 6 and out["third_calls"] == 6
    assert out["uninstall_error"] and "engine.destroy() first" in out["uninstall_error"] and out["still_installed"]
    assert out["calls_after_refusal"] == 12
    assert out["second_error"] and "another DeepCompile engine with reduce_to_owner" in out["second_error"]
    assert out["after_destroy"] == (None, None, False, 0)
