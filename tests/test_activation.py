"""The init_z1_and_2 wrapper: flags off and stage 2 call DeepCompile's own function with the same arguments."""

import types

import deepspeed.compile.util as dc_util
import torch

from owner_reduce import activation, cpu_compat
from owner_reduce.compile_pass import add_owner_z1_reduce, owner_schedule


def _spy():
    calls = []

    def original(*args):
        calls.append(args)
        return "native-backend"

    return original, calls


def _config(**flags):
    return types.SimpleNamespace(deepcompile=True, double_buffer=True, **flags)


def test_flags_off_calls_native_init_unchanged():
    original, calls = _spy()
    wrapped = activation.wrap_init_z1_and_2(original)
    engine, cfg, kwargs, schedule = object(), _config(), {"a": 1}, [(0, ["x"])]
    assert wrapped(engine, "inductor", cfg, kwargs, schedule, False) == "native-backend"
    assert calls == [(engine, "inductor", cfg, kwargs, schedule, False)]
    assert calls[0][4] is schedule
    assert dc_util.dc_handle is None and not cpu_compat._saved
    assert not hasattr(torch.ops.dc, "reduce_grad")


def test_stage2_with_flags_logs_once_and_runs_native():
    original, calls = _spy()
    wrapped = activation.wrap_init_z1_and_2(original)
    activation._stage2_warned = False
    warnings = []
    real_warning = activation.logger.warning
    activation.logger.warning = warnings.append
    try:
        cfg = _config(reduce_to_owner=True, reduce_probe=True)
        for _ in range(2):
            assert wrapped("engine", "eager", cfg, {}, None, True) == "native-backend"
    finally:
        activation.logger.warning = real_warning
    assert calls == [("engine", "eager", cfg, {}, None, True)] * 2
    assert warnings == [activation.STAGE2_IGNORED]
    assert dc_util.dc_handle is None


def test_owner_schedule_replaces_only_the_stage1_pass():
    from deepspeed.compile.passes import zero_1_and_2_compile

    other = object()
    assert owner_schedule(None) == [(0, [add_owner_z1_reduce])]
    assert owner_schedule([(0, [zero_1_and_2_compile.add_z1_reduce, other]), (5, [other])]) == \
        [(0, [add_owner_z1_reduce, other]), (5, [other])]
