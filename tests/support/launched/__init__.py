"""Scripts that launchers start by path (``python -m owner_reduce.run launched_train.py``, ``torchrun``, DeepSpeed's
launcher, plain ``python stall_worker.py``), as a user's training scripts are; a test may also import what they
define. Run as a script, each finds its neighbours through its own folder, as ``python train.py`` does."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any


def launch(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float, results: list[Path]
           ) -> tuple[str, list[Any]]:
    """Run a launcher in its own session, killed whole past ``timeout_s`` (a hung rank must fail the test, not stall
    the suite); its output, then each file of ``results`` as ``torch.load`` reads it. A launch that fails or times out
    fails the test with the command's tail of output."""
    import pytest
    import torch

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])}... still running after {timeout_s} s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}:\n{log[-8000:]}"
    return log, [torch.load(path, weights_only=False) for path in results]
