"""What both layout builders share: the fake world they run in, the ZeRO-1 config they size, what they return.

Why a fake process group for both: DeepSpeed's partition arithmetic asks ``deepspeed.comm`` for the world
size of the data-parallel group. torch's "fake" backend lets one process claim to be rank ``r`` of ``n``
(collectives return at once and do nothing), so that question gets the real job's answer through
DeepSpeed's own code. The group is torch.distributed's default group and DeepSpeed keeps its backend in a
module global, so one process sizes one world size; ``fake_engine.size_in_subprocess`` spawns one per size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..planning.owner_map import OwnerMap
from ..planning.sizing import backward_order


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """Make this process rank ``rank`` of ``world_size`` in torch's fake process group, then in DeepSpeed."""
    import deepspeed
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_backend() != "fake":
            raise RuntimeError(f"this process already belongs to a {dist.get_backend()} group of "
                               f"{dist.get_world_size()}; size each world size in its own process")
    else:
        # DeepSpeed's sanity checks read the launcher's variables even when the group already exists.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend="fake")


def zero1_sizing_config(bf16: bool = True) -> dict[str, Any]:
    """A plain ZeRO-1 config: partitioning does not depend on the bucket sizes, dtype or optimizer type."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


@dataclass(frozen=True)
class BuiltLayout:
    """What a layout builder returns; ``notes`` name the builder that ran and any fallback it took."""

    owner_map: OwnerMap
    grad_order: tuple[int, ...]
    reduce_bucket_size: int  # zero_optimization.reduce_bucket_size (DeepCompile's bucket)
    optimizer_class: str
    seconds: float
    notes: tuple[str, ...]


def grad_order_of(model: nn.Module, param_id: Callable[[nn.Parameter], int | None]) -> tuple[int, ...]:
    """Gradient arrival order (``planning.sizing.backward_order``) of the optimizer's parameters.

    ``param_id`` gives the optimizer's id of a parameter, or None for one it does not hold (frozen, empty).
    """
    forward: Iterable[int | None] = (param_id(p) for p in model.parameters())
    return backward_order(pid for pid in forward if pid is not None)
