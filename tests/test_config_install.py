"""install()/uninstall() and the two flags, through DeepSpeed's own config parsing."""

import pytest
from deepspeed.compile.config import CompileConfig
from deepspeed.runtime import config as ds_config
from deepspeed.runtime.config import DeepSpeedConfig

import owner_reduce
from owner_reduce import OwnerReduceConfigError, OwnerReduceFlags, flags_of
from owner_reduce.harness.launch import run_ranks


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


def test_without_install_deepspeed_rejects_the_keys():
    assert not owner_reduce.is_installed()
    with pytest.raises(ValueError, match="reduce_to_owner"):
        _ds({"deepcompile": True, "reduce_to_owner": True})


@pytest.mark.parametrize("owner", [True, False])
@pytest.mark.parametrize("probe", [True, False])
def test_accepted_values(installed, owner, probe):
    c = _ds({"deepcompile": True, "reduce_to_owner": owner, "reduce_probe": probe}).compile_config
    assert flags_of(c) == OwnerReduceFlags(owner, probe)
    assert c.deepcompile is True and isinstance(c, CompileConfig)


def test_defaults_when_absent(installed):
    c = _ds({"deepcompile": True}).compile_config
    assert flags_of(c) == OwnerReduceFlags(False, False)
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
    original = ds_config.CompileConfig
    assert original is CompileConfig
    owner_reduce.install()
    patched = ds_config.CompileConfig
    owner_reduce.install()
    assert ds_config.CompileConfig is patched and patched is not original
    owner_reduce.uninstall()
    owner_reduce.uninstall()
    assert ds_config.CompileConfig is original and not owner_reduce.is_installed()
    with pytest.raises(ValueError, match="reduce_probe"):
        _ds({"reduce_probe": True})


@pytest.mark.parametrize("section", [None, {}, {"deepcompile": True, "free_activation": True},
                                     {"deepcompile": True, "reduce_to_owner": False, "reduce_probe": False}])
def test_flags_off_leaves_config_values_unchanged(section):
    without_flags = None if section is None else {k: v for k, v in section.items() if k not in owner_reduce.FLAG_KEYS}
    plain = _ds(without_flags).compile_config.model_dump()
    owner_reduce.install()
    try:
        dumped = _ds(section).compile_config.model_dump()
    finally:
        owner_reduce.uninstall()
    for key in owner_reduce.FLAG_KEYS:  # explicit false flags appear, and only they
        if section and key in section:
            assert dumped.pop(key) is False
    assert dumped == plain


def _initialize_cases(rank, world_size):
    """deepspeed.initialize itself (not only DeepSpeedConfig) honours and rejects the flags."""
    from zero1_engines import odd_mlp_engine

    owner_reduce.install()
    out = {}
    engine = odd_mlp_engine(deepcompile=True, reduce_to_owner=True, reduce_probe=False)
    out["flags"] = flags_of(engine._config.compile_config)
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
