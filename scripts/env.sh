#!/usr/bin/env bash
# Sourced by the README commands: create or reuse .venv in the repo and install owner_reduce into it.
# Re-installs only when pyproject.toml (or OWNER_REDUCE_CUDA_EXTRA) changed: a stamp in the venv records them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
stamp="$VENV/.owner_reduce-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)${OWNER_REDUCE_CUDA_EXTRA:+ extra=$OWNER_REDUCE_CUDA_EXTRA}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import owner_reduce" 2>/dev/null; then
  echo "[owner_reduce] installing into $VENV ..." >&2
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # Pin torch first: a bare range can pull a multi-GB CUDA build where a CPU build would do.
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  # cupy and NCCL by torch's CUDA major (scripts/cuda_extra.sh): a CPU torch gets cu12, a +cu130 one cu13.
  source "$ROOT/scripts/cuda_extra.sh"
  owner_reduce_extra="$(cuda_extra_for "$PY")"
  "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[test,demo${owner_reduce_extra:+,$owner_reduce_extra}]"
  echo "$want" > "$stamp"
fi
export OWNER_REDUCE_PY="$PY"
# DeepSpeed JIT-builds its CPU communication extension under a file lock; a lock left by a build killed in another
# venv's folder would stall every later run, so each venv keeps its own (unless the caller chose one).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
