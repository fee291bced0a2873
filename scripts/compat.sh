#!/usr/bin/env bash
# The compatibility check of one torch release, in a venv of its own:
#   bash scripts/compat.sh TORCH_VERSION [pytest args]      e.g.  bash scripts/compat.sh 2.14.1
# 1. .venv-compat-<torch>[-ds<deepspeed>][-<extra>] in the repo (made once, reused; `rm -r` it to start afresh);
# 2. torch==TORCH_VERSION first, then `pip install -e .[test,<extra>]`, the extra for that torch's CUDA major
#    (scripts/cuda_extra.sh: a CPU torch gets cu12, a +cu130 one cu13), and a check that pip kept that torch;
# 3. pytest with the arguments given (default: the whole suite, -q -p no:cacheprovider), its own
#    TORCH_EXTENSIONS_DIR (DeepSpeed JIT-builds a CPU extension under a file lock: never shared between venvs);
# 4. one line, printed and appended to out/compat/summary.txt (the log beside it, out/compat/<venv>.log):
#    compat: torch 2.14.1+cu130 | deepspeed 0.19.8 | extra cu13 (cupy-cuda13x 14.2.0) | python 3.11.2 | 620 passed, ...
# Environment: COMPAT_DEEPSPEED=0.18.9 writes that DeepSpeed over the project's pin after the install (--no-deps), to
# show what a release the project does not support does; OWNER_REDUCE_CUDA_EXTRA=cu12|cu13|none overrides the extra.
# This machine caps torch through a pip constraint file (/etc/xdg/pip/pip.conf); this script's own pip calls use an
# empty constraint file instead (PIP_CONSTRAINT), so that 2.15.0 can be installed here. Exit code: pytest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: bash scripts/compat.sh TORCH_VERSION [pytest args]   (TORCH_VERSION like 2.14.1, got '${1:-}')" >&2
  exit 2
fi
TORCH_VERSION=$1
shift
PYTEST_ARGS=("$@")
[ ${#PYTEST_ARGS[@]} -gt 0 ] || PYTEST_ARGS=(-q -p no:cacheprovider)
DEEPSPEED=${COMPAT_DEEPSPEED:-}
source scripts/cuda_extra.sh

NAME=".venv-compat-$TORCH_VERSION${DEEPSPEED:+-ds$DEEPSPEED}${OWNER_REDUCE_CUDA_EXTRA:+-$OWNER_REDUCE_CUDA_EXTRA}"
VENV="$ROOT/$NAME"
PY="$VENV/bin/python"
OUTDIR="$ROOT/out/compat"
LOG="$OUTDIR/$NAME.log"
mkdir -p "$OUTDIR"
EMPTY_CONSTRAINTS="$OUTDIR/empty-constraints.txt"
: > "$EMPTY_CONSTRAINTS"
export PIP_CONSTRAINT="$EMPTY_CONSTRAINTS" PIP_DISABLE_PIP_VERSION_CHECK=1
pip_q() { "$PY" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; } >&2; }

install_start=$(date +%s)
[ -x "$PY" ] || python3 -m venv "$VENV"
stamp="$VENV/.compat-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch=$TORCH_VERSION ds=$DEEPSPEED extra=${OWNER_REDUCE_CUDA_EXTRA:-}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[compat] installing torch==$TORCH_VERSION and owner_reduce into $NAME ..." >&2
  pip_q --upgrade pip
  pip_q "torch==$TORCH_VERSION"
  EXTRA="$(cuda_extra_for "$PY")"
  pip_q -e "$ROOT[test${EXTRA:+,$EXTRA}]"
  [ -z "$DEEPSPEED" ] || pip_q --no-deps "deepspeed==$DEEPSPEED"
  echo "$want" > "$stamp"
fi
EXTRA="$(cuda_extra_for "$PY")"
install_s=$(( $(date +%s) - install_start ))

# What is installed, as pip sees it (a torch that pip replaced fails here, naming both).
read -r TORCH_HAVE DS_HAVE CUPY_HAVE PY_HAVE < <("$PY" - <<'EOF'
import importlib.metadata as md
import platform

import torch

cupy = sorted(f"{d.metadata['Name']}-{d.version}" for d in md.distributions()
              if (d.metadata["Name"] or "").lower().replace("_", "-").startswith("cupy"))
print(torch.__version__, md.version("deepspeed"), ",".join(cupy) or "none", platform.python_version())
EOF
)
if [ "${TORCH_HAVE%%+*}" != "$TORCH_VERSION" ]; then
  echo "[compat] $NAME: asked for torch $TORCH_VERSION, pip left torch $TORCH_HAVE" >&2
  exit 1
fi

COMMAND="${COMPAT_DEEPSPEED:+COMPAT_DEEPSPEED=$COMPAT_DEEPSPEED }${OWNER_REDUCE_CUDA_EXTRA:+OWNER_REDUCE_CUDA_EXTRA=$OWNER_REDUCE_CUDA_EXTRA }bash scripts/compat.sh $TORCH_VERSION${1:+ $*}"
echo "[compat] $COMMAND: pytest ${PYTEST_ARGS[*]} (log: ${LOG#"$ROOT"/})" >&2
test_start=$(date +%s)
set +e
TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" "$PY" -m pytest "${PYTEST_ARGS[@]}" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
test_s=$(( $(date +%s) - test_start ))

# pytest's last summary line, as counts: "620 passed, 14 skipped in 700.1s" -> passed 620, failed 0, ...
last=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected)" "$LOG" | tail -1) || true
count() { local n; n=$(echo "$last" | grep -oE "[0-9]+ $1" | head -1 | cut -d' ' -f1) || true; echo "${n:-0}"; }
COUNTS="$(count passed) passed, $(count failed) failed, $(count skipped) skipped"
for extra_count in "errors?" deselected; do
  [ "$(count "$extra_count")" = 0 ] || COUNTS="$COUNTS, $(count "$extra_count") ${extra_count%\?}"
done
LINE="compat: torch $TORCH_HAVE | deepspeed $DS_HAVE | extra ${EXTRA:-none} ($CUPY_HAVE) | python $PY_HAVE | $COUNTS (rc $rc) | pytest ${test_s} s, install ${install_s} s | $COMMAND"
echo "$LINE"
echo "$(date -u +%FT%TZ) $LINE" >> "$OUTDIR/summary.txt"
exit "$rc"
