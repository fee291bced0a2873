"""install()/uninstall() and the two flags, through DeepSpeed's own config parsing."""

import deepspeed
import pytest
from deepspeed.compile.config import CompileConfig
from deepspeed.runtime import config as ds_config
from deepspeed.runtime.config import DeepSpeedConfig

import owner_reduce
from harness.launch import run_ranks
from owner_reduce import OwnerReduceConfigError
from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.settings import SETTING_KEYS, OwnerReduceSettings, settings_of


def _ds(compile_section=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    if compile_section is not None:
        cfg["compile"] = compile_section
    return DeepSpeedConfig(cfg)


@pytest.fixture
def installed():
    owner_reduce.install()
    yield
    owner_reduce.uninstall()


FORGOTTEN = (r"^DeepSpeed config: compile\.reduce_to_owner, compile\.reduce_probe are owner_reduce's, and "
             r"owner_reduce\.install\(\) has not run in this process, .* call owner_reduce\.install\(\) before "
             r"deepspeed\.initialize, in every process, or start the script with python -m owner_reduce\.run$")


def _assert_forgotten_install_named():
    with pytest.raises(ValueError, match=FORGOTTEN):
        _ds({"deepcompile": True, "reduce_to_owner": True, "reduce_probe": False})


def test_without_install_the_keys_fail_naming_install():
    assert not owner_reduce.is_installed()
    _assert_forgotten_install_named()
    assert _ds({"deepcompile": True}).compile_config.deepcompile is True  # a config without the keys: untouched


def test_negative_control_without_the_guard_deepspeed_says_only_pydantics_words(monkeypatch):
    """The fault: the check armed at import is not in DeepSpeed's path; what is left is pydantic's bare error."""
    from owner_reduce.wiring.install_guard import unguarded

    monkeypatch.setattr(ds_config, "CompileConfig", unguarded(ds_config.CompileConfig))
    with pytest.raises(AssertionError, match=r"(?s)Regex pattern did not match.*Extra inputs are not permitted"):
        _assert_forgotten_install_named()


def test_the_guard_is_armed_when_owner_reduce_is_imported_before_deepspeed():
    """A fresh interpreter: importing owner_reduce imports neither torch nor DeepSpeed, and DeepSpeed's config module,
    loaded afterwards, is guarded."""
    import subprocess
    import sys

    code = ("import sys, owner_reduce\n"
            "assert not {'torch', 'deepspeed'} & set(sys.modules), 'owner_reduce imported torch or deepspeed'\n"
            "from deepspeed.runtime.config import DeepSpeedConfig\n"
            "try:\n"
            "    DeepSpeedConfig({'train_micro_batch_size_per_gpu': 1, 'compile': {'reduce_to_owner': True}})\n"
            "except ValueError as e:\n"
            "    print('ERROR', type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("ERROR")]
    assert line.startswith("ERROR OwnerReduceConfigError DeepSpeed config: compile.reduce_to_owner is owner_reduce's, "
                           "and owner_reduce.install() has not run"), line


@pytest.mark.parametrize("owner", [True, False])
@pytest.mark.parametrize("probe", [True, False])
def test_accepted_values(installed, owner, probe):
    c = _ds({"deepcompile": True, "reduce_to_owner": owner, "reduce_probe": probe}).compile_config
    assert settings_of(c).flags == OwnerReduceFlags(owner, probe)
    assert c.deepcompile is True and isinstance(c, CompileConfig)


def test_defaults_when_absent(installed):
    c = _ds({"deepcompile": True}).compile_config
    assert settings_of(c).flags == OwnerReduceFlags(False, False)
    assert type(c) is CompileConfig  # DeepSpeed's own class, built by DeepSpeed's own code


@pytest.mark.parametrize("key", ["reduce_to_owner", "reduce_probe"])
@pytest.mark.parametrize("value", ["yes", 1.5, None, [True], 1, "auto"])
def test_rejected_values_name_the_key(installed, key, value):
    with pytest.raises(OwnerReduceConfigError, match=rf"compile\.{key} must be true or false"):
        _ds({"deepcompile": True, key: value})


def test_unknown_key_is_still_rejected_by_name(installed):
    with pytest.raises(ValueError, match="reduce_to_ownr"):
        _ds({"deepcompile": True, "reduce_to_owner": True, "reduce_to_ownr": True})
    with pytest.raises(ValueError, match="reduce_to_ownr"):
        _ds({"deepcompile": True, "reduce_to_ownr": True})


def test_other_compile_keys_still_validated(installed):
    with pytest.raises(ValueError, match="free_activation_threshold"):
        _ds({"deepcompile": True, "reduce_to_owner": True, "free_activation_threshold": "lots"})


def test_install_is_idempotent_and_uninstall_restores_exactly():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from owner_reduce.wiring.install_guard import unguarded

    guarded = ds_config.CompileConfig  # the forgotten-install check, armed at import
    original_check = DeepSpeedConfig.__dict__["_do_warning_check"]
    original_init = DeepSpeedEngine.__dict__["__init__"]
    assert unguarded(guarded) is CompileConfig and guarded is not CompileConfig
    owner_reduce.install()
    patched = ds_config.CompileConfig
    owner_reduce.install()
    assert ds_config.CompileConfig is patched and patched is not guarded
    assert DeepSpeedConfig.__dict__["_do_warning_check"] is not original_check
    assert DeepSpeedEngine.__dict__["__init__"] is not original_init
    owner_reduce.uninstall()
    owner_reduce.uninstall()
    assert ds_config.CompileConfig is guarded and not owner_reduce.is_installed()
    assert DeepSpeedConfig.__dict__["_do_warning_check"] is original_check
    assert DeepSpeedEngine.__dict__["__init__"] is original_init
    with pytest.raises(ValueError, match=r"compile\.reduce_probe is owner_reduce's"):
        _ds({"reduce_probe": True})


@pytest.mark.parametrize("section", [None, {}, {"deepcompile": True, "free_activation": True},
                                     {"deepcompile": True, "reduce_to_owner": False, "reduce_probe": False}])
def test_flags_off_leaves_config_values_unchanged(section):
    without_flags = None if section is None else {k: v for k, v in section.items()
                                                  if k not in SETTING_KEYS}
    plain = _ds(without_flags).compile_config.model_dump()
    owner_reduce.install()
    try:
        dumped = _ds(section).compile_config.model_dump()
    finally:
        owner_reduce.uninstall()
    if section and any(key in section for key in SETTING_KEYS):  # owner_reduce's class: its keys appear
        defaults = OwnerReduceSettings().config_values()
        assert {key: dumped.pop(key) for key in SETTING_KEYS} == defaults
    assert dumped == plain


def _initialize_cases(rank, world_size):
    """deepspeed.initialize itself (not only DeepSpeedConfig) honours and rejects the flags."""
    from tests.support.zero1_engines import odd_mlp_engine

    owner_reduce.install()
    out = {}
    engine = odd_mlp_engine(deepcompile=True, reduce_to_owner=True, reduce_probe=False)
    out["flags"] = settings_of(engine._config.compile_config).flags
    try:
        odd_mlp_engine(deepcompile=True, reduce_probe="yes")
        out["error"] = None
    except OwnerReduceConfigError as e:
        out["error"] = str(e)
    owner_reduce.uninstall()
    try:
        odd_mlp_engine(deepcompile=True, reduce_to_owner=True)
        out["after_uninstall"] = None
    except ValueError as e:
        out["after_uninstall"] = str(e)
    return out


@pytest.mark.timeout(180)
def test_deepspeed_initialize_accepts_and_rejects():
    (out,) = run_ranks(_initialize_cases, 1, timeout=150)
    assert out["flags"] == OwnerReduceFlags(reduce_to_owner=True, reduce_probe=False)
    assert "compile.reduce_probe must be true or false" in out["error"]
    assert out["after_uninstall"] is not None and "reduce_to_owner" in out["after_uninstall"]


# ---- flags that cannot take effect: a warning on rank 0, never silence -------------------------------------------

class _Captured:
    """DeepSpeed's logger does not propagate to the root logger: listen on it directly."""

    def __init__(self):
        import logging

        from deepspeed.utils import logger

        from owner_reduce.wiring import unused_flags

        unused_flags._warned.clear()
        self.lines = []
        self._logger = logger
        self._handler = logging.Handler(level=logging.WARNING)
        self._handler.emit = lambda record: self.lines.append(record.getMessage())
        logger.addHandler(self._handler)

    def owner_lines(self):
        self._logger.removeHandler(self._handler)
        return [line for line in self.lines if "owner_reduce" in line]


def _cfg(stage=1, top=None, **compile_section):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, **(top or {})}
    if compile_section:
        cfg["compile"] = compile_section
    return cfg


SILENT_CASES = {
    "deepcompile off": (_cfg(deepcompile=False, reduce_to_owner=True), "compile.deepcompile is false"),
    "deepcompile absent": (_cfg(reduce_probe=True), "compile.deepcompile is false"),
    "stage 0": (_cfg(stage=0, deepcompile=True, reduce_to_owner=True), "zero_optimization.stage is 0"),
    "stage 3": (_cfg(stage=3, deepcompile=True, reduce_probe=True), "zero_optimization.stage is 3"),
    "top-level reduce_to_owner": (_cfg(top={"reduce_to_owner": True}, deepcompile=True),
                                  "'reduce_to_owner' at the top level"),
    "top-level reduce_probe": (_cfg(top={"reduce_probe": False}), "'reduce_probe' at the top level"),
}


@pytest.mark.parametrize("case", list(SILENT_CASES))
def test_each_flag_that_cannot_take_effect_is_named_in_a_warning(installed, case):
    config, why = SILENT_CASES[case]
    captured = _Captured()
    DeepSpeedConfig(config)
    DeepSpeedConfig(config)  # DeepSpeed reads a config more than once (zero.Init): one warning per process
    (line,) = captured.owner_lines()
    assert why in line and "no effect" in line


@pytest.mark.parametrize("stage", [1, 2])
def test_flags_that_take_effect_warn_nothing(installed, stage):
    captured = _Captured()
    DeepSpeedConfig(_cfg(stage=stage, deepcompile=True, reduce_to_owner=True, reduce_probe=True))
    assert captured.owner_lines() == []


MISPLACED = _cfg(top={"reduce_to_owner": True}, deepcompile=True)


def _said_about(key, config, capfd):
    """Every line that reading ``config`` makes DeepSpeed (or anything it calls) say about ``key``, on every channel:
    its logger's records at any level (lowered to DEBUG meanwhile: what its own stdout handler would print is among
    them), Python warnings, and whatever reaches stdout and stderr (a print, a write to either stream)."""
    import logging
    import warnings

    from deepspeed.utils import logger

    from owner_reduce.wiring import unused_flags

    unused_flags._warned.clear()  # owner_reduce says each reason once per process
    capfd.readouterr()
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DeepSpeedConfig(config)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out, err = capfd.readouterr()
    heard = records + [str(w.message) for w in caught] + out.splitlines() + err.splitlines()
    return [line for line in heard if key in line]


def _assert_silent_about(key, said):
    assert said == [], f"something spoke about {key!r}: {said}"


def test_negative_control_without_install_top_level_keys_pass_silently(capfd):
    # What the warning exists for: DeepSpeed alone says nothing about a misplaced key, on any channel.
    assert not owner_reduce.is_installed()
    _assert_silent_about("reduce_to_owner", _said_about("reduce_to_owner", MISPLACED, capfd))


def _deepspeed_speaks(how):
    """DeepSpeed's config check (``_do_warning_check``, where it puts its config warnings) also saying something
    about the misplaced key, as ``how`` says: the fault the silence check above must hear."""
    import warnings

    from deepspeed.utils import logger

    original = DeepSpeedConfig._do_warning_check
    words = "ignoring the unknown top-level key 'reduce_to_owner'"
    say = {"debug log": lambda: logger.debug(words), "print": lambda: print(words),
           "python warning": lambda: warnings.warn(words, stacklevel=1)}[how]

    def _do_warning_check(self):
        original(self)
        say()

    return _do_warning_check


@pytest.mark.parametrize("speaker", ["owner_reduce installed", "debug log", "print", "python warning"])
def test_the_silence_check_hears_anyone_speak_about_the_key(capfd, monkeypatch, speaker):
    """Negative control of the one above: with the fault in the config-reading path (owner_reduce's own warning, or
    DeepSpeed's check speaking on one channel), the same check fails, quoting what was said."""
    if speaker == "owner_reduce installed":
        owner_reduce.install()
        expected = r"'reduce_to_owner' at the top level of the DeepSpeed config has no effect"
    else:
        monkeypatch.setattr(DeepSpeedConfig, "_do_warning_check", _deepspeed_speaks(speaker))
        expected = r"ignoring the unknown top-level key 'reduce_to_owner'"
    try:
        said = _said_about("reduce_to_owner", MISPLACED, capfd)
    finally:
        owner_reduce.uninstall()
    with pytest.raises(AssertionError, match=rf"something spoke about 'reduce_to_owner': \[.*{expected}"):
        _assert_silent_about("reduce_to_owner", said)


def _silent_cases_worker(rank, world_size):
    """deepspeed.initialize on 2 ranks: the warning appears on rank 0 only, at initialize (stage 3: before
    engine.compile() reaches DeepCompile's native stage-3 init, which on a machine without CUDA fails to build)."""
    import torch

    from harness.toy_models import OddMLP

    owner_reduce.install()
    out = {}
    for case in ("deepcompile off", "stage 0", "stage 3", "top-level reduce_to_owner"):
        config = dict(SILENT_CASES[case][0], train_micro_batch_size_per_gpu=4,
                      optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
        captured = _Captured()
        torch.manual_seed(0)
        model = OddMLP()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        out[case] = captured.owner_lines()
        if case == "deepcompile off":  # and it trains, through ZeRO's own hooks
            loss = engine(torch.randn(4, 12), torch.randn(4, 5))
            engine.backward(loss)
            engine.step()
        engine.destroy()
    owner_reduce.uninstall()
    return out


@pytest.mark.timeout(240)
def test_silent_cases_warn_on_rank_0_only_at_initialize():
    rank0, rank1 = run_ranks(_silent_cases_worker, 2, timeout=200)
    for case, lines in rank0.items():
        assert len(lines) == 1 and SILENT_CASES[case][1] in lines[0], (case, lines)
    assert all(lines == [] for lines in rank1.values()), rank1


# ---- keys that need engine.compile(): one warning at the first optimizer step ----------------------------------

UNCOMPILED = "compile.reduce_to_owner has no effect until engine.compile() runs"


def _first_step(engine, steps=2):
    """``steps`` optimizer steps; what owner_reduce said meanwhile, and whether its check was still on the engine after
    the first (and DeepSpeed's ``step`` on the class, untouched)."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    from owner_reduce.wiring import unused_flags
    from tests.support.ds_log import ds_log

    unused_flags._warned.clear()  # owner_reduce says each reason once per process
    armed = "step" in engine.__dict__
    left, lines = [], []
    for _ in range(steps):
        with ds_log(None) as log:
            engine.backward(engine(torch.randn(4, 12), torch.randn(4, 5)))
            engine.step()
        lines.append([line for line in log.lines if "has no effect" in line])
        left.append("step" in engine.__dict__ or type(engine).step is not DeepSpeedEngine.__dict__["step"])
    runtime = engine.__dict__.get("_owner_reduce_runtime")
    ran = 0 if runtime is None else runtime.stats.reduce_grad_calls
    engine.destroy()
    return {"armed": armed, "lines": lines, "left": left, "ran": ran}


def _first_step_worker(rank, world_size, out_dir):
    """One rank: an engine never compiled, the same with the check's arming broken in the product (the control), one
    compiled (it must say nothing), and the transformers Trainer without --torch_compile."""
    from transformers import Trainer, TrainingArguments

    from owner_reduce.run import _create_accelerate_state
    from owner_reduce.wiring import unused_flags
    from tests.support.launched.launched_train import build_model
    from tests.support.launched.launched_trainer import RandomTokens
    from tests.support.zero1_engines import odd_mlp_engine

    owner_reduce.install()
    out = {"uncompiled": _first_step(odd_mlp_engine(deepcompile=True, reduce_to_owner=True))}
    arm = unused_flags.arm_first_step_check
    unused_flags.arm_first_step_check = lambda engine: False  # the fault: the check never armed
    out["unarmed (fault)"] = _first_step(odd_mlp_engine(deepcompile=True, reduce_to_owner=True))
    unused_flags.arm_first_step_check = arm
    engine = odd_mlp_engine(deepcompile=True, reduce_to_owner=True)
    engine.compile(backend="eager")
    out["compiled"] = _first_step(engine)
    _create_accelerate_state("gloo")  # as python -m owner_reduce.run --accelerate-backend gloo
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 1}, "compile": {"deepcompile": True, "reduce_to_owner": True}}
    args = TrainingArguments(output_dir=out_dir, deepspeed=ds, per_device_train_batch_size=2, max_steps=2,
                             report_to="none", save_strategy="no", accelerator_config={"use_configured_state": True})
    from tests.support.ds_log import ds_log

    unused_flags._warned.clear()
    with ds_log(None) as log:
        trainer = Trainer(model=build_model(), args=args, train_dataset=RandomTokens(8))
        trainer.train()
    out["trainer"] = [line for line in log.lines if "has no effect" in line]
    trainer.model_wrapped.destroy()
    return out


def _assert_warned_once_at_the_first_step(result):
    assert result["armed"], "the check was not armed on an engine whose keys can take effect"
    first, second = result["lines"]
    assert len(first) == 1 and first[0].startswith(f"owner_reduce: {UNCOMPILED}"), f"no warning: {result['lines']}"
    assert "engine.compile()" in first[0] and "--torch_compile" in first[0]
    assert second == [], f"warned again at the second step: {second}"
    assert result["left"] == [False, False], "a check left on the step path after the first step"


@pytest.mark.timeout(240)
def test_keys_without_engine_compile_warn_once_at_the_first_optimizer_step(tmp_path):
    (out,) = run_ranks(_first_step_worker, 1, args=(str(tmp_path),), timeout=200)
    _assert_warned_once_at_the_first_step(out["uncompiled"])
    with pytest.raises(AssertionError, match="the check was not armed"):  # the control: the product's fault is seen
        _assert_warned_once_at_the_first_step(out["unarmed (fault)"])
    compiled = out["compiled"]
    assert compiled["ran"] > 0 and compiled["lines"] == [[], []] and compiled["left"] == [False, False], compiled
    (line,) = out["trainer"]
    assert line.startswith(f"owner_reduce: {UNCOMPILED}") and "--torch_compile" in line
