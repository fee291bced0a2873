"""A short run of the main job: its outputs exist and its summary is consistent."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_demo_short_run(tmp_path):
    # stdout and stderr into one pipe, as on a terminal: the runtime's warnings, the demo's lines and rank 0's progress
    # bar meet there (the runtime's own INFO lines are hidden at DeepSpeed's default level: the demo prints rank 0's)
    proc = subprocess.run([sys.executable, "scripts/demo.py", "--steps", "4", "--world-size", "2", "--out",
                           str(tmp_path), "--timeout", "300"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-6000:]
    out = proc.stdout
    # The progress bar and the probe lines each on lines of their own (the bar used to be redrawn with \r and no
    # newline, so the next step's probe lines were written into the middle of it).
    assert "\r" not in out
    assert all(line.startswith("[dc-probe]") for line in out.splitlines() if "[dc-probe]" in line)
    bars = [line for line in out.splitlines() if "steps  loss" in line]
    assert len(bars) == 8 and all(re.fullmatch(r"  \[[#.]{30}\] [1-4]/4 steps  loss \d+\.\d{4}", b) for b in bars)
    assert re.search(r"^DeepCompile reduce_to_owner: \d+/30 gradients reduce to one rank(; .*)?$", out, re.M)
    assert re.search(r"^owner_reduce: settings: algo=auto, calibration none, verdicts none, probe rank 0, timeout "
                     r"\d+ s \(init_distributed\); torch.distributed gloo, 2 ranks = 1 node x 2 \(host names = "
                     r"LOCAL_WORLD_SIZE\), bucket \d+ elements, owner_reduce \d+\.\d+\.\d+$", out, re.M)
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


def test_progress_bar_is_whole_lines_at_each_tenth():
    from harness.toy_training import progress_line

    lines = {done: progress_line(done, 100, 1.5) for done in range(1, 101)}
    drawn = [done for done, line in lines.items() if line is not None]
    assert drawn == [1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert lines[1] == "  [..............................] 1/100 steps  loss 1.5000\n"
    assert lines[100] == "  [##############################] 100/100 steps  loss 1.5000\n"
    assert [done for done in range(1, 5) if progress_line(done, 4, 1.0)] == [1, 2, 3, 4]
