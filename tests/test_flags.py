"""Pure flag parsing: no DeepSpeed, no processes."""

import pytest

from owner_reduce.planning.flags import OwnerReduceConfigError, OwnerReduceFlags, flags_of, parse_flags


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
