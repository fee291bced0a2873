#!/usr/bin/env bash
# The GPU check in one script: under 8 minutes on one H200 from a bare machine, every step with its own timeout.
#   1. environment: the machine's python3 if its torch sees a GPU (offline GPU images), with the wheels carried
#      in .whl/ (see --fetch-wheels) installed into /tmp/owner_reduce_site; otherwise scripts/env.sh (.venv from
#      PyPI, where the machine reaches it);
#   2. nvidia-smi and versions (torch, its CUDA and NCCL, cupy and the NCCL it loads, deepspeed);
#   3. scripts/nccl_check.py at ws=1, and ws=2 on one GPU where NCCL >= 2.30 allows it;
#   4. pytest -m cuda;
#   5. DeepCompile ZeRO-1 end to end (scripts/gpu_e2e.py): owner path vs plain ZeRO-1 vs native DeepCompile,
#      at ws=2 where both torch's and cupy's NCCL allow two ranks on one GPU, else ws=1.
# Writes ${OUT:-out}/gpu_summary.txt (every number) and ${OUT:-out}/gpu_check.log (everything).
# Exit code: 0 when every step that ran passed (skips are listed in the summary), 1 otherwise.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with PyPI: fill .whl/ with what the offline GPU image lacks
#   bash scripts/gpu_check.sh                  # on the GPU machine (carry .whl there)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

if [ "${1:-}" = "--fetch-wheels" ]; then
  # DeepSpeed and the few of its needs that the GPU image lacks, for CPython 3.12 on x86-64 (the image's python3).
  set -e
  mkdir -p .whl .git/info
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  PIP="${OWNER_REDUCE_PY:-python3} -m pip"
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions
  # DeepSpeed ships an sdist only: build its (pure Python, no prebuilt ops) wheel here.
  DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
  ls -la .whl
  exit 0
fi

OUTDIR="${OUT:-out}"
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/gpu_summary.txt"
LOG="$OUTDIR/gpu_check.log"
STEPS_DIR=$(mktemp -d)  # each step's own output; not under $OUTDIR, where only a few files come back
: > "$SUMMARY"
: > "$LOG"
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-460}  # the whole script, leaving margin under 8 minutes
FAILED=0
export PYTHONUNBUFFERED=1

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD...: run with a timeout no later than the budget; append RESULT lines to the summary.
step() {
  local name=$1 limit=$2 rc t0 secs
  shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 20 ]; then
    note "step $name: SKIPPED (only ${remaining}s of the ${BUDGET_S}s budget left)"
    return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  t0=$(date +%s)
  echo "===== $name (timeout ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" > "$STEPS_DIR/$name.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  cat "$STEPS_DIR/$name.txt" >> "$LOG"
  grep -E '^(RESULT|nccl_check:|gpu_e2e:|  (float32|bfloat16|float16|owner runtime):|  \[dc-probe\]|    )' "$STEPS_DIR/$name.txt" \
    | grep -v '^    File' | head -60 >> "$SUMMARY"
  case $rc in
    0) note "step $name: ok (${secs}s)";;
    124|137) note "step $name: TIMED OUT after ${limit}s"; FAILED=1;;
    *) note "step $name: FAILED rc=$rc (${secs}s); tail:"; tail -15 "$STEPS_DIR/$name.txt" | tee -a "$SUMMARY"
       FAILED=1;;
  esac
  return $rc
}

# ---- 1. environment --------------------------------------------------------------------------------------------
note "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
if timeout 60 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
  SITE=/tmp/owner_reduce_site
  if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl >> "$LOG" 2>&1 || note "environment: installing the carried wheels FAILED"
  fi
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  note "environment: the machine's python3 ($(command -v python3)) + carried wheels in $SITE + this checkout"
else
  if timeout 420 bash -c 'source scripts/env.sh' >> "$LOG" 2>&1; then
    source scripts/env.sh
    set +e  # env.sh turns on errexit; a failing step must not end this script
    PY="$OWNER_REDUCE_PY"
    note "environment: $PY (scripts/env.sh)"
  else
    note "environment: scripts/env.sh FAILED (see gpu_check.log)"
    exit 1
  fi
fi

# ---- 2. the machine and the versions ----------------------------------------------------------------------------
timeout 30 nvidia-smi 2>&1 | tee -a "$LOG" | head -20
note "gpu: $(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4)"
timeout 90 "$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch
print(f"versions: python {__import__('sys').version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}), "
      f"{torch.cuda.device_count()} GPU(s)")
try:
    import cupy
    from owner_reduce.runtime.nccl_comm import nccl_runtime_version
    print(f"versions: cupy {cupy.__version__}, NCCL through cupy {'.'.join(map(str, nccl_runtime_version()))}")
except Exception as e:
    print(f"versions: cupy NCCL unavailable: {type(e).__name__}: {e}")
try:
    import deepspeed
    print(f"versions: deepspeed {deepspeed.__version__}")
except Exception as e:
    print(f"versions: deepspeed unavailable: {type(e).__name__}: {e}")
EOF
# Can two ranks share the one GPU? NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE, for cupy's NCCL (nccl_check)
# and, for the end-to-end run, torch's NCCL too; with two or more GPUs, always.
read -r GPUS CUPY_OK TORCH_OK HAVE_DS < <(timeout 90 "$PY" - <<'EOF' 2>/dev/null
import importlib.util, torch
gpus = torch.cuda.device_count()
try:
    from owner_reduce.runtime.nccl_comm import nccl_runtime_version
    cupy_ok = gpus >= 2 or nccl_runtime_version() >= (2, 30, 0)
except Exception:
    cupy_ok = False
try:
    torch_ok = gpus >= 2 or tuple(torch.cuda.nccl.version()) >= (2, 30, 0)
except Exception:
    torch_ok = False
print(gpus, int(cupy_ok), int(torch_ok), int(importlib.util.find_spec("deepspeed") is not None))
EOF
)
GPUS=${GPUS:-0}; CUPY_OK=${CUPY_OK:-0}; TORCH_OK=${TORCH_OK:-0}; HAVE_DS=${HAVE_DS:-0}
note "two ranks on this machine: cupy NCCL $([ "$CUPY_OK" = 1 ] && echo yes || echo no), torch NCCL $([ "$TORCH_OK" = 1 ] && echo yes || echo no); deepspeed importable: $HAVE_DS"
if [ "$GPUS" -lt 1 ]; then
  note "gpu_check: torch sees no GPU: nothing to check"
  exit 1
fi

# ---- 3. standalone NCCL check ------------------------------------------------------------------------------------
step nccl_ws1 150 "$PY" scripts/nccl_check.py --world-size 1 --iters 20 --json "$OUTDIR/nccl_ws1.json"
if [ "$CUPY_OK" = 1 ]; then
  step nccl_ws2 180 "$PY" scripts/nccl_check.py --world-size 2 --iters 20 --json "$OUTDIR/nccl_ws2.json"
else
  note "step nccl_ws2: SKIPPED (one GPU and cupy's NCCL < 2.30: two ranks cannot share it)"
fi

# ---- 4. CUDA tests -----------------------------------------------------------------------------------------------
if [ "$HAVE_DS" = 1 ]; then
  step pytest_cuda 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
else
  note "step pytest_cuda: SKIPPED (deepspeed is not importable: carry .whl, see --fetch-wheels)"
fi

# ---- 5. DeepCompile ZeRO-1 end to end ----------------------------------------------------------------------------
if [ "$HAVE_DS" = 1 ]; then
  E2E_WS=1
  if [ "$CUPY_OK" = 1 ] && [ "$TORCH_OK" = 1 ]; then E2E_WS=2; fi
  [ "$E2E_WS" = 1 ] && note "gpu_e2e: ws=1 only (two ranks cannot share this GPU with these NCCL versions)"
  E2E_LIMIT=$(left)
  [ "$E2E_LIMIT" -gt 400 ] && E2E_LIMIT=400
  # gpu_e2e gets 20s less than the step, so it writes its results before the step's timeout would hit.
  step e2e_ws$E2E_WS "$E2E_LIMIT" "$PY" scripts/gpu_e2e.py --world-size "$E2E_WS" --steps 6 --timeout 180 \
    --total-timeout $(( E2E_LIMIT - 20 )) --json "$OUTDIR/e2e_ws$E2E_WS.json"
else
  note "step e2e: SKIPPED (deepspeed is not importable: carry .whl, see --fetch-wheels)"
fi

note "gpu_check: $([ "$FAILED" = 0 ] && echo 'every step that ran passed' || echo 'SOME STEP FAILED') in $(( $(date +%s) - START ))s"
exit "$FAILED"
