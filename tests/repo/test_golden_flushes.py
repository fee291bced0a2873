"""The collective logs every rank records in the simulated device's end-to-end cases and in the exchanging in-process
ranks' two-level cases, call for call, against the record in ``tests/golden/flush_logs.json`` (``scripts/
golden_flushes.py``; issue 47: a restructure leaves every flush's calls as they were). A change that means to change
the calls records them again, with a commit that says why."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The recorder itself, so that the test and the script compare alike
_SPEC = importlib.util.spec_from_file_location("golden_flushes", ROOT / "scripts" / "golden_flushes.py")
golden_flushes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(golden_flushes)


@pytest.mark.timeout(300)
def test_every_ranks_collective_log_is_the_recorded_one():
    want = json.loads((ROOT / "tests" / "golden" / golden_flushes.LOGS).read_text())
    got = golden_flushes.logs()
    assert sorted(got) == sorted(want)
    differ = [case for case in sorted(want) if got[case] != want[case]]
    assert differ == [], f"the collective logs of {differ} differ from tests/golden/{golden_flushes.LOGS}"


def test_negative_control_one_changed_call_is_seen():
    want = json.loads((ROOT / "tests" / "golden" / golden_flushes.LOGS).read_text())
    case = sorted(want)[0]
    changed = {**want, case: [list(want[case][0][:-1]) + [["all_reduce", None, 1, "torch.float32"]],
                              *want[case][1:]]}
    assert [c for c in sorted(want) if changed[c] != want[c]] == [case]
