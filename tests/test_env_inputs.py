"""Every ``OWNER_REDUCE_*`` variable read in one place (``planning.env_inputs``), a failure kept as a reason, never
raised on one rank alone; init's agreement gathers every rank's reasons and every rank refuses together, naming the
ranks, the variable and the reason (in-process ranks that really exchange: ``ExchangeWorld``)."""

from __future__ import annotations

import pytest
from fakes import ExchangeWorld, flat_map, mirror_runtime

from owner_reduce.planning.env_inputs import TIMEOUT_ENV_VAR, VERDICTS_ENV_VAR, parse_timeout_s, read_environment
from owner_reduce.planning.verdict_book import VerdictBook, write_verdicts
from owner_reduce.runtime.handle import OwnerReduceMismatchError


def test_each_variable_is_read_and_a_bad_value_is_a_reason_naming_it(tmp_path):
    assert read_environment({}) == read_environment({"OWNER_REDUCE_MEASURE": " "})
    good = read_environment({"OWNER_REDUCE_FLUSH_ALGO": "reduce", "OWNER_REDUCE_MEASURE": "off",
                             TIMEOUT_ENV_VAR: "30"})
    assert (good.flush_algo, good.measure, good.timeout_s, good.problems) == ("reduce", False, 30.0, ())
    bad = read_environment({"OWNER_REDUCE_FLUSH_ALGO": "fast", "OWNER_REDUCE_MEASURE": "sometimes",
                            TIMEOUT_ENV_VAR: "-1", "OWNER_REDUCE_CALIBRATION": str(tmp_path / "none.json"),
                            VERDICTS_ENV_VAR: str(tmp_path / "no" / "folder.json")})
    assert (bad.flush_algo, bad.measure, bad.timeout_s, bad.calibration) == ("auto", True, None, None)  # defaults
    assert [v for v, _ in bad.problems] == ["OWNER_REDUCE_FLUSH_ALGO", "OWNER_REDUCE_MEASURE", TIMEOUT_ENV_VAR,
                                            "OWNER_REDUCE_CALIBRATION", VERDICTS_ENV_VAR]
    for variable, reason in bad.problems:
        assert variable in reason, reason  # every reason names its variable
    assert "neither the file nor its folder exists" in bad.problems[-1][1]
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV_VAR} must be a positive number of seconds, got 'inf'"):
        parse_timeout_s("inf")


def test_verdict_file_is_replayed_where_it_exists_and_written_where_it_does_not(tmp_path):
    path = tmp_path / "verdicts.json"
    record = read_environment({VERDICTS_ENV_VAR: str(path)})
    assert (record.verdicts, record.verdicts_path, record.records_verdicts, record.problems) == (
        None, str(path), True, ())
    write_verdicts(path, VerdictBook(4))
    replay = read_environment({VERDICTS_ENV_VAR: str(path)})
    assert replay.verdicts == VerdictBook(4) and not replay.records_verdicts
    path.write_text("{not json")
    ((variable, reason),) = read_environment({VERDICTS_ENV_VAR: str(path)}).problems
    assert variable == VERDICTS_ENV_VAR and "not JSON" in reason
    assert read_environment({VERDICTS_ENV_VAR: str(path)}, reduce_to_owner=False).problems == ()


def _init(per_rank: list[dict], timeout_s: float = 10.0) -> None:
    world = ExchangeWorld(len(per_rank), timeout_s=timeout_s)
    m = flat_map([40] * 6, len(per_rank))
    world.run(lambda rank: mirror_runtime(m, rank=rank, comm=world.comm(rank), **per_rank[rank]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("settings", "message"), [
    ([{}, {"env_problems": (("OWNER_REDUCE_FLUSH_ALGO", "OWNER_REDUCE_FLUSH_ALGO must be one of auto, reduce, "
                                                        "allreduce, handoff, native, two_level, got 'fast'"),)}],
     "refusing to start: rank 1: OWNER_REDUCE_FLUSH_ALGO must be one of auto, reduce, allreduce, handoff, native, "
     "two_level, got 'fast'"),
    ([{"env_problems": (("OWNER_REDUCE_MEASURE", "OWNER_REDUCE_MEASURE must be one of ..., got 'x'"),)}, {}, {}],
     "refusing to start: rank 0: OWNER_REDUCE_MEASURE must be one of ..., got 'x'"),
    ([{"env_problems": ((TIMEOUT_ENV_VAR, "a"),)}, {}, {"env_problems": ((TIMEOUT_ENV_VAR, "a"),)}],
     "refusing to start: ranks 0, 2: a"),
    ([{"verdicts_path": "/v.json"}, {}], f"{VERDICTS_ENV_VAR} differs across ranks: a file to write on rank 0, "
                                         "unset on rank 1"),
    ([{"verdicts": VerdictBook(2), "verdicts_path": "/v.json"}, {"verdicts": VerdictBook(2, ()),
                                                                 "verdicts_path": "/v.json"}], None),
    ([{"verdicts": VerdictBook(3), "verdicts_path": "/v.json"}] * 2,
     "ranks 0, 1: OWNER_REDUCE_VERDICTS: the verdicts were measured on 3 ranks, this run has 2"),
])
def test_what_one_rank_could_not_use_is_refused_by_every_rank_naming_it(settings, message):
    if message is None:
        _init(settings)  # the same verdicts on every rank: agreed
        return
    with pytest.raises(OwnerReduceMismatchError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")) as caught:
        _init(settings)
    notes = getattr(caught.value, "__notes__", [])
    # every other rank refused too (ExchangeWorld notes each rank's error), none was left waiting
    assert sum(": OwnerReduceMismatchError: " in n for n in notes) == len(settings) - 1, notes
