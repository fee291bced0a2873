"""What each rank reads on its own when the runtime starts (``planning.rank_inputs``): the files its config names and
NCCL's blocking variable; a failure kept as a reason, never raised on one rank alone. Init's agreement gathers
every rank's reasons and settings and every rank refuses together, naming the ranks, the key and the reason
(in-process ranks that really exchange: ``ExchangeWorld``), from each rank's own ``compile`` section, read by the
product's own parsing."""

from __future__ import annotations

import pytest

from owner_reduce.planning.rank_inputs import (
    NCCL_BLOCKING_ENV_VAR,
    REMOVED_ENV_VARS,
    read_inputs,
    removed_variables_set,
)
from owner_reduce.planning.settings import parse_settings
from owner_reduce.planning.verdict_book import VerdictBook, write_verdicts
from owner_reduce.runtime.handle import OwnerReduceMismatchError
from tests.processes.test_calibration import _cal
from tests.support.fakes import ExchangeWorld, flat_map, mirror_runtime

CAL = "compile.reduce_to_owner_calibration"
VER = "compile.reduce_to_owner_verdicts"


def _owner(**keys) -> dict:
    return {"deepcompile": True, "reduce_to_owner": True, **keys}


def test_the_named_files_are_read_and_a_bad_one_is_a_reason_naming_it(tmp_path):
    removed = {"OWNER_REDUCE_TIMEOUT_S": "30"}  # no longer read (a warning names its key: ``removed_variables_set``)
    assert read_inputs(parse_settings(_owner()), {}) == read_inputs(parse_settings(_owner()), removed)
    good = tmp_path / "cal.json"
    good.write_text(_cal(world_size=2).to_json())
    inputs = read_inputs(parse_settings(_owner(reduce_to_owner_calibration=str(good))), {})
    assert (inputs.calibration, inputs.problems) == (_cal(world_size=2), ())
    missing, invalid = tmp_path / "none.json", tmp_path / "bad.json"
    invalid.write_text("{not json")
    bad = read_inputs(parse_settings(_owner(reduce_to_owner_calibration=str(missing),
                                            reduce_to_owner_verdicts=str(tmp_path / "no" / "folder.json"))),
                      {NCCL_BLOCKING_ENV_VAR: "0"})
    assert (bad.calibration, bad.verdicts) == (None, None)  # the defaults
    assert [name for name, _ in bad.problems] == [NCCL_BLOCKING_ENV_VAR, CAL, VER]
    for name, reason in bad.problems:
        assert name in reason, reason  # every reason names its key or variable
    assert bad.problems[1][1] == (f"{CAL}='{missing}': calibration {missing}: cannot be read (No such file or "
                                  "directory)")
    assert "neither the file nor its folder exists" in bad.problems[-1][1]
    ((name, reason),) = read_inputs(parse_settings(_owner(reduce_to_owner_calibration=str(invalid))), {}).problems
    assert name == CAL and reason.startswith(f"{CAL}='{invalid}': ") and "not JSON" in reason


def test_with_the_owner_path_off_no_file_is_read():
    """The config warned that the keys have no effect (``settings.inapplicable_settings``); nothing to refuse."""
    probe_only = parse_settings({"reduce_probe": True, "reduce_to_owner_calibration": "/nowhere/cal.json",
                                 "reduce_to_owner_verdicts": "/nowhere/v.json"})
    inputs = read_inputs(probe_only, {})
    assert (inputs.calibration, inputs.verdicts_path, inputs.problems) == (None, None, ())


def test_verdict_file_is_replayed_where_it_exists_and_written_where_it_does_not(tmp_path):
    path = tmp_path / "verdicts.json"
    settings = parse_settings(_owner(reduce_to_owner_verdicts=str(path)))
    record = read_inputs(settings, {})
    assert (record.verdicts, record.verdicts_path, record.records_verdicts, record.problems) == (
        None, str(path), True, ())
    write_verdicts(path, VerdictBook(4))
    replay = read_inputs(settings, {})
    assert replay.verdicts == VerdictBook(4) and not replay.records_verdicts
    path.write_text("{not json")
    ((name, reason),) = read_inputs(settings, {}).problems
    assert name == VER and "not JSON" in reason


def test_the_variables_that_moved_into_the_config_are_no_longer_read_and_are_named_when_set(tmp_path):
    env = {"OWNER_REDUCE_FLUSH_ALGO": "handoff", "OWNER_REDUCE_MEASURE": "0",
           "OWNER_REDUCE_CALIBRATION": str(tmp_path / "cal.json"), "OWNER_REDUCE_VERDICTS": " "}
    assert read_inputs(parse_settings(_owner()), env) == read_inputs(parse_settings(_owner()), {})  # nothing read
    warnings = removed_variables_set(env)
    assert warnings == [
        "owner_reduce: OWNER_REDUCE_FLUSH_ALGO is set but no longer read (DeepSpeed's multi-node launcher does not "
        "forward it to other nodes); set compile.reduce_to_owner_algo in the DeepSpeed config instead",
        "owner_reduce: OWNER_REDUCE_MEASURE is set but no longer read (DeepSpeed's multi-node launcher does not "
        'forward it to other nodes); set compile.reduce_to_owner_algo "model" (for OWNER_REDUCE_MEASURE=0) in the '
        "DeepSpeed config instead",
        "owner_reduce: OWNER_REDUCE_CALIBRATION is set but no longer read (DeepSpeed's multi-node launcher does not "
        "forward it to other nodes); set compile.reduce_to_owner_calibration in the DeepSpeed config instead"]
    assert set(REMOVED_ENV_VARS) == {"OWNER_REDUCE_FLUSH_ALGO", "OWNER_REDUCE_MEASURE", "OWNER_REDUCE_CALIBRATION",
                                     "OWNER_REDUCE_VERDICTS", "OWNER_REDUCE_TIMEOUT_S"}


# ---- every rank refuses together -------------------------------------------------------------------------------


def _runtime_args(section: dict, env: dict) -> dict:
    """What ``wiring.activation.build_runtime`` hands the runtime, from one rank's compile section and environment."""
    s = parse_settings(section)
    inputs = read_inputs(s, env)
    return dict(owner=s.flags.reduce_to_owner, probe=s.flags.reduce_probe, all_ranks=s.flags.reduce_probe_all_ranks,
                algo=s.flush_algo, measure=s.measure, calibration=inputs.calibration, verdicts=inputs.verdicts,
                verdicts_path=inputs.verdicts_path, env_problems=inputs.problems, timeout_s=s.timeout_s)


def _init(sections: list[dict], envs: list[dict] | None = None, timeout_s: float = 10.0) -> None:
    world = ExchangeWorld(len(sections), timeout_s=timeout_s)
    m = flat_map([40] * 6, len(sections))
    args = [_runtime_args(section, env) for section, env in zip(sections, envs or [{}] * len(sections), strict=True)]
    world.run(lambda rank: mirror_runtime(m, rank=rank, comm=world.comm(rank), **args[rank]))


def _refused(sections: list[dict], message: str, envs: list[dict] | None = None) -> None:
    with pytest.raises(OwnerReduceMismatchError) as caught:
        _init(sections, envs)
    assert message in str(caught.value), str(caught.value)
    assert str(caught.value).startswith("owner_reduce on rank ") and "refusing to start: " in str(caught.value)
    notes = getattr(caught.value, "__notes__", [])
    # every other rank refused too (ExchangeWorld notes each rank's error), none was left waiting
    assert sum(": OwnerReduceMismatchError: " in n for n in notes) == len(sections) - 1, notes


@pytest.mark.timeout(60)
def test_ranks_whose_configs_differ_refuse_together_naming_the_key(tmp_path):
    cal4, cal_other = tmp_path / "cal4.json", tmp_path / "other.json"
    cal4.write_text(_cal(world_size=4).to_json())
    cal_other.write_text(_cal(world_size=4, reduce=99.0).to_json())
    same = [_owner()] * 4
    _init(same)  # the negative control: the same config everywhere starts
    _refused([_owner()] * 3 + [_owner(reduce_to_owner_algo="handoff")],
             "compile.reduce_to_owner_algo differs across ranks: auto on ranks 0-2, handoff on rank 3")
    _refused([_owner(reduce_to_owner_algo="model")] + [_owner()] * 3,
             "compile.reduce_to_owner_algo differs across ranks: model on rank 0, auto on ranks 1-3")
    _refused([_owner(reduce_to_owner_calibration=str(cal4))] * 2 + [_owner(reduce_to_owner_calibration=str(cal_other))]
             * 2, f"{CAL} names different calibrations across ranks: {_cal(world_size=4).digest()} on ranks 0, 1, "
                  f"{_cal(world_size=4, reduce=99.0).digest()} on ranks 2, 3")
    _refused([_owner(reduce_probe=True)] * 3 + [_owner(reduce_probe=True, reduce_probe_all_ranks=True)],
             "compile.reduce_probe_all_ranks differs across ranks: false on ranks 0-2, true on rank 3")
    _refused([_owner(reduce_to_owner_verdicts=str(tmp_path / "v.json"))] + [_owner()] * 3,
             f"{VER} differs across ranks: a file to write on rank 0, unset on ranks 1-3")
    _refused([_owner(reduce_to_owner_timeout_s=60)] + [_owner()] * 3,
             "compile.reduce_to_owner_timeout_s differs across ranks: 60 s on rank 0, unset on ranks 1-3")


@pytest.mark.timeout(60)
def test_what_one_rank_could_not_use_is_refused_by_every_rank_naming_it(tmp_path):
    good = tmp_path / "cal.json"
    good.write_text(_cal(world_size=2).to_json())
    missing = tmp_path / "elsewhere" / "cal.json"  # the file exists on rank 0's node only
    _refused([_owner(reduce_to_owner_calibration=str(good)), _owner(reduce_to_owner_calibration=str(missing))],
             f"refusing to start: rank 1: {CAL}='{missing}': calibration {missing}: cannot be read (No such file or "
             f"directory)")
    _refused([_owner(reduce_to_owner_calibration=str(good))] * 3, f"ranks 0-2: {CAL}: the calibration was measured on "
                                                                  "2 ranks, this run has 3")
    book = tmp_path / "v3.json"
    write_verdicts(book, VerdictBook(3))
    _refused([_owner(reduce_to_owner_verdicts=str(book))] * 2, f"ranks 0, 1: {VER}: the verdicts were measured on 3 "
                                                               "ranks, this run has 2")
    _refused([_owner()] * 3, f"ranks 0, 2: {NCCL_BLOCKING_ENV_VAR}='0': owner_reduce's NCCL calls through cupy need "
                             "blocking communicators",
             envs=[{NCCL_BLOCKING_ENV_VAR: "0"}, {}, {NCCL_BLOCKING_ENV_VAR: "0"}])
    write_verdicts(book, VerdictBook(2))  # the same verdicts on every rank: agreed
    _init([_owner(reduce_to_owner_verdicts=str(book))] * 2)
