"""Pure flag parsing: no DeepSpeed, no processes."""

import pytest

from owner_reduce.planning.flags import (
    OwnerReduceConfigError,
    OwnerReduceFlags,
    describe_flag_disagreement,
    flags_of,
    inapplicable_flags,
    pack_flags,
    parse_flags,
)


def test_defaults_are_off():
    assert parse_flags({}) == OwnerReduceFlags(False, False)
    assert parse_flags(None) == OwnerReduceFlags()
    assert not OwnerReduceFlags().any_on


@pytest.mark.parametrize("owner", [True, False])
@pytest.mark.parametrize("probe", [True, False])
def test_accepted_values(owner, probe):
    flags = parse_flags({"reduce_to_owner": owner, "reduce_probe": probe, "deepcompile": True})
    assert flags == OwnerReduceFlags(reduce_to_owner=owner, reduce_probe=probe)
    assert flags.any_on == (owner or probe)


@pytest.mark.parametrize("key", ["reduce_to_owner", "reduce_probe"])
@pytest.mark.parametrize("value", ["yes", "true", 1.5, None, [True], 1, 0, "auto", {"on": True}])
def test_rejected_values_name_the_key(key, value):
    with pytest.raises(OwnerReduceConfigError, match=rf"compile\.{key} must be true or false") as err:
        parse_flags({key: value})
    assert repr(value) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_section_must_be_a_mapping():
    with pytest.raises(OwnerReduceConfigError, match="compile must be a mapping"):
        parse_flags([("reduce_to_owner", True)])


def test_flags_of_plain_config_object_is_off():
    class Plain:
        deepcompile = True

    assert flags_of(Plain()) == OwnerReduceFlags()


# ---- flags that cannot take effect ---------------------------------------------------------------------------

ON = OwnerReduceFlags(reduce_to_owner=True)
BOTH = OwnerReduceFlags(reduce_to_owner=True, reduce_probe=True)


@pytest.mark.parametrize("flags", [ON, OwnerReduceFlags(reduce_probe=True), BOTH])
@pytest.mark.parametrize("stage", [1, 2])
def test_applicable_flags_give_no_reason(flags, stage):
    assert inapplicable_flags({"compile": {}}, flags, deepcompile=True, zero_stage=stage) == ()


@pytest.mark.parametrize("deepcompile,stage,why", [
    (False, 1, "compile.deepcompile is false"),
    (False, 3, "compile.deepcompile is false"),
    (True, 0, "zero_optimization.stage is 0"),
    (True, 3, "zero_optimization.stage is 3"),
])
def test_each_inapplicable_case_names_key_and_why(deepcompile, stage, why):
    (reason,) = inapplicable_flags({}, ON, deepcompile=deepcompile, zero_stage=stage)
    assert reason.startswith("owner_reduce: compile.reduce_to_owner has no effect: ") and why in reason
    (both,) = inapplicable_flags({}, BOTH, deepcompile=deepcompile, zero_stage=stage)
    assert "compile.reduce_to_owner and compile.reduce_probe have no effect" in both


def test_flags_off_are_never_inapplicable():
    for deepcompile, stage in [(False, 0), (True, 0), (True, 3), (False, 1)]:
        assert inapplicable_flags({}, OwnerReduceFlags(), deepcompile=deepcompile, zero_stage=stage) == ()


@pytest.mark.parametrize("key", ["reduce_to_owner", "reduce_probe"])
def test_top_level_keys_are_named_whatever_else_is_set(key):
    reasons = inapplicable_flags({key: True, "compile": {"deepcompile": True}}, OwnerReduceFlags(), True, 1)
    assert reasons == (f"owner_reduce: '{key}' at the top level of the DeepSpeed config has no effect (DeepSpeed "
                       f"ignores unknown top-level keys); it belongs under 'compile': compile.{key}",)
    assert len(inapplicable_flags({key: False}, ON, False, 1)) == 2  # the top-level key, and deepcompile off


def test_flag_disagreement_names_each_flag_and_each_ranks_value():
    packed = [pack_flags(OwnerReduceFlags(True, True)), pack_flags(OwnerReduceFlags(False, True)),
              pack_flags(OwnerReduceFlags(True, True)), pack_flags(OwnerReduceFlags(False, True))]
    assert packed == [3, 2, 3, 2]  # the integer the runtime's agreement all_gather carries
    assert describe_flag_disagreement(packed) == [
        "compile.reduce_to_owner differs across ranks: true on ranks 0, 2, false on ranks 1, 3"]
    assert describe_flag_disagreement([1, 2]) == [
        "compile.reduce_to_owner differs across ranks: true on rank 0, false on rank 1",
        "compile.reduce_probe differs across ranks: false on rank 0, true on rank 1"]
    assert describe_flag_disagreement([3, 3, 3]) == []
