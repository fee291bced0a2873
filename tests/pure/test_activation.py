"""The init_z1_and_2 wrapper: with the flags off it calls DeepCompile's own function with the same arguments."""

import types

import deepspeed.compile.util as dc_util
import pytest
import torch

from owner_reduce.wiring import activation, cpu_compat
from owner_reduce.wiring.compile_pass import (
    add_owner_z1_reduce,
    add_owner_z2_reduce,
    owner_schedule,
    schedule_from,
    start_at_first_step,
)


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


def test_schedule_from_launches_what_is_in_force_at_the_first_step():
    a, b, c = ["a"], ["b"], ["c"]
    schedule = [(0, a), (5, b), (9, c)]
    assert schedule_from(schedule, 0) == schedule  # a fresh run: unchanged
    assert schedule_from(schedule, 3) == [(3, a), (5, b), (9, c)]  # resumed before the recompile: it still comes
    assert schedule_from(schedule, 5) == [(5, b), (9, c)]
    assert schedule_from(schedule, 7) == [(7, b), (9, c)]  # resumed after it: what it compiled, at once
    assert schedule_from(schedule, 12) == [(12, c)]
    assert schedule_from([(4, a), (6, b)], 0) == [(0, a), (6, b)]  # nothing due yet: the first entry, at once
    assert schedule_from([], 3) == []


def test_start_at_first_step_rebases_once_then_hands_back_deepcompiles_launcher():
    """The engine's first launch (at the step load_checkpoint resumed, 3) finds the schedule rebased to 3 in
    DeepCompile's own queue; later launches go straight to DeepCompile's launcher."""
    from deepspeed.compile import backend as dc_backend

    seen = []

    def native(global_steps):
        seen.append((global_steps, list(dc_backend.remaining_schedule)))

    engine = types.SimpleNamespace(launch_compile_passes=native)
    schedule = [(0, ["a"]), (5, ["b"])]
    saved = dc_backend.remaining_schedule
    try:
        dc_backend.init_schedule(schedule)
        start_at_first_step(engine, schedule)
        engine.launch_compile_passes(3)
        assert engine.launch_compile_passes is native
        engine.launch_compile_passes(4)
    finally:
        dc_backend.remaining_schedule = saved
    assert seen == [(3, [(3, ["a"]), (5, ["b"])]), (4, [(3, ["a"]), (5, ["b"])])]  # (native pops; this fake does not)


def test_start_at_first_step_refuses_an_engine_deepcompile_did_not_wire():
    with pytest.raises(RuntimeError, match="no longer sets engine.launch_compile_passes"):
        start_at_first_step(types.SimpleNamespace(), [(0, ["a"])])


def test_the_surface_check_names_a_moved_compile_schedule(monkeypatch):
    from deepspeed.compile import backend as dc_backend

    from owner_reduce.wiring.surface import surface_problems

    assert surface_problems() == []
    monkeypatch.setattr(dc_backend, "launch_compile_passes", lambda global_steps: None)
    assert surface_problems() == ["deepspeed.compile.backend.launch_compile_passes('global_steps',) is not "
                                  "launch_compile_passes('global_steps', 'owned_frames')"]
    monkeypatch.delattr(dc_backend, "init_schedule")
    assert surface_problems() == ["deepspeed.compile.backend.init_schedule is missing"]


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


def test_rank_0_names_each_variable_no_longer_read_once(monkeypatch):
    """The files the settings name, read on this rank (``planning.rank_inputs``): a bad value is kept as this rank's
    reason, never raised here on one rank alone (init's agreement refuses it on every rank); a variable that moved
    into the config (the flushes' deadline among them) is named in a warning on rank 0, once per process, with its
    key."""
    from deepspeed.utils import logger

    from owner_reduce.planning.settings import parse_settings

    warnings = []
    monkeypatch.setattr(logger, "warning", warnings.append)
    monkeypatch.setattr(activation, "_warned", set())
    on = parse_settings({"reduce_to_owner": True})
    assert activation.rank_inputs(on, 0, {}).problems == () and warnings == []
    env = {"OWNER_REDUCE_TIMEOUT_S": "45", "OWNER_REDUCE_FLUSH_ALGO": "handoff"}
    assert activation.rank_inputs(on, 1, env).problems == () and warnings == []  # rank 1 says nothing
    for _ in range(2):  # a second engine in the same process: said once
        activation.rank_inputs(on, 0, env)
    assert warnings == [
        "owner_reduce: OWNER_REDUCE_FLUSH_ALGO is set but no longer read (DeepSpeed's multi-node launcher does not "
        "forward it to other nodes); set compile.reduce_to_owner_algo in the DeepSpeed config instead",
        "owner_reduce: OWNER_REDUCE_TIMEOUT_S is set but no longer read (DeepSpeed's multi-node launcher does not "
        "forward it to other nodes); set compile.reduce_to_owner_timeout_s in the DeepSpeed config instead"]
