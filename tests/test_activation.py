"""The init_z1_and_2 wrapper: with the flags off it calls DeepCompile's own function with the same arguments."""

import types

import deepspeed.compile.util as dc_util
import torch

from owner_reduce.wiring import activation, cpu_compat
from owner_reduce.wiring.compile_pass import add_owner_z1_reduce, add_owner_z2_reduce, owner_schedule


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


def test_owner_schedule_replaces_only_the_reduce_passes():
    from deepspeed.compile.passes import zero_1_and_2_compile

    other = object()
    assert owner_schedule(None) == [(0, [add_owner_z1_reduce])]
    assert owner_schedule(None, use_z2=True) == [(0, [add_owner_z2_reduce])]
    assert owner_schedule([(0, [zero_1_and_2_compile.add_z2_reduce])], use_z2=True) == [(0, [add_owner_z2_reduce])]
    assert owner_schedule([(0, [zero_1_and_2_compile.add_z1_reduce, other]), (5, [other])]) == \
        [(0, [add_owner_z1_reduce, other]), (5, [other])]


def test_parameters_outside_zero_groups_reach_deepcompile_as_plain_inputs():
    from owner_reduce.wiring.unreduced_params import hide_unoptimized_params, optimized_param_ids

    trained = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    empty = torch.nn.Parameter(torch.zeros(0))
    activation_input = torch.ones(4)
    seen = []
    backend = hide_unoptimized_params(lambda gm, inputs: seen.append(inputs) or "compiled",
                                      optimized_param_ids([[trained]]))
    assert backend("gm", [trained, frozen, activation_input, empty, 7]) == "compiled"
    (shown,) = seen
    assert shown[0] is trained and shown[2] is activation_input and shown[4] == 7
    for original, plain in ((frozen, shown[1]), (empty, shown[3])):
        assert not isinstance(plain, torch.nn.Parameter)  # DeepCompile asserts a param_id on every Parameter
        assert plain.data_ptr() == original.data_ptr() and plain.shape == original.shape
        assert plain.requires_grad == original.requires_grad
    backend("gm", (frozen,))
    assert isinstance(seen[1], tuple)


def test_forced_flush_algorithm_is_read_checked_and_never_silent(monkeypatch):
    import pytest
    from deepspeed.utils import logger

    from owner_reduce.planning.flags import OwnerReduceFlags

    warnings = []
    monkeypatch.setattr(logger, "warning", warnings.append)
    on, probe_only = OwnerReduceFlags(True, False), OwnerReduceFlags(False, True)
    assert activation.forced_flush_algo(on, 0, {}) == "auto"
    assert activation.forced_flush_algo(on, 0, {"OWNER_REDUCE_FLUSH_ALGO": "handoff"}) == "handoff"
    assert warnings == []
    with pytest.raises(ValueError, match="OWNER_REDUCE_FLUSH_ALGO must be one of auto, reduce, allreduce, handoff, "
                                         "got 'fast'"):
        activation.forced_flush_algo(on, 0, {"OWNER_REDUCE_FLUSH_ALGO": "fast"})
    assert activation.forced_flush_algo(probe_only, 1, {"OWNER_REDUCE_FLUSH_ALGO": "reduce"}) == "reduce"
    assert warnings == []  # rank 1 does not warn
    activation.forced_flush_algo(probe_only, 0, {"OWNER_REDUCE_FLUSH_ALGO": "reduce"})
    assert warnings == ["owner_reduce: OWNER_REDUCE_FLUSH_ALGO=reduce has no effect: compile.reduce_to_owner is "
                        "false, so every flush is one AllReduce, as DeepCompile does"]
