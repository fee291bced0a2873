"""A short run of the main job: its outputs exist and its summary is consistent."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_demo_short_run(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/demo.py", "--steps", "4", "--world-size", "2", "--out",
                           str(tmp_path), "--timeout", "300"], cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^DeepCompile reduce_to_owner: \d+/30 gradients reduce to one rank$", out, re.M)
    assert re.search(r"^\[dc-probe\]\[r0\] flushReduceBucket #1 dtype=Float tasks=\d+ ", out, re.M)
    assert "collective calls per flush" in out and "bytes saved:" in out
    for name in ("loss_curves.png", "bytes_per_flush.png"):
        png = tmp_path / name
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    s = json.loads((tmp_path / "summary.json").read_text())
    a, o = s["allreduce"], s["owner"]
    assert a["owner_share"] == 0 and 0 < o["owner_share"] <= 1
    assert sum(o["bytes_per_rank_per_step"]) < sum(a["bytes_per_rank_per_step"])
    assert s["bytes_saved_share"] == pytest.approx(1 - sum(o["bytes_per_rank_per_step"]) /
                                                   sum(a["bytes_per_rank_per_step"]))
    assert o["kept_share"] > a["kept_share"] and a["kept_share"] == pytest.approx(0.5, abs=0.02)  # ws=2
    assert len(s["loss_curves"]["owner"]) == 4 and s["max_abs_loss_diff"] < 1e-3
    # The AllReduce path: one call per flush. The owner path: its model's choice, and in this short run the measured
    # guard's trial (step 2 runs native's calls, one AllReduce per gradient), so more calls over the whole run.
    assert a["calls_per_flush"] == a["calls_per_flush_last_step"] == 1 and o["calls_per_flush_last_step"] >= 1
    assert o["calls_per_flush"] > o["calls_per_flush_last_step"] and o["measured_lines"] == []
    assert set(a["algos"]) == {"allreduce"} and o["algos"] and "flush algorithm, one step" in out
