"""One rank of a training job whose rank ``stall_rank`` stops itself (SIGSTOP) at the start of a backward pass.

Run as a plain script, one process per rank (as a user's launcher would), so that the test sees real exit
codes: ``python tests/support/launched/stall_worker.py MODE STALL_RANK MARKER_DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. ``deepspeed.init_distributed(timeout=USER_TIMEOUT_S)`` is the user's timeout; MODE
is "owner" (DeepCompile + owner_reduce) or "plain" (ZeRO-1's own hooks). The stalled rank writes ``stalled-<rank>`` into
MARKER_DIR just before it stops; the survivors' next collective is the one they can never finish.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from pathlib import Path

# The user's timeout (init_distributed); test_bounded_failure.py reads it. 12 s: above the ranks' skew when
# 5 processes start at once on 2 cores, short enough that the test does not wait 20 s twice.
USER_TIMEOUT_S = 12
STALL_AT_BACKWARD = 3  # after two full steps: compiled, profiled, flushes done


def main() -> None:
    mode, stall_rank, marker_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch

    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    from harness.toy_training import TrainSpec, train

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=USER_TIMEOUT_S),
                               verbose=False)
    backward = DeepSpeedEngine.backward
    calls = [0]

    def stalling_backward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a thin wrapper
        calls[0] += 1
        if rank == stall_rank and calls[0] == STALL_AT_BACKWARD:
            (marker_dir / f"stalled-{rank}").write_text(str(calls[0]))
            os.kill(os.getpid(), signal.SIGSTOP)
        return backward(self, *args, **kwargs)

    DeepSpeedEngine.backward = stalling_backward
    train(rank, world_size, TrainSpec(mode=mode, backend="eager", steps=STALL_AT_BACKWARD + 3, reduce_probe=False))
    print(f"stall_worker: rank {rank} finished all steps", flush=True)


if __name__ == "__main__":
    main()
