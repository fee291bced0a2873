#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint, run the whole suite (CPU; CUDA tests skip), and list the
# 25 slowest tests at the end so that CI shows where the time goes (an explicit --durations=N overrides it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
"$OWNER_REDUCE_PY" -m ruff check owner_reduce tests scripts
# Two pytest workers, one test file each at a time (--dist loadfile: a file's module fixtures and its launches stay
# on one worker). A serial run leaves the CPU idle 44% of the time on CI's 2 cores (vmstat over a fresh clone's run:
# ranks waiting on each other, bounded waits); `-n 0` after this command's arguments runs it serially.
exec "$OWNER_REDUCE_PY" -m pytest -n 2 --dist loadfile --durations=25 "$@"
