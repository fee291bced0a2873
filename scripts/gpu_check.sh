#!/usr/bin/env bash
# The GPU check in one script, sized for one H200 and a 15-minute device lease: at most GPU_CHECK_BUDGET_S (default
# 420 s = 7 minutes) from a bare machine, every step with its own timeout, a step never started past the budget;
# rerunnable (it overwrites its outputs). In order:
#   0. NCCL >= 2.30 in place of the image's (scripts/nccl_install.py): the libnccl.so.2 that --fetch-wheels stripped
#      to the GPU's architecture and xz-compressed into .whl/nccl/, written over this python's nvidia/nccl/lib and
#      /usr/lib*, before anything loads NCCL;
#   1. the NCCL versions torch and cupy load and the library files they map (scripts/gpu_plan.py); ranks share the
#      one GPU (ws 2 and 4) only when both are >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1);
#   2. environment: the machine's python3 if its torch sees a GPU (offline GPU images), plus the wheels carried in
#      .whl/, installed into /tmp/owner_reduce_site; otherwise scripts/env.sh (.venv from PyPI); native DeepCompile's
#      extension starts building in the background (TORCH_CUDA_ARCH_LIST from the GPU);
#   3. scripts/nccl_check.py at ws 2 and ws 4 on one GPU (owner flush == AllReduce bitwise; timings are ranks
#      sharing a GPU, not an interconnect); after ws 2, issue 37's two-rank checks (scripts/nccl_mechanisms.py):
#      mech_launch_stall (a collective that never completes behind 5000 launches: the host blocks in a launch, and an
#      abort from another thread releases it), mech_abort_order (two communicators aborted in the wrong order hang,
#      then aborted concurrently return) and stall_deep (the product, a 128-layer model with small buckets, rank 1
#      stopped: rank 0 fails within the deadline + 10 s naming the call, the communicator and the flush);
#      every multi-rank step on the shared GPU runs with NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_MAX_NCHANNELS=4;
#   4. scripts/gpu_e2e.py at ws 2: plain ZeRO-1, DeepCompile + owner_reduce, native DeepCompile (optional inside
#      the step), owner == plain bitwise, host us per reduce_grad, peak memory, phase times; issue 46's lines: the
#      first flush's host time against the tenth (a lazy NCCL connection blocks the host in the first ncclGroupEnd)
#      and every rank's CUDA contexts per GPU (nvidia-smi's compute-apps: a thread on the wrong device adds one on
#      GPU 0; with ranks sharing one GPU it cannot show); stall_deep's failed_after_stall_s is the time from the
#      stalled peer to the survivor's error;
#   5. pytest -m cuda (two-rank tests: ranks share the GPU);
#   6. the bf16 167M model (dim 1024, 8 layers, vocab 32000, whole-model bucket 5e8) at ws 4: owner and native step
#      times, host us per reduce_grad, peak memory; every rank prints its phases, and a mode past its bound fails
#      naming each rank's phase (issue 17: this run did not finish in 70 s);
#   7. gpu_e2e at ws 4 (as 4);  7b. the two-level flush at ws 4 as two nodes of two (exact data: bitwise), optional;
#   8. ws 1, optional. GPU_CHECK_BUDGET_S=540 fits a 600 s device call.
#   Without NCCL >= 2.30 in both: ws 1 only (nccl_check, pytest -m cuda, gpu_e2e), and the check fails, saying why.
# Writes ${OUT:-out}/gpu_summary.txt (every number, and what was and was not measured) and ${OUT:-out}/gpu_check.log.
# Exit code: 0 when every required step ran and passed, 1 otherwise.
#
#   bash scripts/gpu_check.sh --fetch-wheels [--arch 90]   # here, with PyPI: fill .whl/ (DeepSpeed + deps, NCCL)
#   bash scripts/gpu_check.sh --dry-run                    # anywhere: what it carries, installs and runs
#   bash scripts/gpu_check.sh                              # on the GPU machine (carry .whl there)
# --arch: the GPU's compute capability without the dot (90: H100/H200; 100: B200; 80: A100); nvidia-smi
# --query-gpu=compute_cap --format=csv,noheader prints it with the dot.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
START=$(date +%s)
MODE=run
ARCH=${GPU_CHECK_ARCH:-90}
WHL=${GPU_CHECK_WHL_DIR:-.whl}
NCCL_DIR="$WHL/nccl"
NCCL_FETCH=${GPU_CHECK_NCCL_FETCH:-2.32.3}  # 2.32.3 ran on the H200
# The CUDA major of the GPU image's torch (+cu130: 13), so the NCCL fetched is owner_reduce[cu13]'s nvidia-nccl-cu13;
# on the GPU, gpu_plan.py prints whether the image's cupy fits its torch ("CUDA extra: ..."), and a machine without a
# GPU torch installs through scripts/env.sh, which picks the extra for the torch it finds.
CUDA_MAJOR=${GPU_CHECK_CUDA_MAJOR:-13}
NCCL_PACKAGE="nvidia-nccl-cu$CUDA_MAJOR"
CARRY_LIMIT=$((64 * 1024 * 1024))
usage() { echo "usage: bash scripts/gpu_check.sh [--fetch-wheels [--arch N] | --dry-run]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --fetch-wheels) MODE=fetch;;
    --dry-run) MODE=dry;;
    --arch) [ $# -ge 2 ] || usage; ARCH=$2; shift;;
    --arch=*) ARCH=${1#--arch=};;
    *) usage;;
  esac
  shift
done
if ! [[ "$CUDA_MAJOR" =~ ^1[23]$ ]]; then
  echo "gpu_check: GPU_CHECK_CUDA_MAJOR must be 12 or 13 (owner_reduce's extras cu12, cu13), got '$CUDA_MAJOR'" >&2; exit 2
fi
if ! [[ "$ARCH" =~ ^[1-9][0-9]{1,2}$ ]]; then
  echo "gpu_check: --arch must be a compute capability without the dot (90 for sm_90), got '$ARCH'" >&2; exit 2
fi

# carry_report: every file under $WHL with its size, and whether the whole fits the device call's 64 MiB.
carry_report() {
  local total=0 size f
  if [ ! -d "$WHL" ]; then echo "carry: $WHL/ does not exist: prepare it with 'bash scripts/gpu_check.sh --fetch-wheels'"
    return 1; fi
  echo "carry ($WHL/, carry=[\"$WHL\"]; the device call takes at most 64 MiB):"
  while IFS= read -r f; do
    size=$(stat -c %s "$f"); total=$((total + size))
    awk -v s="$size" -v f="${f#"$WHL"/}" 'BEGIN { printf "  %8.1f MB  %s\n", s / 1e6, f }'
  done < <(find "$WHL" -type f | sort)
  awk -v t="$total" -v v="$([ "$total" -le "$CARRY_LIMIT" ] && echo fits || echo 'DOES NOT FIT')" \
    'BEGIN { printf "  total %.1f MB = %.1f MiB of 64 MiB: %s\n", t / 1e6, t / 1048576, v }' 
  [ "$total" -le "$CARRY_LIMIT" ]
}

if [ "$MODE" = fetch ]; then
  # DeepSpeed and the few of its needs that the GPU image lacks, for CPython 3.12 on x86-64 (the image's python3),
  # and NCCL >= 2.30 stripped to sm_$ARCH. Needs PyPI and an interpreter with torch (DeepSpeed's setup.py imports
  # it): .venv's, or OWNER_REDUCE_PY.
  set -e
  mkdir -p "$WHL"
  FETCH_PY="${OWNER_REDUCE_PY:-$ROOT/.venv/bin/python}"
  [ -x "$FETCH_PY" ] || FETCH_PY=python3
  PIP="$FETCH_PY -m pip"
  PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64)
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$WHL" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions py-cpuinfo pytest-timeout ninja  # ninja: DeepSpeed's JIT build of native DeepCompile
  # DeepSpeed ships an sdist only: build its (pure Python, no prebuilt ops) wheel here.
  DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w "$WHL" deepspeed==0.19.8
  # NCCL: the 305 MB wheel stays outside $WHL (a cache in /tmp); only its stripped, xz'd library is carried.
  if ! printf '%s\n2.30.0\n' "$NCCL_FETCH" | sort -V -C -r; then
    echo "gpu_check: GPU_CHECK_NCCL_FETCH=$NCCL_FETCH: ranks sharing a GPU need NCCL >= 2.30" >&2; exit 2
  fi
  NCCL_CACHE=${GPU_CHECK_NCCL_CACHE:-${TMPDIR:-/tmp}/owner_reduce_nccl_wheel}
  mkdir -p "$NCCL_CACHE"
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$NCCL_CACHE" "$NCCL_PACKAGE==$NCCL_FETCH"
  NCCL_WHEEL=$(ls "$NCCL_CACHE"/"${NCCL_PACKAGE//-/_}"-"$NCCL_FETCH"-*.whl | head -1)
  echo "NCCL: stripping $(basename "$NCCL_WHEEL") to sm_$ARCH (from $NCCL_CACHE; not carried) ..."
  "$FETCH_PY" scripts/nccl_strip.py prepare "$NCCL_WHEEL" "$NCCL_DIR" --arch "$ARCH"
  carry_report
  exit $?
fi

BUDGET_S=${GPU_CHECK_BUDGET_S:-420}  # counted from the start: installing NCCL and the environment are inside it
PLAN_PY="${OWNER_REDUCE_PY:-python3}"
HAVE_NCCL_ARTIFACT=0
[ -f "$NCCL_DIR/manifest.json" ] && [ -f "$NCCL_DIR/libnccl.so.2.xz" ] && HAVE_NCCL_ARTIFACT=1
manifest_field() { "$PLAN_PY" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" \
  "$NCCL_DIR/manifest.json" "$1" 2>/dev/null; }

# The steps: name:limit_s:required. The limits add up to more than the budget: a step never starts past it.
MULTI_PLAN=("nccl_ws2:60:required" "mech_launch_stall:50:optional" "mech_abort_order:60:optional"
            "stall_deep:80:required" "nccl_ws4:75:required" "e2e_ws2:160:required" "pytest_cuda:150:required"
            "bf16_ws4:175:required" "e2e_ws4:130:required" "two_level_ws4:120:optional" "e2e_ws1:70:optional")
SINGLE_PLAN=("nccl_ws1:90:required" "pytest_cuda:150:required" "e2e_ws1:150:required")
PLAN=()
limit_of() { local s; for s in "${PLAN[@]}"; do [ "${s%%:*}" = "$1" ] && { s=${s#*:}; echo "${s%%:*}"; }; done; }
E2E_SMALL=(--steps 4 --layers 2 --require-bitwise)
BF16_MODEL=(--bf16 --dim 1024 --layers 8 --vocab 32000 --bucket 500000000)
PYTEST_ARGS=(-q -m cuda -p no:cacheprovider -k "not ws4_bf16" tests)
command_of() {  # the command line of a step, for the dry run and the run alike (without the step's timeout)
  case "$1" in
    nccl_ws1) echo "scripts/nccl_check.py --world-size 1 --iters 10 --timeout 80";;
    nccl_ws2) echo "NCCL_MULTI_RANK_GPU_ENABLE=1 scripts/nccl_check.py --world-size 2 --iters 10 --timeout 50";;
    nccl_ws4) echo "NCCL_MULTI_RANK_GPU_ENABLE=1 scripts/nccl_check.py --world-size 4 --iters 10 --timeout 65";;
    e2e_ws1) echo "scripts/gpu_e2e.py --world-size 1 ${E2E_SMALL[*]} --modes plain,owner,native --timeout 50 --total-timeout $(( $(limit_of e2e_ws1) - 15 ))";;
    e2e_ws2) echo "scripts/gpu_e2e.py --world-size 2 ${E2E_SMALL[*]} --modes plain,owner,handoff,native --timeout 60 --total-timeout 145";;
    e2e_ws4) echo "scripts/gpu_e2e.py --world-size 4 ${E2E_SMALL[*]} --modes plain,owner,native --timeout 70 --total-timeout 115";;
    two_level_ws4) echo "scripts/gpu_e2e.py --world-size 4 --ranks-per-node 2 --model exact_linear --steps 4 --require-bitwise --modes plain,two_level --timeout 60 --total-timeout 105";;
    bf16_ws4) echo "scripts/gpu_e2e.py --world-size 4 --steps 4 ${BF16_MODEL[*]} --modes owner,native --timeout 120 --total-timeout 160";;
    pytest_cuda) echo "-m pytest -q -m cuda -p no:cacheprovider -k 'not ws4_bf16' tests (the ws 4 bf16 test is step bf16_ws4)";;
    mech_launch_stall) echo "scripts/nccl_mechanisms.py launch-stall --launches 5000 --timeout 40";;
    mech_abort_order) echo "scripts/nccl_mechanisms.py abort-order --alone-s 10 --join-s 20 --timeout 50";;
    stall_deep) echo "scripts/nccl_mechanisms.py product-stall --layers 128 --bucket 16384 --deadline 8 --timeout 70";;
  esac
}
ARCH_DOT="${ARCH:0:${#ARCH}-1}.${ARCH: -1}"

# ---- 0./1. NCCL: the carried one in place, then the versions torch and cupy load ------------------------------
if [ "$MODE" = dry ]; then
  echo "gpu_check --dry-run: nothing is installed, written or run here. Budget on the GPU machine: ${BUDGET_S}s."
  carry_report || true
  echo "NCCL install (first, before anything loads NCCL):"
  if [ "$HAVE_NCCL_ARTIFACT" = 1 ]; then
    timeout 120 "$PLAN_PY" scripts/nccl_install.py --dir "$NCCL_DIR" --dry-run \
      ${GPU_CHECK_GPU_ARCH:+--gpu-arch "$GPU_CHECK_GPU_ARCH"} 2>&1 | sed 's/^/  /'
    if [ -z "${GPU_CHECK_NCCL_VERSION:-}" ]; then
      export GPU_CHECK_NCCL_VERSION="$(manifest_field nccl_version)"
      echo "  (the versions below are the carried NCCL's: what torch and cupy load once it is installed)"
    fi
  else
    echo "  no NCCL carried ($NCCL_DIR/libnccl.so.2.xz): the image's NCCL stays; prepare it with --fetch-wheels"
  fi
  export GPU_CHECK_GPUS="${GPU_CHECK_GPUS:-$(timeout 60 "$PLAN_PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
  [ "$GPU_CHECK_GPUS" = 0 ] && GPU_CHECK_GPUS=1  # no GPU here: decide for the lent machine, one GPU
else
  OUTDIR="${OUT:-out}"
  mkdir -p "$OUTDIR"
  SUMMARY="$OUTDIR/gpu_summary.txt"
  LOG="$OUTDIR/gpu_check.log"
  STEPS_DIR=$(mktemp -d)  # each step's own output; not under $OUTDIR, where only a few files come back
  trap 'rm -rf "$STEPS_DIR"' EXIT
  : > "$SUMMARY"
  : > "$LOG"
  note() { echo "$*" | tee -a "$SUMMARY"; }
  note "gpu_check: $(date -u +%FT%TZ) on $(hostname); budget ${BUDGET_S}s"
  NCCL_INSTALLED=none
  if [ "$HAVE_NCCL_ARTIFACT" = 1 ]; then
    timeout 120 "$PLAN_PY" scripts/nccl_install.py --dir "$NCCL_DIR" > "$STEPS_DIR/nccl_install.txt" 2>&1
    rc=$?
    tee -a "$SUMMARY" < "$STEPS_DIR/nccl_install.txt"
    if [ "$rc" = 0 ]; then NCCL_INSTALLED=ok; else NCCL_INSTALLED="FAILED rc=$rc"
      note "nccl_install: FAILED (rc=$rc): the image's NCCL stays"; fi
  else
    note "nccl_install: no NCCL carried ($NCCL_DIR): the image's NCCL stays (--fetch-wheels prepares it)"
  fi
fi
DECISION_TEXT=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout 90 "$PLAN_PY" scripts/gpu_plan.py 2>&1)
if [ "$MODE" = dry ]; then echo "$DECISION_TEXT" | grep -v '^DECISION'; else
  echo "$DECISION_TEXT" | grep -v '^DECISION' | tee -a "$SUMMARY"; fi
read -r GPUS WS2 HAVE_DS HAVE_CUPY < <(echo "$DECISION_TEXT" | sed -n 's/^DECISION gpus=\([0-9]*\) ws2=\([01]\) have_ds=\([01]\) have_cupy=\([01]\).*/\1 \2 \3 \4/p')
GPUS=${GPUS:-0}; WS2=${WS2:-0}; HAVE_DS=${HAVE_DS:-0}; HAVE_CUPY=${HAVE_CUPY:-0}
WHY_NOT_WS2=$(echo "$DECISION_TEXT" | sed -n 's/^ws>=2 on one GPU: will be SKIPPED: //p')
if [ "$WS2" = 1 ]; then PLAN=("${MULTI_PLAN[@]}"); else PLAN=("${SINGLE_PLAN[@]}"); fi

if [ "$MODE" = dry ]; then
  echo "plan on a machine with ${GPUS} GPU(s) (each step no later than the budget; a step with under 20s left is skipped):"
  echo "  env         python3 + the wheels carried in $WHL/ if its torch sees a GPU, else scripts/env.sh; then native"
  echo "              DeepCompile's extension builds in the background (TORCH_CUDA_ARCH_LIST from the GPU, e.g. $ARCH_DOT)"
  for s in "${PLAN[@]}"; do
    n=${s%%:*}; rest=${s#*:}
    printf '  %-11s timeout %ss, %s: %s\n' "$n" "${rest%%:*}" "${rest#*:}" "$(command_of "$n")"
  done
  if [ "$WS2" = 1 ]; then
    echo "              (e2e: owner == plain bitwise; native optional inside the step; bf16_ws4 prints every rank's"
    echo "               phases, and a mode past its bound fails naming each rank's phase)"
    echo "              (multi-rank steps on the shared GPU: NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_NCHANNELS=4, channels"
    echo "               capped; mech_*: the review's mechanisms, optional; stall_deep: the product's bound, required)"
  else
    echo "  ws 2, ws 4  SKIPPED: ${WHY_NOT_WS2:-see above}; the check then fails (issue 17 needs ws 2 and 4)"
    echo "  mech_launch_stall, mech_abort_order, stall_deep  SKIPPED with them: two ranks are needed"
  fi
  echo "  summary     \${OUT:-out}/gpu_summary.txt: every number, and what was not measured"
  exit 0
fi

FAILED=0
declare -A RAN=()
export PYTHONUNBUFFERED=1
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
[ "$NCCL_INSTALLED" != ok ] && [ "$NCCL_INSTALLED" != none ] && FAILED=1

# step NAME CMD...: run with the plan's timeout, never past the budget; append its result lines to the summary.
step() {
  local name=$1 limit required rc t0 secs remaining
  shift
  limit=$(limit_of "$name")
  required=$(for s in "${PLAN[@]}"; do [ "${s%%:*}" = "$name" ] && echo "${s##*:}"; done)
  remaining=$(( $(left) - 5 ))  # a few seconds for the summary
  if [ "$remaining" -lt 20 ]; then
    note "step $name: SKIPPED (only $(left)s of the ${BUDGET_S}s budget left)"
    RAN[$name]=skipped
    [ "$required" = required ] && FAILED=1
    return 0
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  t0=$(date +%s)
  echo "===== $name (timeout ${limit}s, +$(( t0 - START ))s): $*" | tee -a "$LOG"
  # GPU_CHECK_STEP_LIMIT_S: gpu_e2e keeps its own bound under it, so it writes its results before this kill.
  GPU_CHECK_STEP_LIMIT_S=$limit timeout --kill-after=10 "$limit" "$@" > "$STEPS_DIR/$name.txt" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  cat "$STEPS_DIR/$name.txt" >> "$LOG"
  case $name in  # the lines worth keeping: results, and (nccl_check) the indented checks under each dtype
    pytest_cuda) grep -E '^(FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed|skipped|error|deselected))' "$STEPS_DIR/$name.txt";;
    nccl_*) grep -E '^(RESULT|nccl_check:|  (float32|bfloat16|float16):|    (identical|random|median))' "$STEPS_DIR/$name.txt";;
    mech_*|stall_*) grep -E '^(RESULT|nccl_mechanisms)' "$STEPS_DIR/$name.txt" | cut -c1-600;;
    *) grep -E '^(RESULT|gpu_e2e: (ws=|all|A COMP|the owner|.*(SKIPPED|FAILED|unavailable))|  owner runtime:|  \[dc-probe\]|  phase r0 +\+ *[0-9.]+s done )' \
         "$STEPS_DIR/$name.txt" | cut -c1-400;;
  esac | head -150 >> "$SUMMARY"
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
run_step() { local n=$1; shift; step "$n" "$PY" "$@"; }  # a step that runs this check's python

# ---- 2. environment ------------------------------------------------------------------------------------------------
if timeout 60 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
  SITE=/tmp/owner_reduce_site
  if compgen -G "$WHL/*.whl" > /dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHL"/*.whl >> "$LOG" 2>&1 || note "environment: installing the carried wheels FAILED"
    note "environment: installed from $WHL/: $(cd "$WHL" && ls -- *.whl | tr '\n' ' ')"
  else
    note "environment: no wheels carried (bash scripts/gpu_check.sh --fetch-wheels prepares them)"
  fi
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"  # the carried ninja, where the image has none
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
note "gpu: $(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | head -4)"
note "importable: deepspeed=$HAVE_DS cupy=$HAVE_CUPY; GPUs visible to torch: $GPUS"
if [ "$GPUS" -lt 1 ]; then
  note "gpu_check: torch sees no GPU: nothing to check"
  exit 1
fi
CC=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${CC:-$ARCH_DOT}}"
export MAX_JOBS="${MAX_JOBS:-8}"
NATIVE_PID=""
if [ "$HAVE_DS" = 1 ]; then  # CPU work (nvcc) that overlaps the NCCL steps; the ranks then load it from the cache
  timeout 300 "$PY" -c "from deepspeed.ops.op_builder.dc import DeepCompileBuilder as B; B().load(verbose=False); \
print('native DeepCompile extension: built and loaded')" > "$STEPS_DIR/native_build.txt" 2>&1 &
  NATIVE_PID=$!
  note "native DeepCompile: building its extension in the background (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
fi
need_ds() { [ "$HAVE_DS" = 1 ] || { note "step $1: SKIPPED (deepspeed is not importable: carry $WHL, see --fetch-wheels)"
  RAN[$1]=skipped; FAILED=1; return 1; }; }
# shellcheck disable=SC2046  # command_of's words are the step's arguments
e2e_step() { need_ds "$1" && run_step "$1" $(command_of "$1") --json "$OUTDIR/$1.json"; }

# ---- 3.-8. the steps -------------------------------------------------------------------------------------------------
if [ "$WS2" = 1 ]; then
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  export NCCL_MAX_NCHANNELS=4  # ranks share the GPU: capped channels (issue 37)
  # shellcheck disable=SC2046
  run_step nccl_ws2 $(command_of nccl_ws2 | sed 's/^NCCL_MULTI_RANK_GPU_ENABLE=1 //') --json "$OUTDIR/nccl_ws2.json"
  if [ "$HAVE_CUPY" = 1 ]; then
    # shellcheck disable=SC2046
    run_step mech_launch_stall $(command_of mech_launch_stall) --dir "$OUTDIR"
    # shellcheck disable=SC2046
    run_step mech_abort_order $(command_of mech_abort_order) --dir "$OUTDIR"
    # shellcheck disable=SC2046
    need_ds stall_deep && run_step stall_deep $(command_of stall_deep) --dir "$OUTDIR"
  else
    note "steps mech_launch_stall, mech_abort_order, stall_deep: SKIPPED (cupy is not importable)"
    RAN[stall_deep]=skipped; FAILED=1
  fi
  # shellcheck disable=SC2046
  run_step nccl_ws4 $(command_of nccl_ws4 | sed 's/^NCCL_MULTI_RANK_GPU_ENABLE=1 //') --json "$OUTDIR/nccl_ws4.json"
  e2e_step e2e_ws2
  need_ds pytest_cuda && run_step pytest_cuda -m pytest "${PYTEST_ARGS[@]}"
  e2e_step bf16_ws4
  e2e_step e2e_ws4
  e2e_step two_level_ws4
  e2e_step e2e_ws1
else
  note "ws 2 and ws 4 on one GPU: SKIPPED: ${WHY_NOT_WS2:-see above}; issue 17 needs them: the check fails"
  FAILED=1
  # shellcheck disable=SC2046
  run_step nccl_ws1 $(command_of nccl_ws1) --json "$OUTDIR/nccl_ws1.json"
  need_ds pytest_cuda && run_step pytest_cuda -m pytest "${PYTEST_ARGS[@]}"
  e2e_step e2e_ws1
fi
if [ -n "$NATIVE_PID" ]; then
  kill "$NATIVE_PID" 2>/dev/null; wait "$NATIVE_PID" 2>/dev/null
  cat "$STEPS_DIR/native_build.txt" >> "$LOG"
  if grep -q "built and loaded" "$STEPS_DIR/native_build.txt"; then note "native DeepCompile extension: built"
  else note "native DeepCompile extension: NOT built; last lines:"; tail -8 "$STEPS_DIR/native_build.txt" | tee -a "$SUMMARY"; fi
fi

# ---- what was and was not measured ------------------------------------------------------------------------------------
has() { grep -qE "$2" "$STEPS_DIR/$1.txt" 2>/dev/null; }
note ""
note "NOT MEASURED in this run (everything measured is a RESULT line above):"
for s in "${PLAN[@]}"; do n=${s%%:*}; [ "${RAN[$n]:-}" = ok ] || note "  - step $n: ${RAN[$n]:-not run}"; done
for ws in 2 4; do
  [ "$WS2" = 1 ] || break
  has "nccl_ws$ws" "^RESULT nccl_check ws=$ws " || note "  - nccl_check at ws $ws"
  for m in plain owner native; do
    has "e2e_ws$ws" "^RESULT gpu_e2e mode=$m ws=$ws " || note "  - gpu_e2e $m at ws $ws (small model)"
  done
done
if [ "$WS2" = 1 ]; then
  for m in owner native; do
    has bf16_ws4 "^RESULT gpu_e2e mode=$m ws=4 " || note "  - the bf16 167M model at ws 4: $m (step time, host us, peak memory)"
  done
fi
if [ "$WS2" = 1 ]; then
  has two_level_ws4 "^RESULT gpu_e2e mode=two_level ws=4 " || note "  - the two-level flush at ws 4 (two nodes of two)"
  has mech_launch_stall "^RESULT nccl_mechanisms check=launch-stall ok=1" || \
    note "  - issue 37: the host blocked in a launch behind a stalled collective, released by an abort"
  has mech_abort_order "^RESULT nccl_mechanisms check=abort-order ok=1" || \
    note "  - issue 37: two communicators aborted in the wrong order hang, concurrently return"
  has stall_deep "^RESULT nccl_mechanisms check=product-stall ok=1" || \
    note "  - issue 37: a stalled peer in a 128-layer model fails rank 0 within the deadline + 10 s"
  has e2e_ws2 "^RESULT gpu_e2e flushes mode=owner ws=2 " || \
    note "  - issue 46: the first flush's host time against the tenth (NCCL's lazy connections)"
  has e2e_ws2 "^RESULT gpu_e2e contexts mode=owner ws=2 r0=\[[^]]*MiB" || \
    note "  - issue 46: each rank's CUDA contexts per GPU (nvidia-smi's compute-apps)"
  [ "$GPUS" -gt 1 ] || note "  - issue 46: a context on the wrong GPU: every rank runs on GPU 0 here, so none can show"
fi
for m in plain owner native; do has e2e_ws1 "^RESULT gpu_e2e mode=$m ws=1 " || note "  - gpu_e2e $m at ws 1"; done
note "  - any interconnect: ranks share one GPU (its memory and SMs), so no timing here is an NVLink/IB measurement"
note "  - multi-GPU or multi-node runs; stalled/killed peers on real NCCL beyond the two-rank test"
note "gpu_check: $([ "$FAILED" = 0 ] && echo 'every required step ran and passed' || echo 'SOME REQUIRED STEP FAILED OR WAS SKIPPED') in $(( $(date +%s) - START ))s"
exit "$FAILED"
