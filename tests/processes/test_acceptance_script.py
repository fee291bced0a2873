"""The band-level acceptance script: inside the band on a clean run, outside it with a broken reduction."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra):
    return subprocess.run([sys.executable, "scripts/acceptance.py", "--steps", "12", "--world-size", "2", "--out",
                           str(tmp_path), "--timeout", "240", *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)


@pytest.mark.timeout(300)
def test_clean_run_is_inside_the_band(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "PASS: inside the band" in proc.stdout
    result = json.loads((tmp_path / "acceptance.json").read_text())
    assert result["inside_band"] and len(result["losses"]["owner"]) == 12
    assert (tmp_path / "acceptance.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_a_wrong_root_leaves_the_band(tmp_path):
    proc = _run(tmp_path, "--inject-fault", "wrong_root")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAIL: outside the band" in proc.stdout
    assert json.loads((tmp_path / "acceptance.json").read_text())["max_rel_loss_diff"] > 1e-4
