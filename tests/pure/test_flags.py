"""Pure flag parsing: no DeepSpeed, no processes."""

import pytest

from owner_reduce.errors import OwnerReduceConfigError
from owner_reduce.planning.flags import OwnerReduceFlags, describe_flag_disagreement, pack_flags, parse_flags
from owner_reduce.planning.settings import settings_of


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


@pytest.mark.parametrize("key", ["reduce_to_owner", "reduce_probe", "reduce_probe_all_ranks"])
@pytest.mark.parametrize("value", ["yes", "true", 1.5, None, [True], 1, 0, "auto", {"on": True}])
def test_rejected_values_name_the_key(key, value):
    with pytest.raises(OwnerReduceConfigError, match=rf"compile\.{key} must be true or false") as err:
        parse_flags({key: value})
    assert repr(value) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_section_must_be_a_mapping():
    with pytest.raises(OwnerReduceConfigError, match="compile must be a mapping"):
        parse_flags([("reduce_to_owner", True)])


def test_settings_of_a_plain_config_object_have_the_flags_off():
    class Plain:
        deepcompile = True

    assert settings_of(Plain()).flags == OwnerReduceFlags()


def test_the_third_flag_prints_every_ranks_probe_lines_and_is_read_like_the_others():
    assert parse_flags({"reduce_probe": True, "reduce_probe_all_ranks": True}) == OwnerReduceFlags(False, True, True)
    assert not OwnerReduceFlags(reduce_probe_all_ranks=True).any_on  # it turns nothing on by itself

    class Built:
        reduce_to_owner, reduce_probe, reduce_probe_all_ranks = True, True, True

    assert settings_of(Built()).flags == OwnerReduceFlags(True, True, True)


def test_flag_disagreement_names_each_flag_and_each_ranks_value():
    packed = [pack_flags(OwnerReduceFlags(True, True)), pack_flags(OwnerReduceFlags(False, True)),
              pack_flags(OwnerReduceFlags(True, True)), pack_flags(OwnerReduceFlags(False, True))]
    assert packed == [3, 2, 3, 2]  # the integer the runtime's agreement all_gather carries
    assert pack_flags(OwnerReduceFlags(False, True, True)) == 6
    assert describe_flag_disagreement(packed) == [
        "compile.reduce_to_owner differs across ranks: true on ranks 0, 2, false on ranks 1, 3"]
    assert describe_flag_disagreement([1, 2]) == [
        "compile.reduce_to_owner differs across ranks: true on rank 0, false on rank 1",
        "compile.reduce_probe differs across ranks: false on rank 0, true on rank 1"]
    assert describe_flag_disagreement([3, 3, 3]) == []
    # at scale: ranks folded into ranges, not listed one by one
    many = [3] * 255 + [1] + [3] * 256
    assert describe_flag_disagreement(many) == [
        "compile.reduce_probe differs across ranks: true on ranks 0-254, 256-511, false on rank 255"]
    assert describe_flag_disagreement([4, 0]) == [
        "compile.reduce_probe_all_ranks differs across ranks: true on rank 0, false on rank 1"]
