#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint, run the whole suite (CPU; CUDA tests skip), and list the
# 25 slowest tests at the end so that CI shows where the time goes (an explicit --durations=N overrides it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
"$OWNER_REDUCE_PY" -m ruff check owner_reduce tests scripts
exec "$OWNER_REDUCE_PY" -m pytest --durations=25 "$@"
