#!/usr/bin/env bash
# Sourced by env.sh, compat.sh and gpu_check.sh: which CUDA extra of owner_reduce (pyproject.toml: cu12, cu13) fits
# the torch an interpreter has.
#   cuda_extra_for PYTHON   prints cu12, cu13, or nothing (no extra fits: the owner path then uses torch.distributed)
# A CUDA build's major picks its extra (torch.version.cuda "13.0" -> cu13). A CPU build gets cu12 for the tests'
# sake: cupy-cuda12x imports without a GPU or CUDA driver, so the suite covers cupy's NCCL binding (dtype tables,
# the unique-id exchange, libnccl's version); the runtime itself never takes the cupy path on a CPU accelerator.
# OWNER_REDUCE_CUDA_EXTRA=cu12|cu13|none overrides the choice.
cuda_extra_for() {
  local major
  case "${OWNER_REDUCE_CUDA_EXTRA:-}" in
    cu12|cu13) echo "$OWNER_REDUCE_CUDA_EXTRA"; return 0;;
    none) return 0;;
    "") ;;
    *) echo "OWNER_REDUCE_CUDA_EXTRA must be cu12, cu13 or none, got '$OWNER_REDUCE_CUDA_EXTRA'" >&2; return 2;;
  esac
  major=$("$1" -c "import torch; print((torch.version.cuda or 'cpu').split('.')[0])") || return 1
  case "$major" in
    cpu|12) echo cu12;;
    13) echo cu13;;
    *) echo "[owner_reduce] torch is a CUDA $major build: no extra brings cupy for it (cu12, cu13); the owner path" \
         "will reduce through torch.distributed (pip install cupy-cuda${major}x for cupy NCCL)" >&2;;
  esac
}
