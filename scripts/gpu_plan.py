"""What ``scripts/gpu_check.sh`` will run on this machine, decided before anything runs: the NCCL versions that
torch and cupy load (printed first) and the files they map, the GPUs, and whether ranks can share one GPU
(ws 2 and 4 on one GPU: ``nccl_check``, ``gpu_e2e``, the two-rank CUDA tests).

Why a script of its own: the decision must be the same in the real run and in ``gpu_check.sh --dry-run``
(tested on CPU, where cupy still loads libnccl), and a pure function is testable without a GPU. It runs in a
fresh process after ``nccl_install.py``, so what it prints is what the steps will load.
Needs neither a GPU nor DeepSpeed; anything it cannot read is reported as unknown. Overrides for a dry run:
GPU_CHECK_NCCL_VERSION (e.g. 2.28.9; stands for both torch's and cupy's) and GPU_CHECK_GPUS.

Prints human lines, then one machine line: ``DECISION gpus=N ws2=0|1 have_ds=0|1 have_cupy=0|1`` (ws2: ranks
may share a GPU, for every ws >= 2).
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


def decide_ws2(cupy_nccl: tuple[int, int, int] | None, gpus: int,
               torch_nccl: tuple[int, int, int] | None = None) -> tuple[bool, str]:
    """Whether the ws >= 2 steps run, and why (the sentence the summary prints).

    Ranks sharing one GPU need NCCL >= 2.30 in both communicators that a rank builds: cupy's (the owner path)
    and torch's (DeepSpeed's process group). ``torch_nccl`` None: torch has no NCCL here (a CPU build), which
    the dry run on a CPU machine plans around."""
    if cupy_nccl is None:
        return False, "cupy's NCCL cannot be loaded, so no NCCL check runs at all"
    if gpus < 1:
        return False, "no GPU is visible"
    if gpus >= 2:
        return True, f"{gpus} GPUs: one rank per GPU (NCCL {fmt(cupy_nccl)})"
    if torch_nccl is not None and torch_nccl < MULTI_RANK_MIN:
        return False, (f"one GPU and torch's NCCL {fmt(torch_nccl)} < 2.30 (cupy's {fmt(cupy_nccl)}): ranks cannot "
                       "share a GPU in DeepSpeed's process group (NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)")
    if cupy_nccl >= MULTI_RANK_MIN:
        return True, (f"one GPU shared by 2 or 4 ranks: NCCL {fmt(cupy_nccl)} >= 2.30 with "
                      "NCCL_MULTI_RANK_GPU_ENABLE=1 (correctness; its timings are ranks sharing one GPU, "
                      "not an interconnect)")
    return False, (f"one GPU and NCCL {fmt(cupy_nccl)} < 2.30: ranks cannot share a GPU "
                   "(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL >= 2.30)")


def mapped_nccl(maps: str | None = None) -> list[str]:
    """The libnccl files this process maps (``/proc/self/maps``), each once: after torch and cupy loaded theirs,
    one path means both use the same library."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    paths = {line.split(None, 5)[5].strip() for line in maps.splitlines()
             if len(line.split(None, 5)) == 6 and "libnccl" in line.split(None, 5)[5]}
    return sorted(p.removesuffix(" (deleted)") + (" (deleted: replaced after it was mapped)"
                                                   if p.endswith(" (deleted)") else "") for p in paths)


def _cupy_nccl() -> tuple[int, int, int] | None:
    override = os.environ.get("GPU_CHECK_NCCL_VERSION")
    if override:
        return parse_version(override)
    try:
        from owner_reduce.runtime.nccl_binding import nccl_runtime_version

        return nccl_runtime_version()
    except Exception:  # noqa: BLE001 - no cupy or no libnccl: unknown
        return None


def _torch_facts() -> tuple[str, tuple[int, int, int] | None, str, int]:
    """torch's version, the NCCL it loaded (runtime ``ncclGetVersion``; None without one), that as words, GPUs."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - reported
        return f"unavailable ({type(error).__name__})", None, "unknown", 0
    try:
        version = tuple(int(v) for v in torch.cuda.nccl.version())
        nccl: tuple[int, int, int] | None = (version + (0, 0, 0))[:3]  # type: ignore[assignment]
        words = fmt(nccl)
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        nccl, words = None, "none (no CUDA build)"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__, nccl, words, gpus


def _cuda_extra_line() -> str:
    """Whether the installed cupy fits torch's CUDA, and the extra that would (what install() warns about)."""
    try:
        from owner_reduce.wiring.cuda_extra import describe_environment

        return describe_environment()
    except Exception as error:  # noqa: BLE001 - reported, never fatal
        return f"CUDA extra: unknown ({type(error).__name__}: {error})"


def main() -> int:
    torch_version, torch_nccl, torch_words, gpus = _torch_facts()
    cupy_nccl = _cupy_nccl()
    overridden = bool(os.environ.get("GPU_CHECK_NCCL_VERSION"))
    gpus_note = ""
    if os.environ.get("GPU_CHECK_GPUS"):
        gpus_note = f" (GPU_CHECK_GPUS; torch sees {gpus})"
        gpus = int(os.environ["GPU_CHECK_GPUS"])
    source = " (GPU_CHECK_NCCL_VERSION)" if os.environ.get("GPU_CHECK_NCCL_VERSION") else ""
    print(f"NCCL: {fmt(cupy_nccl)} through cupy{source}; torch {torch_version} loads NCCL {torch_words}",
          flush=True)
    if overridden:
        print("NCCL mapped: not read (GPU_CHECK_NCCL_VERSION stands for what torch and cupy will load)", flush=True)
    else:
        mapped = mapped_nccl()
        print(f"NCCL mapped by this process (torch and cupy loaded): {', '.join(mapped) if mapped else 'none'}"
              + ("  <- MORE THAN ONE libnccl" if len(mapped) > 1 else ""), flush=True)
    ws2, why = decide_ws2(cupy_nccl, gpus, None if overridden else torch_nccl)
    print(f"GPUs: {gpus}{gpus_note}", flush=True)
    print(f"ws>=2 on one GPU: {'will run' if ws2 else 'will be SKIPPED'}: {why}", flush=True)
    print(_cuda_extra_line(), flush=True)
    have_ds = importlib.util.find_spec("deepspeed") is not None
    have_cupy = importlib.util.find_spec("cupy") is not None
    print(f"DECISION gpus={gpus} ws2={int(ws2)} have_ds={int(have_ds)} have_cupy={int(have_cupy)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
