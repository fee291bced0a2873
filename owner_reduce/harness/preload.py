"""What the ranks' fork server imports once, so that each rank starts without importing torch and DeepSpeed.

Why: a rank spawned fresh spends several seconds importing torch and DeepSpeed, and on two cores four ranks
importing at once cost most of a short end-to-end test. ``launch`` starts ranks from a fork server that has
already imported these (CPU machines only: a fork after CUDA was touched is unusable, see ``launch``).
"""

import deepspeed  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401

import owner_reduce  # noqa: F401
import owner_reduce.harness.toy_training  # noqa: F401
