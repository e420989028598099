#!/usr/bin/env bash
# Issue 27's GPU measurements in one prepared run on a lent GPU machine (no registry there).
#
#   bash benchmarks/gpu_run.sh SECONDS STAGE...     e.g. bash benchmarks/gpu_run.sh 420 tests attention variants dispatch
#
# Put `tests` first: a stage cut by the deadline returns nothing but its log (pytest runs
# with -v, so the log names every test's outcome even when the run is cut).
#
# Installs axcore, the rope/swiglu/remat plugins and axcore_gpu (with the wheels carried in .whl/:
# grain, array-record, portpicker, tensorboardX) into /tmp/site without touching the image's
# CUDA JAX, then runs the named stages in order, each bounded so that the whole run ends
# within SECONDS. Logs go to $OUT/log.txt and results (benchmarks' JSON, junit XML) to
# $OUT/results.tgz after every stage, so a run cut short still returns what it measured.
# Stage options come from the environment: VARIANTS (gpu_variants contenders), PALLAS
# (gpu_attention option sets), PALLAS_OPTIONS (one set for gpu_variants; default: the attention
# stage's fastest), VARIANT_ARGS, DISPATCH_ARGS, DECODE_ARGS (gpu_decode), PYTEST_ARGS.
set -u
LIMIT=${1:?seconds}; shift
OUT=${OUT:-/tmp/gpu-out}
RESULTS=/tmp/gpu-results
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
DEADLINE=$((SECONDS + LIMIT))
log() { echo "$@" | tee -a "$OUT/log.txt"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
  --target /tmp/site .whl/*.whl . ./plugins/rope ./plugins/swiglu ./plugins/remat ./axcore_gpu >>"$OUT/log.txt" 2>&1 || { log "install failed"; tail -20 "$OUT/log.txt"; exit 1; }
export PYTHONPATH=/tmp/site
log "== machine $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/log.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$OUT/log.txt"

stage() {  # stage NAME MAX_SECONDS COMMAND...: runs within the deadline, logs, then packs the results.
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - SECONDS - 8))
  local budget=$(( max < left ? max : left ))
  if (( budget < 15 )); then log "== $name: skipped (no time left)"; return; fi
  log "== $name (up to ${budget}s, $(date -u +%T))"
  timeout --kill-after=5 "$budget" "$@" >>"$OUT/log.txt" 2>&1
  log "== $name rc=$? after $((SECONDS))s"
  cp -f benchmarks/results/gpu_*.json benchmarks/results/gpu_hlo_*.txt.gz "$RESULTS"/ 2>/dev/null
  tar -czf "$OUT/results.tgz" -C "$RESULTS" . 2>/dev/null
}

for s in "$@"; do
  case $s in
    tests) stage tests 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -n 6 -p no:cacheprovider \
             --junitxml="$RESULTS/gpu_tests.xml" ${PYTEST_ARGS:-axcore_gpu/tests tests/kernels} ;;
    norm) stage norm 90 python3 -m benchmarks.gpu_norm ;;
    attention) stage attention 120 python3 -m benchmarks.gpu_attention ${PALLAS:+--pallas $PALLAS} ;;
    variants)  # The Pallas options of the attention stage's fastest set, unless PALLAS_OPTIONS is given.
      best=${PALLAS_OPTIONS:-$(python3 -c "import json; print(json.load(open('$RESULTS/gpu_attention.json'))['best_pallas'] or '')" 2>/dev/null)}
      stage variants 300 python3 -m benchmarks.gpu_variants --contenders ${VARIANTS:-bf16 packed_xla packed_pallas fp8} \
        ${best:+--pallas-options $best} ${VARIANT_ARGS:-} ;;
    dispatch) stage dispatch 100 python3 -m benchmarks.gpu_dispatch ${DISPATCH_ARGS:-} ;;
    dispatch_async) stage dispatch_async 100 env XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async \
        python3 -m benchmarks.gpu_dispatch --tag cuda_async ${DISPATCH_ARGS:-} ;;
    dispatch_q4) stage dispatch_q4 100 env CUDA_SCALE_LAUNCH_QUEUES=4x \
        python3 -m benchmarks.gpu_dispatch --tag launch_queues_4x ${DISPATCH_ARGS:-} ;;
    dispatch_nocb) stage dispatch_nocb 100 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
        python3 -m benchmarks.gpu_dispatch --tag no_command_buffer ${DISPATCH_ARGS:-} ;;
    probes) stage probes 120 python3 -m benchmarks.gpu_probes ;;
    profile) stage profile 120 python3 -m benchmarks.gpu_profile --contender axcore ;;
    decode) stage decode 150 python3 -m benchmarks.gpu_decode ${DECODE_ARGS:-} ;;
    step) stage step 150 python3 -m benchmarks.gpu_step --attention auto --steps-per-round 10 --rounds 5 ;;
    *) log "unknown stage $s" ;;
  esac
done
log "== done after ${SECONDS}s"
