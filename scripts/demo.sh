#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then run the CPU demo on 4 gloo ranks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
exec "$OWNER_REDUCE_PY" scripts/demo.py "$@"
