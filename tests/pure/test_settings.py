"""Every owner_reduce setting from the ``compile`` section (``planning.settings``), the keys that cannot take effect,
the settings line, and rank lists at scale (``planning.wording``). Pure: no DeepSpeed, no processes."""

from __future__ import annotations

import pytest

from owner_reduce.planning.flags import OwnerReduceConfigError, OwnerReduceFlags
from owner_reduce.planning.settings import (
    ALGO_VALUES,
    SETTING_KEYS,
    OwnerReduceSettings,
    RunSetup,
    inapplicable_settings,
    nccl_mismatch,
    nccl_version_of_code,
    parse_settings,
    settings_line,
    settings_of,
    transport_text,
    uncompiled_settings,
)
from owner_reduce.planning.wording import by_reason, by_value, rank_ranges, ranks_phrase

EVERY_KEY = {"reduce_to_owner": True, "reduce_probe": True, "reduce_probe_all_ranks": True,
             "reduce_to_owner_algo": "model", "reduce_to_owner_calibration": "/c/cal.json",
             "reduce_to_owner_verdicts": "/v/verdicts.json", "reduce_to_owner_timeout_s": 45.0}


def test_defaults_and_every_key_read_as_written():
    assert parse_settings({}) == parse_settings(None) == OwnerReduceSettings()
    assert OwnerReduceSettings().keys_set() == ()
    every = parse_settings({"deepcompile": True, **EVERY_KEY})
    assert every == OwnerReduceSettings(OwnerReduceFlags(True, True, True), "model", "/c/cal.json", "/v/verdicts.json",
                                        45.0)
    assert parse_settings({"reduce_to_owner_timeout_s": 30}).timeout_s == 30.0  # a JSON integer is seconds too
    assert parse_settings({"reduce_to_owner_timeout_s": None}).timeout_s is None  # null: the group's timeout
    assert every.config_values() == EVERY_KEY and every.keys_set() == SETTING_KEYS
    assert set(SETTING_KEYS) == set(EVERY_KEY)


@pytest.mark.parametrize(("algo", "flush_algo", "measure"), [
    ("auto", "auto", True), ("model", "auto", False), ("reduce", "reduce", True), ("allreduce", "allreduce", True),
    ("handoff", "handoff", True), ("native", "native", True), ("two_level", "two_level", True)])
def test_each_algorithm_is_what_the_runtime_runs(algo, flush_algo, measure):
    s = parse_settings({"reduce_to_owner_algo": algo})
    assert (s.algo, s.flush_algo, s.measure) == (algo, flush_algo, measure)
    assert algo in ALGO_VALUES


BAD = [
    ("reduce_probe_all_ranks", "yes", "must be true or false"),
    ("reduce_probe_all_ranks", 1, "must be true or false"),
    ("reduce_to_owner_algo", "fast", 'must be one of "auto", "model", "reduce", "allreduce", "handoff", "native", '
                                     '"two_level", got \'fast\' (str)'),
    ("reduce_to_owner_algo", "AUTO", "must be one of"),  # exactly as documented: no case folding
    ("reduce_to_owner_algo", "reduce_scatter", "must be one of"),  # a candidate that cannot be forced
    ("reduce_to_owner_algo", None, "must be one of"),
    ("reduce_to_owner_algo", True, "got True (bool)"),
    ("reduce_to_owner_calibration", 3, "must be a file path (a JSON string) or null, got 3 (int)"),
    ("reduce_to_owner_calibration", "  ", "must be a file path or null, got an empty string"),
    ("reduce_to_owner_calibration", ["a.json"], "a JSON string"),
    ("reduce_to_owner_verdicts", False, "must be a file path (a JSON string) or null, got False (bool)"),
    ("reduce_to_owner_verdicts", "", "an empty string"),
    ("reduce_to_owner_timeout_s", 0, "must be a positive number of seconds or null, got 0 (int)"),
    ("reduce_to_owner_timeout_s", -3.5, "must be a positive number of seconds or null, got -3.5 (float)"),
    ("reduce_to_owner_timeout_s", "60", "got '60' (str)"),
    ("reduce_to_owner_timeout_s", True, "got True (bool)"),
    ("reduce_to_owner_timeout_s", float("inf"), "got inf (float)"),
    ("reduce_to_owner_timeout_s", float("nan"), "got nan (float)"),
]


@pytest.mark.parametrize(("key", "value", "says"), BAD)
def test_a_bad_value_is_refused_naming_the_key_and_the_value(key, value, says):
    with pytest.raises(OwnerReduceConfigError, match=rf"DeepSpeed config: compile\.{key} ") as caught:
        parse_settings({"reduce_to_owner": True, key: value})
    assert says in str(caught.value), str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_built_config_without_the_keys_means_the_defaults():
    class Plain:
        deepcompile = True

    class Built:
        reduce_to_owner, reduce_probe, reduce_probe_all_ranks = True, False, False
        reduce_to_owner_algo, reduce_to_owner_calibration, reduce_to_owner_verdicts = "handoff", "c.json", None
        reduce_to_owner_timeout_s = 90.0

    assert settings_of(Plain()) == OwnerReduceSettings()
    assert settings_of(Built()) == OwnerReduceSettings(OwnerReduceFlags(True), "handoff", "c.json", None, 90.0)


# ---- keys that cannot take effect: a reason each, never silence --------------------------------------------------

ON = OwnerReduceSettings(OwnerReduceFlags(reduce_to_owner=True))


def _with(**changes) -> OwnerReduceSettings:
    flags = {k: changes.pop(k) for k in ("reduce_to_owner", "reduce_probe", "reduce_probe_all_ranks") if k in changes}
    return OwnerReduceSettings(OwnerReduceFlags(**flags), **changes)


@pytest.mark.parametrize("stage", [1, 2])
def test_settings_that_take_effect_give_no_reason(stage):
    for s in (ON, _with(reduce_probe=True), _with(reduce_to_owner=True, reduce_probe=True, reduce_probe_all_ranks=True,
                                                  algo="auto", calibration="c", verdicts="v"),
              _with(reduce_to_owner=True, algo="handoff", calibration="c"), _with(reduce_to_owner=True, algo="model"),
              _with(reduce_probe=True, timeout_s=60.0)):  # the deadline bounds the probe's AllReduces too
        assert inapplicable_settings({"compile": {}}, s, deepcompile=True, zero_stage=stage) == (), s


@pytest.mark.parametrize(("settings", "why"), [
    (_with(reduce_probe_all_ranks=True), "compile.reduce_probe_all_ranks has no effect: compile.reduce_probe is false"),
    (_with(reduce_to_owner=True, reduce_probe_all_ranks=True), "compile.reduce_probe is false, so no rank prints"),
    (_with(reduce_probe=True, calibration="c"), "compile.reduce_to_owner_calibration has no effect: "
                                                "compile.reduce_to_owner is false, so every flush is one AllReduce"),
    (_with(algo="handoff", verdicts="v"), "compile.reduce_to_owner_algo and compile.reduce_to_owner_verdicts have no "
                                          "effect: compile.reduce_to_owner is false"),
    (_with(reduce_to_owner=True, algo="handoff", verdicts="v"),
     'compile.reduce_to_owner_verdicts has no effect: compile.reduce_to_owner_algo is "handoff", and the measured '
     'guard, whose verdicts it keeps, runs only under "auto"'),
    (_with(reduce_to_owner=True, algo="model", verdicts="v"), 'compile.reduce_to_owner_algo is "model"'),
    (_with(timeout_s=60.0), "compile.reduce_to_owner_timeout_s has no effect: compile.reduce_to_owner and "
                            "compile.reduce_probe are false, so owner_reduce's runtime does not run"),
])
def test_each_key_that_cannot_take_effect_is_named_with_why(settings, why):
    (reason,) = inapplicable_settings({}, settings, deepcompile=True, zero_stage=1)
    assert reason.startswith("owner_reduce: ") and why in reason, reason


@pytest.mark.parametrize(("deepcompile", "stage", "why"), [
    (False, 1, "compile.deepcompile is false"), (False, 3, "compile.deepcompile is false"),
    (True, 0, "zero_optimization.stage is 0"), (True, 3, "zero_optimization.stage is 3")])
def test_outside_deepcompile_stages_1_and_2_every_key_set_is_named_once(deepcompile, stage, why):
    (reason,) = inapplicable_settings({}, ON, deepcompile=deepcompile, zero_stage=stage)
    assert reason.startswith("owner_reduce: compile.reduce_to_owner has no effect: ") and why in reason
    every = parse_settings(EVERY_KEY)
    (reason,) = inapplicable_settings({}, every, deepcompile=deepcompile, zero_stage=stage)
    assert reason.startswith("owner_reduce: compile.reduce_to_owner, compile.reduce_probe, "
                             "compile.reduce_probe_all_ranks, compile.reduce_to_owner_algo, "
                             "compile.reduce_to_owner_calibration, compile.reduce_to_owner_verdicts and "
                             "compile.reduce_to_owner_timeout_s have no effect: ")


def test_nothing_set_is_never_inapplicable():
    for deepcompile, stage in [(False, 0), (True, 0), (True, 3), (False, 1), (True, 1)]:
        assert inapplicable_settings({}, OwnerReduceSettings(), deepcompile=deepcompile, zero_stage=stage) == ()


@pytest.mark.parametrize("key", SETTING_KEYS)
def test_a_key_at_the_top_level_is_named_whatever_else_is_set(key):
    reasons = inapplicable_settings({key: True, "compile": {"deepcompile": True}}, OwnerReduceSettings(), True, 1)
    assert reasons == (f"owner_reduce: '{key}' at the top level of the DeepSpeed config has no effect (DeepSpeed "
                       f"ignores unknown top-level keys); it belongs under 'compile': compile.{key}",)
    assert len(inapplicable_settings({key: False}, ON, False, 1)) == 2  # the top-level key, and deepcompile off


# ---- the settings line -----------------------------------------------------------------------------------------

SETUP = RunSetup(transport="cupy NCCL 2.27.7 (torch's 2.27.5)", world_size=512,
                 nodes="64 nodes x 8 (host names = LOCAL_WORLD_SIZE)", bucket_elems=500_000_000, version="0.1.0")
RUNS_ON = ("; cupy NCCL 2.27.7 (torch's 2.27.5), 512 ranks = 64 nodes x 8 (host names = LOCAL_WORLD_SIZE), bucket "
           "500000000 elements, owner_reduce 0.1.0")


def test_the_settings_line_says_what_is_in_effect_then_what_the_run_runs_on():
    line = settings_line(ON, calibration_digest=None, verdicts="none", timeout_s=1800.0,
                         timeout_source="init_distributed", setup=SETUP)
    assert line == ("owner_reduce: settings: algo=auto, calibration none, verdicts none, probe off, timeout 1800 s "
                    "(init_distributed)" + RUNS_ON)
    every = settings_line(parse_settings(EVERY_KEY), calibration_digest="0123456789ab",
                          verdicts="write /v/verdicts.json", timeout_s=60.0,
                          timeout_source="compile.reduce_to_owner_timeout_s", setup=SETUP)
    assert every == ("owner_reduce: settings: algo=model, calibration 0123456789ab, verdicts write /v/verdicts.json, "
                     "probe all ranks, timeout 60 s (compile.reduce_to_owner_timeout_s)" + RUNS_ON)
    gloo = RunSetup(transport=transport_text("torch.distributed", "gloo", None, None), world_size=1,
                    nodes="1 node x 1 (host names)", bucket_elems=64, version="0.1.0")
    probe_only = settings_line(_with(reduce_probe=True), calibration_digest=None, verdicts="none", timeout_s=600.5,
                               timeout_source="torch default", setup=gloo)
    assert probe_only == ("owner_reduce: settings: owner path off (every flush AllReduces), probe rank 0, timeout "
                          "600.5 s (torch default); torch.distributed gloo, 1 rank = 1 node x 1 (host names), bucket "
                          "64 elements, owner_reduce 0.1.0")
    replay = settings_line(ON, calibration_digest=None, verdicts="replay 0123456789ab (3 schedules)", timeout_s=1800,
                           timeout_source="init_distributed", setup=SETUP)
    for text in (line, every, probe_only, replay):
        assert len(text.split()) < 50, text
        assert text.count(";") == 1  # the settings, then what the run runs on


@pytest.mark.parametrize(("comm", "backend", "cupy", "torch_nccl", "text"), [
    ("cupy-nccl", None, (2, 27, 7), (2, 27, 5), "cupy NCCL 2.27.7 (torch's 2.27.5)"),
    ("cupy-nccl", None, (2, 30, 3), None, "cupy NCCL 2.30.3"),  # a torch without NCCL
    ("cupy-nccl", None, None, None, "cupy NCCL unknown"),
    ("torch.distributed", "nccl", None, (2, 27, 5), "torch.distributed nccl (NCCL 2.27.5)"),
    ("torch.distributed", "gloo", None, (2, 27, 5), "torch.distributed gloo"),  # gloo: torch's NCCL is not used
    ("torch.distributed", None, None, None, "torch.distributed unknown backend"),
])
def test_the_transport_names_the_library_and_its_nccl(comm, backend, cupy, torch_nccl, text):
    assert transport_text(comm, backend, cupy, torch_nccl) == text


def test_nccl_versions_of_another_major_minor_are_warned_about():
    assert nccl_version_of_code(22707) == (2, 27, 7) and nccl_version_of_code(2804) == (2, 8, 4)  # before 2.9: x1000
    assert nccl_mismatch((2, 27, 7), (2, 27, 5)) is None  # a patch apart: the same protocols
    assert nccl_mismatch((2, 27, 7), None) is None and nccl_mismatch(None, (2, 21, 5)) is None
    warning = nccl_mismatch((2, 21, 5), (2, 27, 7))
    assert warning.startswith("owner_reduce: cupy loaded NCCL 2.21.5 but torch uses NCCL 2.27.7 (their major.minor "
                              "differ)"), warning


# ---- rank lists at scale ---------------------------------------------------------------------------------------

def test_the_first_steps_check_says_which_keys_and_what_to_call():
    on = OwnerReduceSettings(OwnerReduceFlags(reduce_to_owner=True, reduce_probe=True), "model")
    assert uncompiled_settings(OwnerReduceSettings(algo="model"), compiled=False) is None  # no flag on: nothing ran
    never = uncompiled_settings(on, compiled=False)
    assert never.startswith("owner_reduce: compile.reduce_to_owner, compile.reduce_probe and "
                            "compile.reduce_to_owner_algo have no effect until engine.compile() runs: ")
    assert never.endswith("(call engine.compile() after deepspeed.initialize; the Hugging Face Trainer: "
                          "--torch_compile)")
    no_graph = uncompiled_settings(OwnerReduceSettings(OwnerReduceFlags(reduce_probe=True)), compiled=True)
    assert no_graph.startswith("owner_reduce: compile.reduce_probe has no effect: engine.compile() ran, yet ")
    assert "its own forward" in no_graph


def test_rank_lists_are_folded_into_ranges_and_capped():
    assert ranks_phrase([3]) == "rank 3"
    assert ranks_phrase([1, 4]) == "ranks 1, 4"
    assert ranks_phrase([0, 1]) == "ranks 0, 1"  # a pair stays two ranks
    assert ranks_phrase([2, 0, 1]) == "ranks 0-2"
    assert ranks_phrase([*range(256), *range(257, 512)]) == "ranks 0-255, 257-511"
    assert ranks_phrase(list(range(0, 40, 2))) == "ranks 0, 2, 4, 6, 8, 10, 12, 14 and 12 more"
    assert rank_ranges(list(range(1024))) == "0-1023"
    assert len(ranks_phrase(list(range(0, 1024, 2)))) < 60  # 512 ranks, one short phrase


def test_per_rank_values_and_reasons_are_grouped_by_value():
    assert by_value(["auto", "auto", "auto", "reduce"]) == "auto on ranks 0-2, reduce on rank 3"
    assert by_value([True, False, True], lambda v: str(v).lower()) == "true on ranks 0, 2, false on rank 1"
    digests = [f"{r:012x}" for r in range(512)]  # every rank another file: the listing stays short
    text = by_value(digests)
    assert text.endswith("and 508 other values on ranks 4-511") and len(text) < 200, text
    assert by_reason([None, "a", None, "a", "b"]) == ["ranks 1, 3: a", "rank 4: b"]
    assert by_reason([None, None]) == []
    many = by_reason([f"reason {r}" for r in range(512)])
    assert len(many) == 5 and many[-1] == "ranks 4-511: 508 other reasons", many[-1]
