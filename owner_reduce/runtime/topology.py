"""What this rank knows about where it runs, for the flush cost model and the stall report: its host, what the
launcher's and SLURM's variables say about its node, its local rank, the GPU generation and its NVLinks.

Why each rank reports and all agree: the per-flush algorithm must be the same on every rank (NCCL needs the same
calls everywhere), so the model's topology is derived from every rank's facts, gathered once at init with the
runtime's agreement check (``planning.nodes.node_layout``, ``flush_choice.agreed_topology``), never from one rank's
environment alone.
"""

from __future__ import annotations

import hashlib
import os
import socket

import torch

from ..planning.nodes import LAUNCHER_VARS, SLURM_NODE_ID_VAR, SLURM_VARS, slurm_tasks_on_node


def host_name() -> str:
    """This host's name (``socket.gethostname()``): ranks that report the same one share a node."""
    return socket.gethostname()


def launcher_ranks_per_node(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(index in ``planning.nodes.LAUNCHER_VARS``, value): the ranks on this node as the launcher says (torchrun,
    DeepSpeed's launcher, mpirun), the first variable set; (-1, 0) where none is."""
    env = os.environ if environ is None else environ
    for i, name in enumerate(LAUNCHER_VARS):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return i, int(value)
    return -1, 0


def slurm_ranks_on_node(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(index in ``planning.nodes.SLURM_VARS``, tasks on this node) as SLURM's tasks-per-node list says at this rank's
    ``SLURM_NODEID``; (-1, 0) outside SLURM or where the list cannot be read."""
    env = os.environ if environ is None else environ
    node = env.get(SLURM_NODE_ID_VAR, "").strip()
    if not node.isdigit():
        return -1, 0
    for i, name in enumerate(SLURM_VARS):
        spec = env.get(name, "").strip()
        if spec:
            tasks = slurm_tasks_on_node(spec, int(node))
            return (i, tasks) if tasks > 0 else (-1, 0)
    return -1, 0


def sm_major(device: torch.device | None = None) -> int:
    """The compute capability's major version of this rank's GPU (8: Ampere, 9: Hopper), 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_capability(device)[0])


# GPUs whose NVLinks were cut from their generation's (export variants; NVSwitch nodes): name part -> NVLinks per GPU.
# Every other GPU is modelled with its generation's (``collective_time.NVLINKS``: H100/H200/H20 18, A100 12).
CUT_NVLINKS = {"A800": 8, "H800": 8}


def nvlinks(device: torch.device | None = None) -> int:
    """NVLinks per GPU of this rank's GPU where its name says they differ from its generation's (A800, H800: 8), else
    0 (the generation's). Why from the name: NCCL reads the links through NVML, which neither torch nor cupy wraps;
    the export variants are the GPUs whose count differs within a generation."""
    if not torch.cuda.is_available():
        return 0
    return nvlinks_of_name(torch.cuda.get_device_name(device))


def nvlinks_of_name(name: str) -> int:
    """``nvlinks`` for a device name such as ``NVIDIA A800-SXM4-80GB`` (0: the generation's)."""
    upper = name.upper()
    return next((links for part, links in CUT_NVLINKS.items() if part in upper), 0)


def local_rank(environ: dict[str, str] | None = None) -> int:
    """This rank's index on its node as the launcher set it (``LOCAL_RANK``; Open MPI's; SLURM's under a bare
    ``srun``), or -1 (unknown)."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return -1


def host_digest(name: str) -> int:
    """A 60-bit digest of a host's name: ranks on one node report the same (the two-level rank order check; the full
    name, where the agreement carries its first ``HOST_NAME_BYTES`` only)."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)
