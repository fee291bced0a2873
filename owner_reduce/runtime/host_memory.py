"""Host memory for copies between the host and the device that must not block: both communicators
(``torch_comm``, ``nccl_comm``) and the NCCL unique id's broadcast (``nccl_binding``) copy through it, each copy only
after the collective it reads was waited for within the deadline (``nccl_comm`` Note (no blocking copy))."""

from __future__ import annotations

import torch


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned host memory, so that a copy between it and the device is asynchronous; ``tensor`` itself
    where no pinned allocator is available (a copy may then be synchronous, which is why each is made only after the
    collective it reads was waited for within the deadline: ``nccl_comm`` Note (no blocking copy))."""
    try:
        return tensor.pin_memory()
    except RuntimeError:
        return tensor
