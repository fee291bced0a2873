"""Rank 0's settings line at init: the settings in effect, then what the run runs on, read from the communicator,
torch and the files this rank read (``planning.settings.settings_line`` writes the text).

Why a module of its own: the line's facts come from places the handle otherwise never reads (cupy's NCCL and torch's
versions, the process group's backend), and a mismatch between the two NCCLs is a warning before it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..planning.nodes import NodeLayout
from ..planning.rank_inputs import RankInputs
from ..planning.settings import OwnerReduceSettings, RunSetup, nccl_mismatch, settings_line, transport_text
from ..planning.wording import count_noun
from .comm import ReduceComm
from .deadline import Deadline


def settings_line_of(comm: ReduceComm, settings: OwnerReduceSettings, inputs: RankInputs, layout: NodeLayout | None,
                     deadline: Deadline, bucket_size: int, process_group: Any) -> str:
    """The settings line of what this runtime runs with (``settings``, the files read: ``inputs``, the flushes'
    ``deadline``) and on (the transport, the nodes: ``layout``, the bucket, the package); where cupy's NCCL and
    torch's differ in major.minor, a warning before it (``planning.settings.nccl_mismatch``)."""
    from ..version import __version__

    cupy_nccl = torch_nccl = None
    backend = None
    if comm.name == "cupy-nccl":
        from .nccl_binding import nccl_version

        cupy_nccl = nccl_version()
    elif comm.name == "torch.distributed":
        backend = backend_of(process_group)
    if torch.cuda.is_available():
        try:
            torch_nccl = tuple(torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):  # a torch built without NCCL
            torch_nccl = None
    mismatch = nccl_mismatch(cupy_nccl, torch_nccl)
    if mismatch is not None:
        from deepspeed.utils import logger

        logger.warning(mismatch)
    setup = RunSetup(transport=transport_text(comm.name, backend, cupy_nccl, torch_nccl),
                     world_size=comm.world_size,
                     nodes=layout.describe() if layout is not None else "nodes unknown",
                     bucket_elems=bucket_size, version=__version__)
    if inputs.verdicts_path is None:
        verdicts = "none"
    elif inputs.verdicts is not None:
        verdicts = f"replay {inputs.verdicts.digest()} ({count_noun(len(inputs.verdicts.schedules), 'schedule')})"
    else:
        verdicts = f"write {inputs.verdicts_path}"
    return settings_line(settings,
                         calibration_digest=inputs.calibration.digest() if inputs.calibration is not None else None,
                         verdicts=verdicts, timeout_s=deadline.seconds, timeout_source=deadline.short_source,
                         setup=setup)


def backend_of(process_group: Any) -> str | None:
    """The backend of the data-parallel group (``gloo``, ``nccl``), or None where torch.distributed has none."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return str(dist.get_backend(process_group))
    except (RuntimeError, ValueError):
        return None
