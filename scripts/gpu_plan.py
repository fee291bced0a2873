"""What ``scripts/gpu_check.sh`` will run on this machine, decided before anything runs: the NCCL versions
(printed first), the GPUs, and whether two ranks can share one GPU for ``nccl_check --world-size 2``.

Why a script of its own: the decision must be the same in the real run and in ``gpu_check.sh --dry-run``
(tested on CPU, where cupy still loads libnccl), and a pure function is testable without a GPU.
Needs neither a GPU nor DeepSpeed; anything it cannot read is reported as unknown. Overrides for a dry run:
GPU_CHECK_NCCL_VERSION (e.g. 2.28.9) and GPU_CHECK_GPUS.

Prints human lines, then one machine line: ``DECISION gpus=N ws2=0|1 have_ds=0|1 have_cupy=0|1``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MULTI_RANK_MIN = (2, 30, 0)  # NCCL_MULTI_RANK_GPU_ENABLE: several ranks of one communicator on one GPU


def parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.strip().split(".")]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"GPU_CHECK_NCCL_VERSION must look like 2.28.9, got {text!r}")
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def fmt(version: tuple[int, int, int] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def decide_ws2(cupy_nccl: tuple[int, int, int] | None, gpus: int) -> tuple[bool, str]:
    """Whether ``nccl_check --world-size 2`` runs, and why (the sentence the summary prints)."""
    if cupy_nccl is None:
        return False, "cupy's NCCL cannot be loaded, so no NCCL check runs at all"
    if gpus < 1:
        return False, "no GPU is visible"
    if gpus >= 2:
        return True, f"{gpus} GPUs: one rank per GPU (NCCL {fmt(cupy_nccl)})"
    if cupy_nccl >= MULTI_RANK_MIN:
        return True, (f"one GPU shared by two ranks: NCCL {fmt(cupy_nccl)} >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 "
                      "(correctness; its timings are two ranks on one GPU, not an interconnect)")
    return False, (f"one GPU and NCCL {fmt(cupy_nccl)} < 2.30: two ranks cannot share a GPU "
                   "(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)")


def _cupy_nccl() -> tuple[int, int, int] | None:
    override = os.environ.get("GPU_CHECK_NCCL_VERSION")
    if override:
        return parse_version(override)
    try:
        from owner_reduce.runtime.nccl_comm import nccl_runtime_version

        return nccl_runtime_version()
    except Exception:  # noqa: BLE001 - no cupy or no libnccl: unknown
        return None


def _torch_facts() -> tuple[str, str, int]:
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - reported
        return f"unavailable ({type(error).__name__})", "unknown", 0
    try:
        nccl = fmt(tuple(torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        nccl = "none (no CUDA build)"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__, nccl, gpus


def main() -> int:
    cupy_nccl = _cupy_nccl()
    torch_version, torch_nccl, gpus = _torch_facts()
    gpus_note = ""
    if os.environ.get("GPU_CHECK_GPUS"):
        gpus_note = f" (GPU_CHECK_GPUS; torch sees {gpus})"
        gpus = int(os.environ["GPU_CHECK_GPUS"])
    source = " (GPU_CHECK_NCCL_VERSION)" if os.environ.get("GPU_CHECK_NCCL_VERSION") else ""
    print(f"NCCL: {fmt(cupy_nccl)} through cupy{source}; torch {torch_version} built with NCCL {torch_nccl}",
          flush=True)
    ws2, why = decide_ws2(cupy_nccl, gpus)
    print(f"GPUs: {gpus}{gpus_note}", flush=True)
    print(f"nccl_check ws=2: {'will run' if ws2 else 'will be SKIPPED'}: {why}", flush=True)
    have_ds = importlib.util.find_spec("deepspeed") is not None
    have_cupy = importlib.util.find_spec("cupy") is not None
    print(f"DECISION gpus={gpus} ws2={int(ws2)} have_ds={int(have_ds)} have_cupy={int(have_cupy)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
