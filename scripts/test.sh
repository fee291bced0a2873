#!/usr/bin/env bash
# The README's test command: set up .venv if needed, lint, run the whole suite (CPU; CUDA tests skip), and list the
# 25 slowest tests at the end so that CI shows where the time goes (an explicit --durations=N overrides it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
"$OWNER_REDUCE_PY" -m ruff check owner_reduce harness research tests scripts
# Two pytest workers, one test file each at a time (--dist loadfile: a file's module fixtures and its launches stay
# on one worker). Run serially, the suite left CI's 2 cores idle 44% of the time (ranks waiting on each other, bounded
# waits): a fresh clone's pytest took 737 s serially and 529 s with two workers (vmstat idle 12%), 2026-12-05.
# `-n 0` among this command's arguments runs it serially.
exec "$OWNER_REDUCE_PY" -m pytest -n 2 --dist loadfile --durations=25 "$@"
