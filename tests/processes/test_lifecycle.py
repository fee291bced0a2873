"""Engine lifecycle in one process: a second live owner engine is refused, so is uninstall() while one is live;
destroy() hands everything back, also when its bounded wait fails."""

import types

import pytest

from harness.launch import run_ranks


def _lifecycle_worker(rank, world_size):
    import deepspeed
    import deepspeed.compile.util as dc_util
    import torch

    import owner_reduce
    from harness.toy_models import OddMLP
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


# ---- in process: cleanup hands DeepCompile's handle back even when the communicator's bounded close fails --------


def test_cleanup_hands_the_handle_back_when_the_close_wait_times_out(monkeypatch):
    """The wiring of ``activation.wrap_init_z1_and_2`` around a runtime whose communicator's ``close()`` times out
    (its stream never drains): DeepSpeed's one ``cleanup()`` raises that error, and DeepCompile's handle, the
    active runtime and the dc schemas are handed back all the same, so the next engine starts."""
    import deepspeed.compile.util as dc_util

    from owner_reduce import OwnerReduceCommError
    from owner_reduce.planning.flags import OwnerReduceFlags
    from owner_reduce.planning.owner_map import OwnerMap
    from owner_reduce.runtime.deadline import Deadline
    from owner_reduce.runtime.handle import OwnerReduceRuntime
    from owner_reduce.wiring import activation, ops
    from tests.support.fakes import MirrorComm

    class StuckComm(MirrorComm):
        def close(self):
            self.wait_until(lambda: False, "close (work still in flight on the communicator's stream)")

    comms = []

    def build_runtime(engine, settings):  # settings: planning.settings.OwnerReduceSettings, from the compile config
        comms.append(StuckComm(rank=0, world_size=2))
        comms[-1].deadline = Deadline(0.05, "test")
        return OwnerReduceRuntime(settings, OwnerMap.from_group_tables([], 2), lambda group: comms[-1])

    released = []
    monkeypatch.setattr(activation, "build_runtime", build_runtime)
    monkeypatch.setattr(activation, "ensure_dc_schemas", lambda: True)
    monkeypatch.setattr(activation, "release_dc_schemas", lambda: released.append(1))
    monkeypatch.setattr(activation, "register_inductor_lowerings", lambda: None)
    monkeypatch.setattr(activation.cpu_compat, "is_cpu_accelerator", lambda: False)
    monkeypatch.setattr(dc_util, "dc_handle", "native handle")
    monkeypatch.setattr(ops, "_runtime", None)

    def deepcompile_init(engine, backend, compile_config, compile_kwargs, schedule, use_z2):
        dc_util.dc_handle.init(None, compile_config, 64)  # as DeepSpeed's _initialize_deepcompile_native
        engine.launch_compile_passes = lambda global_steps: None  # as init_z1_and_2 sets it
        return "backend"

    init = activation.wrap_init_z1_and_2(deepcompile_init)
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(bit16_groups=[]))
    config = types.SimpleNamespace(reduce_to_owner=True, reduce_probe=False, double_buffer=True)
    assert activation.settings_of(config).flags == OwnerReduceFlags(True, False)
    init(engine, "inductor", config, {}, None, False)
    first = dc_util.dc_handle
    assert isinstance(first, OwnerReduceRuntime) and ops.active_runtime_or_none() is first
    with pytest.raises(OwnerReduceCommError, match=r"rank 0, outside a flush: close \(work still in flight on the "
                                                   r"communicator's stream\) timed out after waiting 0\.05 s "
                                                   r"\(the deadline, from test; measured "):
        first.cleanup()  # engine.destroy(): DeepSpeed calls it once
    assert dc_util.dc_handle == "native handle" and ops.active_runtime_or_none() is None and released == [1]
    assert first.comm is None
    init(engine, "inductor", config, {}, None, False)  # a later engine starts (it was refused before)
    assert dc_util.dc_handle is not first and ops.active_runtime_or_none() is dc_util.dc_handle
    comms[-1].close = lambda: None
    dc_util.dc_handle.cleanup()
    assert dc_util.dc_handle == "native handle" and ops.active_runtime_or_none() is None
