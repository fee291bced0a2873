"""owner_reduce's keys through DeepSpeed's own config parsing, in this process: carried on the compile config (so they
are in DeepSpeed's config dump at init), refused at ``deepspeed.initialize`` naming the key, and named in a warning
where they cannot take effect."""

from __future__ import annotations

import deepspeed
import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig

import owner_reduce
from owner_reduce import OwnerReduceConfigError
from owner_reduce.planning.flags import OwnerReduceFlags
from owner_reduce.planning.settings import SETTING_KEYS, OwnerReduceSettings, parse_settings, settings_of
from tests.pure.test_settings import BAD, EVERY_KEY
from tests.support.ds_log import ds_log

IN_EFFECT = {**EVERY_KEY, "reduce_to_owner_algo": "auto"}  # "model" keeps no verdicts: warned below


def _cfg(stage=1, top=None, **compile_section):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, **(top or {})}
    if compile_section:
        cfg["compile"] = compile_section
    return cfg


@pytest.fixture
def installed():
    from owner_reduce.wiring import unused_flags

    owner_reduce.install()
    unused_flags._warned.clear()
    yield
    owner_reduce.uninstall()


def test_every_key_is_carried_on_the_compile_config_and_in_deepspeeds_config_dump(installed):
    config = DeepSpeedConfig(_cfg(deepcompile=True, **EVERY_KEY))
    c = config.compile_config
    assert settings_of(c) == parse_settings(EVERY_KEY) and c.deepcompile is True
    assert {key: c.model_dump()[key] for key in SETTING_KEYS} == EVERY_KEY
    with ds_log() as log:
        config.print("DeepSpeedEngine configuration")  # what the engine logs on rank 0 at init
    (dumped,) = [line for line in log.lines if line.lstrip().startswith("compile_config ")]
    for key, value in EVERY_KEY.items():
        assert f"{key}={value!r}" in dumped, dumped
    only_algo = DeepSpeedConfig(_cfg(deepcompile=True, reduce_to_owner=True, reduce_to_owner_algo="handoff"))
    assert settings_of(only_algo.compile_config) == OwnerReduceSettings(OwnerReduceFlags(True), "handoff")


@pytest.fixture
def no_process_group(monkeypatch):
    """``deepspeed.initialize`` in this process without a process group: its ``init_distributed`` does nothing (its
    config parsing then takes rank 0 of 1, as DeepSpeed does without a group); nothing is left behind."""
    import deepspeed.comm as ds_comm

    monkeypatch.setattr(ds_comm, "init_distributed", lambda *args, **kwargs: None)
    owner_reduce.install()
    yield
    owner_reduce.uninstall()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(("key", "value", "says"), BAD)
def test_a_bad_value_of_each_new_key_fails_at_deepspeed_initialize_naming_the_key(no_process_group, key, value, says):
    model = torch.nn.Linear(3, 2)
    config = _cfg(deepcompile=True, reduce_to_owner=True, **{key: value})
    with pytest.raises(OwnerReduceConfigError, match=rf"^DeepSpeed config: compile\.{key} ") as caught:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert says in str(caught.value)


def test_negative_control_a_good_value_passes_deepspeed_initialize_s_config_parsing(no_process_group):
    """The same call with every key valid gets past the config (it then fails later, for want of a process group:
    not at the config)."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - anything but a config error
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config=_cfg(deepcompile=True, **EVERY_KEY))
    assert not isinstance(caught.value, OwnerReduceConfigError), caught.value


SILENT = {
    "all ranks without the probe": (_cfg(deepcompile=True, reduce_to_owner=True, reduce_probe_all_ranks=True),
                                    "compile.reduce_probe_all_ranks has no effect: compile.reduce_probe is false"),
    "calibration with the owner path off": (_cfg(deepcompile=True, reduce_probe=True,
                                                 reduce_to_owner_calibration="c.json"),
                                            "compile.reduce_to_owner_calibration has no effect: "
                                            "compile.reduce_to_owner is false"),
    "a forced algorithm with the owner path off": (_cfg(deepcompile=True, reduce_to_owner_algo="handoff"),
                                                   "compile.reduce_to_owner_algo has no effect"),
    "verdicts under a forced algorithm": (_cfg(deepcompile=True, reduce_to_owner=True, reduce_to_owner_algo="reduce",
                                               reduce_to_owner_verdicts="v.json"),
                                          'compile.reduce_to_owner_verdicts has no effect: '
                                          'compile.reduce_to_owner_algo is "reduce"'),
    "stage 3": (_cfg(stage=3, deepcompile=True, reduce_to_owner_algo="model"),
                "compile.reduce_to_owner_algo has no effect: zero_optimization.stage is 3"),
    "a key at the top level": (_cfg(top={"reduce_to_owner_calibration": "c.json"}, deepcompile=True),
                               "'reduce_to_owner_calibration' at the top level"),
}


@pytest.mark.parametrize("case", list(SILENT))
def test_each_key_that_cannot_take_effect_is_named_in_a_warning_once(installed, case):
    config, why = SILENT[case]
    with ds_log(level=None) as log:  # DeepSpeed's own level: warnings show at its default
        DeepSpeedConfig(config)
        DeepSpeedConfig(config)  # DeepSpeed reads a config more than once (zero.Init): one warning per process
    (line,) = [line for line in log.lines if "owner_reduce" in line]
    assert why in line and "no effect" in line, line


def test_every_key_in_effect_warns_nothing(installed):
    with ds_log(level=None) as log:
        DeepSpeedConfig(_cfg(deepcompile=True, **IN_EFFECT))
        DeepSpeedConfig(_cfg(stage=2, deepcompile=True, reduce_to_owner=True, reduce_to_owner_algo="handoff",
                             reduce_to_owner_calibration="c.json"))
    assert [line for line in log.lines if "owner_reduce" in line] == []
