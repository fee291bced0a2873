"""What this rank knows about where it runs, for the flush cost model: ranks per node, the GPU generation and its
NVLinks.

Why each rank reports and all agree: the per-flush algorithm must be the same on every rank (NCCL needs the same
calls everywhere), so the model's topology is derived from every rank's facts, gathered once at init with the
runtime's agreement check (``flush_choice.agreed_topology``), never from one rank's environment alone.
"""

from __future__ import annotations

import hashlib
import os
import socket

import torch

RANKS_PER_NODE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")  # torchrun, DeepSpeed, Open MPI


def ranks_per_node(environ: dict[str, str] | None = None) -> int:
    """Ranks on this node as the launcher says (torchrun, DeepSpeed's launcher, mpirun), else the GPUs this process
    sees, else 0 (unknown)."""
    env = os.environ if environ is None else environ
    for name in RANKS_PER_NODE_VARS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    """This rank's index on its node as the launcher set it (``LOCAL_RANK``; Open MPI's), or -1 (unknown)."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return -1


def host_digest() -> int:
    """A 60-bit digest of this host's name: ranks on one node report the same (the two-level rank order check)."""
    return int(hashlib.sha256(socket.gethostname().encode()).hexdigest()[:15], 16)
