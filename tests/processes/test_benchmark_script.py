"""``scripts/benchmark_runtime.py`` drives runtime internals (the flusher's two-level stage loop, its bucket views) that
move with the runtime; its host measures run here so a change there breaks this test, not the next person who
regenerates the guide's numbers (issue 32 changed a stage's shape and the script failed only when run by hand). The
numbers themselves are not asserted: timings belong in the benchmark, not in a timed test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_host_measures_run_and_print_every_line():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_runtime.py"), "--skip-training",
                          "--repeats", "1"], capture_output=True, text=True, timeout=170, cwd=ROOT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    for line in ("reduce_grad through the op (real runtime, no flush):", "flush host time,  148 gradients",
                 "flush host time, 1000 gradients", "bytes allocated per steady step, GA 2, buckets kept",
                 "cupy NCCL communicator, host time per group of 4 Reduces",
                 "owner runtime's issue time, fitted over 1, 2, 4, 8, 16 calls per group"):
        assert line in text, (line, text[-2000:])
    # The issue-time fit quoted by planning/host_cost.py's defaults: a positive cost per call and per group.
    fit = re.search(r"per call (\d+\.\d+) us, per group (\d+\.\d+) us", text)
    assert fit and float(fit.group(1)) > 0 and float(fit.group(2)) > 0, text[-2000:]
    stages = re.findall(r"two-level flush, host time per stage \(\s*(\d+) stages", text)
    assert stages == ["1", "8", "32"], text[-2000:]
