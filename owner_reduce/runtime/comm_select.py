"""Which communicator a run gets: cupy NCCL where it works, torch.distributed otherwise, the same on every rank.

Why agreement matters more than the choice: the owner path is correct on either communicator (same sums,
same pre-division), but if one rank picked cupy NCCL and another torch.distributed, the first flush would
hang. So each step that can fail on one rank is followed by one tiny collective over the data-parallel group
carrying every rank's reason (or None), and every rank derives the same decision from the same list:
1. this rank's preconditions (DeepSpeed accelerator is CUDA, cupy and libnccl load, torch sees the GPU);
   agreed before any rank calls ``ncclCommInitRank``, which would wait forever for a rank that never comes;
2. creating the communicator; if any rank failed, every rank closes what it built.
A fallback logs ONE warning (on group rank 0, naming every failing rank and its cause), never raises and
never changes results. The decision itself (``combine_reasons``) is pure, so it is tested without a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.wording import ranks_phrase
from .comm import ReduceComm
from .torch_comm import TorchDistComm

FALLBACK_PREFIX = "owner_reduce: reducing through torch.distributed instead of cupy NCCL"


def local_readiness(accelerator: str) -> str | None:
    """Why this rank cannot try cupy NCCL, or None. Local only: no communication, no communicator."""
    if accelerator != "cuda":
        return f"the DeepSpeed accelerator is '{accelerator}', not 'cuda'"
    try:
        from .nccl_binding import nccl_runtime_version

        nccl_runtime_version()
    except Exception as error:  # noqa: BLE001 - ImportError for cupy/libnccl, anything else alike
        return f"cupy's NCCL binding is unavailable ({type(error).__name__}: {error})"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def combine_reasons(reasons: Sequence[str | None]) -> str | None:
    """One line naming every failing rank and its reason (ranks grouped by reason, folded into ranges and capped:
    ``planning.wording``); None if all succeeded.

    Pure and deterministic: every rank holds the same list, so every rank takes the same branch.
    """
    by_reason: dict[str, list[int]] = defaultdict(list)
    for rank, reason in enumerate(reasons):
        if reason is not None:
            by_reason[reason].append(rank)
    if not by_reason:
        return None
    parts = []
    for reason, ranks in by_reason.items():
        if len(ranks) == len(reasons):
            who = "all ranks"
        else:
            who = ranks_phrase(ranks)
        parts.append(f"{who}: {reason}")
    return "; ".join(parts)


def _guarded(step: Callable[[], str | None]) -> str | None:
    try:
        return step()
    except Exception as error:  # noqa: BLE001 - a check that raises is a reason, not a crash
        return f"{type(error).__name__}: {error}"


def gather_reasons(process_group: Any, reason: str | None) -> list[str | None]:
    """Every rank's reason, by group rank: one ``all_gather_object`` over the data-parallel group."""
    import torch.distributed as dist
    from torch._dispatch.python import no_python_dispatcher

    group = dist.group.WORLD if process_group is None else process_group
    out: list[str | None] = [None] * dist.get_world_size(group)
    with no_python_dispatcher():
        dist.all_gather_object(out, reason, group=group)
    return out


def _default_readiness() -> str | None:
    from deepspeed.accelerator import get_accelerator

    return local_readiness(get_accelerator().device_name())


def _create_cupy_comm(process_group: Any) -> ReduceComm:
    from .nccl_comm import CupyNcclComm

    return CupyNcclComm.from_process_group(process_group)


@dataclass(frozen=True)
class SelectSteps:
    """What ``select_comm`` does at each step; replaced in tests to stage a failure on one rank."""

    readiness: Callable[[], str | None] = _default_readiness
    create: Callable[[Any], ReduceComm] = _create_cupy_comm
    gather: Callable[[Any, str | None], list[str | None]] = gather_reasons
    fallback: Callable[[Any], ReduceComm] = TorchDistComm


def _fall_back(fallback: ReduceComm, what: str, cause: str) -> ReduceComm:
    from deepspeed.utils import logger

    if fallback.rank == 0:
        logger.warning(f"{FALLBACK_PREFIX}: {what}: {cause}")
    return fallback


def select_comm(process_group: Any, steps: SelectSteps | None = None) -> ReduceComm:
    """The reduce communicator for ``process_group``: ``CupyNcclComm`` if every rank can build one, else
    ``TorchDistComm`` on every rank. Collective: every rank of the group must call it."""
    steps = steps or SelectSteps()
    fallback = steps.fallback(process_group)
    cause = combine_reasons(steps.gather(process_group, _guarded(steps.readiness)))
    if cause is not None:
        return _fall_back(fallback, "cupy NCCL cannot be used", cause)
    comm: ReduceComm | None = None
    reason: str | None = None
    try:
        comm = steps.create(process_group)
        if comm is None:
            reason = "no communicator was returned"
    except Exception as error:  # noqa: BLE001 - agreed on below; every rank then falls back together
        reason = f"{type(error).__name__}: {error}"
    cause = combine_reasons(steps.gather(process_group, reason))
    if cause is None and comm is not None:
        return comm
    if comm is not None:
        try:
            comm.close()
        except Exception as error:  # noqa: BLE001 - the fallback must not fail on cleanup
            cause = f"{cause}; closing this rank's communicator also failed: {type(error).__name__}: {error}"
    return _fall_back(fallback, "creating the cupy NCCL communicator failed", str(cause))
