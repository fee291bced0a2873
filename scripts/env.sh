#!/usr/bin/env bash
# Sourced by the README commands: create or reuse .venv in the repo and install owner_reduce into it.
# Re-installs only when pyproject.toml changed (a stamp in the venv records its hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
stamp="$VENV/.owner_reduce-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import owner_reduce" 2>/dev/null; then
  echo "[owner_reduce] installing into $VENV ..." >&2
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # Pin torch first: a bare range can pull a multi-GB CUDA build where a CPU build would do.
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[test,demo]"
  echo "$want" > "$stamp"
fi
export OWNER_REDUCE_PY="$PY"
# DeepSpeed JIT-builds its CPU communication extension under a file lock; a lock left by a build killed in another
# venv's folder would stall every later run, so each venv keeps its own (unless the caller chose one).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
