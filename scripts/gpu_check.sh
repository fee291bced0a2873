#!/usr/bin/env bash
# The GPU check in one script, sized for one H200 and a 15-minute device lease: at most GPU_CHECK_BUDGET_S (default
# 450 s, under 8 minutes) from a bare machine, every step with its own timeout, cheap steps first; rerunnable (it
# overwrites its outputs). In order:
#   1. the NCCL versions (cupy's libnccl and torch's) and what they allow: scripts/gpu_plan.py, printed first;
#   2. environment: the machine's python3 if its torch sees a GPU (offline GPU images), plus the wheels carried in
#      .whl/, installed into /tmp/owner_reduce_site; otherwise scripts/env.sh (.venv from PyPI);
#   3. scripts/nccl_check.py at ws=1: correctness only (at ws=1 NCCL moves nothing between GPUs: its timings are
#      labelled as no communication measurement);
#   4. scripts/nccl_check.py at ws=2 on one GPU, only where cupy's NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1);
#      otherwise the summary says why it was skipped;
#   5. pytest -m cuda;
#   6. plain ZeRO-1 vs DeepCompile + owner_reduce at ws=1 on the GPU, bitwise (scripts/gpu_e2e.py
#      --require-bitwise), with host µs per reduce_grad and the peak GPU memory of both;
#   7. native DeepCompile (its C++/CUDA extension must build here): last and optional, never fails the check.
# Writes ${OUT:-out}/gpu_summary.txt (every number, and what was and was not measured) and ${OUT:-out}/gpu_check.log.
# Exit code: 0 when every required step that ran passed, 1 otherwise.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with PyPI: fill .whl/ with what the offline GPU image lacks
#   bash scripts/gpu_check.sh --dry-run        # anywhere, no GPU needed: print the plan and the NCCL decision
#   bash scripts/gpu_check.sh                  # on the GPU machine (carry .whl there)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
MODE=run
case "${1:-}" in
  --fetch-wheels) MODE=fetch;;
  --dry-run) MODE=dry;;
  "") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--fetch-wheels | --dry-run]" >&2; exit 2;;
esac

if [ "$MODE" = fetch ]; then
  # DeepSpeed and the few of its needs that the GPU image lacks, for CPython 3.12 on x86-64 (the image's python3).
  # Needs PyPI and an interpreter with torch (DeepSpeed's setup.py imports it): .venv's, or OWNER_REDUCE_PY.
  set -e
  mkdir -p .whl
  FETCH_PY="${OWNER_REDUCE_PY:-$ROOT/.venv/bin/python}"
  [ -x "$FETCH_PY" ] || FETCH_PY=python3
  PIP="$FETCH_PY -m pip"
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions py-cpuinfo
  # DeepSpeed ships an sdist only: build its (pure Python, no prebuilt ops) wheel here.
  DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
  ls -la .whl
  du -sh .whl
  exit 0
fi

BUDGET_S=${GPU_CHECK_BUDGET_S:-450}  # counted from here: the NCCL print and the environment are inside it
START=$(date +%s)
# name:limit_s:required. The limits add up to more than the budget: a step never starts past it (see step()).
PLAN=(
  "nccl_ws1:120:required"
  "nccl_ws2:150:required"
  "pytest_cuda:180:required"
  "e2e_ws1:220:required"
  "native:150:optional"
)
limit_of() { local s; for s in "${PLAN[@]}"; do [ "${s%%:*}" = "$1" ] && { s=${s#*:}; echo "${s%%:*}"; }; done; }

# ---- 1. the NCCL versions, first ----------------------------------------------------------------------------------
PLAN_PY="${OWNER_REDUCE_PY:-python3}"
if [ "$MODE" = dry ]; then
  export GPU_CHECK_GPUS="${GPU_CHECK_GPUS:-$(timeout 60 "$PLAN_PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
  [ "$GPU_CHECK_GPUS" = 0 ] && GPU_CHECK_GPUS=1  # no GPU here: decide for the lent machine, one GPU
fi
DECISION_TEXT=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout 90 "$PLAN_PY" scripts/gpu_plan.py 2>&1)
echo "$DECISION_TEXT" | grep -v '^DECISION'
read -r GPUS WS2 HAVE_DS HAVE_CUPY < <(echo "$DECISION_TEXT" | sed -n 's/^DECISION gpus=\([0-9]*\) ws2=\([01]\) have_ds=\([01]\) have_cupy=\([01]\).*/\1 \2 \3 \4/p')
GPUS=${GPUS:-0}; WS2=${WS2:-0}; HAVE_DS=${HAVE_DS:-0}; HAVE_CUPY=${HAVE_CUPY:-0}

if [ "$MODE" = dry ]; then
  echo "gpu_check --dry-run: nothing runs; on a machine with ${GPUS} GPU(s) the plan is (budget ${BUDGET_S}s, each"
  echo "step no later than the budget, a step with under 20s left is skipped):"
  echo "  env         python3 + the wheels carried in .whl/ if its torch sees a GPU, else scripts/env.sh"
  if compgen -G ".whl/*.whl" > /dev/null; then echo "              .whl/: $(cd .whl && ls -- *.whl | tr '\n' ' ')"
  else echo "              .whl/ is empty: prepare it with 'bash scripts/gpu_check.sh --fetch-wheels'"; fi
  echo "  nccl_ws1    timeout $(limit_of nccl_ws1)s: scripts/nccl_check.py --world-size 1: correctness only; its timing is no communication measurement"
  if [ "$WS2" = 1 ]; then
    echo "  nccl_ws2    timeout $(limit_of nccl_ws2)s: NCCL_MULTI_RANK_GPU_ENABLE=1 scripts/nccl_check.py --world-size 2"
  else
    echo "  nccl_ws2    SKIPPED (see 'nccl_check ws=2' above)"
  fi
  echo "  pytest_cuda timeout $(limit_of pytest_cuda)s: python -m pytest -m cuda tests"
  echo "  e2e_ws1     timeout $(limit_of e2e_ws1)s: scripts/gpu_e2e.py --world-size 1 --modes plain,owner --require-bitwise (host us per reduce_grad, peak GPU memory)"
  echo "  native      timeout $(limit_of native)s, optional, last: scripts/gpu_e2e.py --world-size 1 --modes plain,native"
  echo "  summary     \${OUT:-out}/gpu_summary.txt: what was measured and what was not"
  exit 0
fi

OUTDIR="${OUT:-out}"
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/gpu_summary.txt"
LOG="$OUTDIR/gpu_check.log"
STEPS_DIR=$(mktemp -d)  # each step's own output; not under $OUTDIR, where only a few files come back
trap 'rm -rf "$STEPS_DIR"' EXIT
: > "$SUMMARY"
: > "$LOG"
FAILED=0
declare -A RAN=()
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
echo "$DECISION_TEXT" | grep -v '^DECISION' >> "$SUMMARY"
note "gpu_check: $(date -u +%FT%TZ) on $(hostname); budget ${BUDGET_S}s"

# step NAME CMD...: run with the plan's timeout, never past the budget; append its RESULT lines to the summary.
step() {
  local name=$1 limit required rc t0 secs remaining
  shift
  limit=$(limit_of "$name")
  required=$(for s in "${PLAN[@]}"; do [ "${s%%:*}" = "$name" ] && echo "${s##*:}"; done)
  remaining=$(left)
  if [ "$remaining" -lt 20 ]; then
    note "step $name: SKIPPED (only ${remaining}s of the ${BUDGET_S}s budget left)"
    RAN[$name]=skipped
    return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  t0=$(date +%s)
  echo "===== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" > "$STEPS_DIR/$name.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  cat "$STEPS_DIR/$name.txt" >> "$LOG"
  grep -E '^(RESULT|nccl_check:|gpu_e2e:|  (float32|bfloat16|float16|owner runtime):|  \[dc-probe\]|    |[0-9]+ (passed|failed|skipped|error))' "$STEPS_DIR/$name.txt" \
    | grep -v '^    File' | head -60 >> "$SUMMARY"
  case $rc in
    0) note "step $name: ok (${secs}s)"; RAN[$name]=ok;;
    124|137) note "step $name: TIMED OUT after ${limit}s"; RAN[$name]=failed;;
    *) note "step $name: FAILED rc=$rc (${secs}s); tail:"; tail -15 "$STEPS_DIR/$name.txt" | tee -a "$SUMMARY"
       RAN[$name]=failed;;
  esac
  if [ "$rc" != 0 ]; then
    if [ "$required" = optional ]; then note "step $name: optional, not counted"; else FAILED=1; fi
  fi
  return 0
}

# ---- 2. environment ------------------------------------------------------------------------------------------------
if timeout 60 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
  SITE=/tmp/owner_reduce_site
  if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl >> "$LOG" 2>&1 || note "environment: installing the carried wheels FAILED"
    note "environment: installed from .whl/: $(cd .whl && ls -- *.whl | tr '\n' ' ')"
  else
    note "environment: no .whl/ carried (bash scripts/gpu_check.sh --fetch-wheels prepares it)"
  fi
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  note "environment: the machine's python3 ($(command -v python3)) + $SITE + this checkout"
else
  if timeout 300 bash -c 'source scripts/env.sh' >> "$LOG" 2>&1; then
    source scripts/env.sh
    set +e  # env.sh turns on errexit; a failing step must not end this script
    PY="$OWNER_REDUCE_PY"
    note "environment: $PY (scripts/env.sh)"
  else
    note "environment: scripts/env.sh FAILED (see gpu_check.log)"
    exit 1
  fi
fi
# What this interpreter can do, now that its packages are in place (the NCCL decision above stays).
read -r GPUS _ HAVE_DS HAVE_CUPY < <(PYTHONPATH="$PYTHONPATH" timeout 90 "$PY" scripts/gpu_plan.py 2>/dev/null \
  | sed -n 's/^DECISION gpus=\([0-9]*\) ws2=\([01]\) have_ds=\([01]\) have_cupy=\([01]\).*/\1 \2 \3 \4/p')
GPUS=${GPUS:-0}; HAVE_DS=${HAVE_DS:-0}; HAVE_CUPY=${HAVE_CUPY:-0}
timeout 30 nvidia-smi 2>&1 | tee -a "$LOG" | head -15
note "gpu: $(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4)"
note "importable: deepspeed=$HAVE_DS cupy=$HAVE_CUPY; GPUs visible to torch: $GPUS"
if [ "$GPUS" -lt 1 ]; then
  note "gpu_check: torch sees no GPU: nothing to check"
  exit 1
fi

# ---- 3./4. standalone NCCL check -------------------------------------------------------------------------------
step nccl_ws1 "$PY" scripts/nccl_check.py --world-size 1 --iters 10 --timeout 100 --json "$OUTDIR/nccl_ws1.json"
if [ "$WS2" = 1 ]; then
  step nccl_ws2 env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" scripts/nccl_check.py --world-size 2 --iters 20 --timeout 130 \
    --json "$OUTDIR/nccl_ws2.json"
else
  note "step nccl_ws2: SKIPPED: $(echo "$DECISION_TEXT" | sed -n 's/^nccl_check ws=2: will be SKIPPED: //p')"
  RAN[nccl_ws2]=skipped
fi

# ---- 5. CUDA tests -------------------------------------------------------------------------------------------------
if [ "$HAVE_DS" = 1 ]; then
  step pytest_cuda "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
else
  note "step pytest_cuda: SKIPPED (deepspeed is not importable: carry .whl, see --fetch-wheels)"; RAN[pytest_cuda]=skipped
  FAILED=1
fi

# ---- 6. plain ZeRO-1 vs owner path at ws=1, bitwise ----------------------------------------------------------------
if [ "$HAVE_DS" = 1 ]; then
  # gpu_e2e gets 20s less than the step, so it writes its results before the step's timeout would hit.
  step e2e_ws1 "$PY" scripts/gpu_e2e.py --world-size 1 --steps 6 --modes plain,owner --require-bitwise \
    --timeout 150 --total-timeout 200 --json "$OUTDIR/e2e_ws1.json"
else
  note "step e2e_ws1: SKIPPED (deepspeed is not importable)"; RAN[e2e_ws1]=skipped
  FAILED=1
fi

# ---- 7. native DeepCompile: last, optional ----------------------------------------------------------------------------
if [ "$HAVE_DS" = 1 ] && [ "$(left)" -ge 120 ]; then
  step native "$PY" scripts/gpu_e2e.py --world-size 1 --steps 6 --modes plain,native --timeout 120 \
    --total-timeout $(( $(limit_of native) - 20 )) --json "$OUTDIR/e2e_native.json"
else
  note "step native: SKIPPED (optional; needs deepspeed and 120s of budget, $(left)s left)"; RAN[native]=skipped
fi

# ---- what was and was not measured ------------------------------------------------------------------------------------
note ""
note "MEASURED here (one GPU):"
[ "${RAN[nccl_ws1]:-}" = ok ] && note "  - cupy NCCL flush correctness at ws=1 (owner plan == AllReduce bitwise; fp64 reference)"
[ "${RAN[nccl_ws2]:-}" = ok ] && note "  - cupy NCCL flush correctness at ws=2, two ranks sharing one GPU"
PYTEST_LINE=$(grep -E '^[0-9]+ (passed|failed|skipped|error)' "$STEPS_DIR/pytest_cuda.txt" 2>/dev/null | tail -1)
if [ "${RAN[pytest_cuda]:-}" = ok ] && [[ "$PYTEST_LINE" == *passed* ]]; then
  note "  - the CUDA tests (pytest -m cuda: $PYTEST_LINE)"
elif [ "${RAN[pytest_cuda]:-}" = ok ]; then
  RAN[pytest_cuda]="ran no test ($PYTEST_LINE)"
fi
[ "${RAN[e2e_ws1]:-}" = ok ] && note "  - DeepCompile + owner_reduce vs plain ZeRO-1 at ws=1: bitwise; host us per reduce_grad; peak GPU memory"
[ "${RAN[native]:-}" = ok ] && note "  - native DeepCompile at ws=1 vs plain ZeRO-1"
note "NOT MEASURED:"
note "  - any communication time or owner-path speed-up: ws=1 moves no bytes between GPUs; the ws=1 flush timings"
note "    are labelled 'no communication measurement' and are not a result"
if [ "${RAN[nccl_ws2]:-}" = ok ]; then
  note "  - ws=2 timings: two ranks share one GPU's memory bandwidth; not an interconnect (NVLink/IB) measurement"
else
  note "  - ws=2 (skipped or failed: see above)"
fi
note "  - multi-GPU or multi-node runs, stalled/killed peers on real NCCL (the CPU tests cover the bounded waits)"
for s in "${PLAN[@]}"; do n=${s%%:*}; [ "${RAN[$n]:-}" = ok ] || note "  - step $n: ${RAN[$n]:-not run}"; done
note "gpu_check: $([ "$FAILED" = 0 ] && echo 'every required step that ran passed' || echo 'SOME REQUIRED STEP FAILED OR WAS SKIPPED') in $(( $(date +%s) - START ))s"
exit "$FAILED"
