#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint, run the whole suite (CPU; CUDA tests skip).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
"$OWNER_REDUCE_PY" -m ruff check owner_reduce tests scripts
exec "$OWNER_REDUCE_PY" -m pytest "$@"
