#!/usr/bin/env bash
# Everything GPU-side in one call (the device tool runs it in the repo root with $OUT set):
# GPU tests, then the benchmark suites; results under $OUT, a short table last.
# Usage: scripts/gpu.sh [tests[:forward|:backward]] [SUITE[:impl,impl]] [compare-grid] [tune]
#        [tune-bwd] [tune-decode] [tune-linear] [tune-suite:SUITE] ...
#   default: tests softmax-d128 softmax-d128-bwd variants
#   decode: the decode suite (issue 23; its engine kernels compile on each case's first call)
#   linear: the linear suite (issue 18): engine vs fla (and mamba_ssm, skipped: no wheel), fwd and
#     fwd+bwd; fla's gated backward runs through its TileLang kernel (attnbench/impls/fla.py)
#   linear-step: the linear layer's generation step from a state (issue 18), engine vs fla's fused
#     recurrent kernel; rows carry TB/s and the fraction of peak bandwidth
#   compare-grid: the grid-vs-Optuna record (llama3-8b, 8k, bf16)
#   tune: the llama3 suite's llama3-8b cases, forward kernel, 16 trials each (the repo's tune
#     file, copied to $OUT/tune)
#   tune-bwd: the same cases' backward kernel, 10 trials each (attention_bwd tune file)
#   tune-suite:SUITE: every engine case of SUITE, forward and backward kernels, 8 trials each
#   tune-decode: the decode kind (attnbench tune --mode decode) on the decode suite's case
#     DECODE_FILTER (default softmax/llama3-8b/b1/s1x131072/bfloat16), DECODE_TRIALS (default 8)
#     Optuna trials; the attention_decode tune file copied to $OUT/tune
#   tune-linear: the linear kinds (attnbench tune --mode linear) on the linear suite's cases
#     LINEAR_FILTER (default mamba2/mamba2-2.7b/b8/s2048/bfloat16), LINEAR_TRIALS (default 8)
#     Optuna trials each kind; the linear_fwd / linear_bwd tune files copied to $OUT/tune
#   user-loop: tune=True on three custom variants, then both modules timed in a user loop
#     (scripts/tune_user_loop.py; record and tune files to $OUT/tune)
#   RUN_FILTER=PATTERN: suites run only the cases matching PATTERN (attnbench run --filter;
#     several patterns separated by spaces: the cases matching any)
#   RUN_RESUME=1: suites start from today's result file in results/runs (committed from an
#     earlier call cut short) and skip the cases it holds from this commit (attnbench run
#     --resume): a suite longer than one call finishes over several
#   IMPL_TIMEOUT=S: a suite's implementation still compiling or measuring one case after S s
#     (default 300) ends the suite's run, its case's rows written (attnbench run --impl-timeout)
#   TEST_FILTER=EXPR: the tests steps run only the tests pytest -k EXPR selects
#   host-overhead: the module's per-call host time against its kernel's launch and time
#     (scripts/host_overhead.py; $OUT/host-overhead.json); host-overhead-decode: its decode part
#     alone ($OUT/host-overhead-decode.json)
#   decode-sweep: the decode kernels' TB/s over DecodeConfigs (scripts/decode_sweep.py;
#     $OUT/decode-sweep.json; SWEEP_FILTER, SWEEP_CONFIGS)
#   linear-breakdown: each linear case's kernels' GPU time, engine and fla, forward and
#     forward+backward, as its rows run them (scripts/linear_breakdown.py;
#     $OUT/linear-breakdown.json and .log; BREAKDOWN_FILTER, space-separated patterns, default all
#     cases; BREAKDOWN_IMPLS, default engine,fla, e.g. engine,engine@bwd=C64_K128_V64_s2_t256,fla:
#     the engine at a named config too; arms as kernel-probe's, constants patched included)
#   kernel-probe:SUITE: arms (an implementation, optionally with module constants patched while
#     it builds) timed in one process over rotated rounds on SUITE's cases, kernel times by
#     torch.profiler (scripts/kernel_probe.py; $OUT/kernel-probe.json, its log line by line in
#     $OUT/kernel-probe.log: a call cut by a timeout keeps it); PROBE_FILTER patterns,
#     PROBE_ARMS e.g. "engine engine@engine.kernels.attention_bwd.plan:PERSISTENT_MAX_SQ=65536
#     sdpa-cudnn" (a linear arm may set configs too: engine@fwd=KEY@bwd=KEY; attnbench.arms),
#     PROBE_MODE fwd, fwd+bwd (default) or bwd, PROBE_ROUNDS (default 6)
#   clock-trace: a long kernel's repetition times beside the SM clock and power (NVML)
#     (scripts/clock_trace.py; $OUT/clock-trace.json)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/runs"
if [ -f .gpu/install.sh ]; then source .gpu/install.sh >/dev/null; fi
# Wheels the shared bundle lacks (pebble for the tuner's workers), if carried in .gpu/whl.
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-whl .gpu/whl/*.whl 2>/dev/null
  export PYTHONPATH="/tmp/gpu-whl${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The checkout's package metadata (entry points: tune=True finds the tuner through them).
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "gpu.sh: pip install -e . failed: tune=True will find no tuner" >&2
export ATTNBENCH_KERNEL_DIR=/tmp/attnbench-kernels TILELANG_CACHE_DIR=/tmp/tilelang-cache
# The commit the sender sent (its .git may not travel intact): write it before each call with
#   (git rev-parse HEAD; git diff --quiet HEAD || echo -dirty) | tr -d '\n' > .gpu/HEAD
if [ -s .gpu/HEAD ]; then export ATTNBENCH_GIT_SHA=$(cat .gpu/HEAD); fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
# attnbench tune over a suite's engine cases: SUITE MODE TRIALS TIMEOUT [extra args]; the tune
# files it writes are copied to $OUT/tune (a later step in the same call already uses them).
tune_suite() {
  local suite=$1 mode=$2 trials=$3 timeout=$4; shift 4
  mkdir -p "$OUT/tune"
  python -m attnbench tune --suite "$suite" --mode "$mode" --trials "$trials" "$@" --no-progress \
    --timeout "$timeout" --storage "sqlite:///$OUT/tune/studies-$suite-$mode.db" 2>&1 \
    | grep -v "^\[I \|INFO\|Warning" | tail -30
  cp results/tune/*/attention_fwd.json results/tune/*/attention_bwd.json \
    results/tune/*/attention_decode.json results/tune/*/linear_fwd.json \
    results/tune/*/linear_bwd.json "$OUT/tune/" 2>/dev/null
}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests softmax-d128 softmax-d128-bwd variants)
for step in "${steps[@]}"; do
  start=$(date +%s)
  if [ "${step%%:*}" = tests ]; then
    # tests:forward or tests:backward runs one of the two GPU test modules.
    what=tests/gpu; [ "$step" != tests ] && what="tests/gpu/test_${step#*:}_kernels.py"
    # One process: each module's fixture already compiles all its kernels in parallel workers
    # (pytest-xdist would repeat that whole precompile in every xdist worker).
    filter=(); [ -n "${TEST_FILTER:-}" ] && filter=(-k "$TEST_FILTER")
    timeout 560 python -m pytest -m gpu "$what" "${filter[@]}" -q -p no:cacheprovider -rf 2>&1 \
      | tee "$OUT/gpu-${step/:/-}.log" | grep -v "^FAILED" | tail -40
  elif [ "$step" = compare-grid ]; then
    mkdir -p "$OUT/tune"
    python -m attnbench tune --shape llama3-8b --seqlens 8k --dtype bf16 --compare-grid \
      --no-progress --timeout 420 --storage "sqlite:///$OUT/tune/studies.db" \
      --tune-file "$OUT/tune/attention_fwd.json" 2>&1 | grep -v "^\[I " | tail -20
    cp results/tune/*/compare-*.json "$OUT/tune/" 2>/dev/null
  elif [ "$step" = tune ]; then
    tune_suite llama3 fwd 16 540 --filter llama3-8b
  elif [ "$step" = tune-bwd ]; then
    tune_suite llama3 bwd 10 300 --filter llama3-8b
  elif [ "$step" = user-loop ]; then
    mkdir -p "$OUT/tune"
    ATTNBENCH_TUNE_TRIALS=${ATTNBENCH_TUNE_TRIALS:-16} ATTNBENCH_TUNE_SECONDS=${ATTNBENCH_TUNE_SECONDS:-120} \
      python scripts/tune_user_loop.py "$OUT/tune" 2>&1 | grep -v "^\[I \|INFO" | tail -30
  elif [ "$step" = host-overhead ]; then
    python scripts/host_overhead.py "$OUT/host-overhead.json" 2>&1 | grep -v INFO | tail -25
  elif [ "$step" = host-overhead-decode ]; then
    python scripts/host_overhead.py "$OUT/host-overhead-decode.json" decode 2>&1 \
      | grep -v INFO | tail -12
  elif [ "$step" = decode-sweep ]; then
    # SWEEP_FILTER: a glob over the decode suite's case names; SWEEP_CONFIGS: N:STAGES:SPLITS ...
    python scripts/decode_sweep.py "$OUT/decode-sweep.json" "${SWEEP_FILTER:-*}" \
      ${SWEEP_CONFIGS:-} 2>&1 | grep -v INFO | tail -60
  elif [ "$step" = linear-breakdown ]; then
    read -ra pats <<< "${BREAKDOWN_FILTER:-*}"  # read: no glob expansion of a pattern
    filters=()
    for p in "${pats[@]}"; do filters+=(--filter "$p"); done
    python scripts/gpu_precompile.py linear "${filters[@]}" 2>&1 | grep -v INFO | tail -3
    python scripts/linear_breakdown.py "$OUT/linear-breakdown.json" "${BREAKDOWN_FILTER:-*}" \
      ${BREAKDOWN_IMPLS:+"$BREAKDOWN_IMPLS"} 2>&1 | grep --line-buffered -v "INFO\|Warning" \
      | tee "$OUT/linear-breakdown.log" | tail -40
  elif [ "${step%%:*}" = kernel-probe ]; then
    # kernel-probe:SUITE: PROBE_FILTER (patterns), PROBE_ARMS (space-separated arms), PROBE_MODE
    read -ra arms <<< "${PROBE_ARMS:-engine}"
    args=()
    for a in "${arms[@]}"; do args+=(--arm "$a"); done
    python scripts/kernel_probe.py "$OUT/kernel-probe.json" "${step#*:}" "${PROBE_FILTER:-*}" \
      "${args[@]}" --mode "${PROBE_MODE:-fwd+bwd}" --rounds "${PROBE_ROUNDS:-6}" 2>&1 \
      | grep --line-buffered -v "INFO\|Warning" | tee "$OUT/kernel-probe.log" | tail -40
  elif [ "$step" = clock-trace ]; then
    python scripts/clock_trace.py "$OUT/clock-trace.json" 2>&1 | tail -5
  elif [ "$step" = tune-decode ]; then
    tune_suite decode decode "${DECODE_TRIALS:-8}" 420 --tpe \
      --filter "${DECODE_FILTER:-softmax/llama3-8b/b1/s1x131072/bfloat16}"
  elif [ "$step" = tune-linear ]; then
    tune_suite linear linear "${LINEAR_TRIALS:-8}" 500 --tpe \
      --filter "${LINEAR_FILTER:-mamba2/mamba2-2.7b/b8/s2048/bfloat16}"
  elif [ "${step%%:*}" = tune-suite ]; then
    tune_suite "${step#*:}" both 8 380
  else
    suite=${step%%:*}; args=()
    [ "$suite" != "$step" ] && args+=(--impl "${step#*:}")
    read -ra pats <<< "${RUN_FILTER:-}"  # several patterns: space-separated (read: no globbing)
    pre=(); for p in "${pats[@]}"; do pre+=(--filter "$p"); done
    args+=("${pre[@]}")
    if [ -n "${RUN_RESUME:-}" ]; then
      mkdir -p "$OUT/runs" && cp results/runs/"$(date -u +%F)"-*-"$suite".csv "$OUT/runs/" 2>/dev/null
      args+=(--resume)
    fi
    python scripts/gpu_precompile.py "$suite" "${pre[@]}" 2>&1 | grep -v INFO | tail -5
    # an implementation past IMPL_TIMEOUT s on one case (a kernel that never ends) ends the run
    # with its case's rows written, well inside the device call's own limit
    python -m attnbench run suite "$suite" "${args[@]}" --out "$OUT/runs" \
      --impl-timeout "${IMPL_TIMEOUT:-300}" 2>&1 | grep --line-buffered -v INFO > "$OUT/$suite.log"
    tail -4 "$OUT/$suite.log"
  fi
  echo "== $step: $(( $(date +%s) - start ))s"
done
python - "$OUT/runs" <<'PY'
import glob, sys
import pandas as pd
files = glob.glob(sys.argv[1] + "/*.csv")
if files:
    df = pd.concat(pd.read_csv(f) for f in files)
    ok = df[df.status == "ok"]
    t = ok.pivot_table(index=["case", "mode"], columns="impl", values="tflops", aggfunc="last")
    with pd.option_context("display.width", 250, "display.max_rows", 200):
        print(t.round(0).to_string())
        if "tbps" in ok and ok["tbps"].notna().any():  # decode rows: TB/s (schema 3)
            print(ok.pivot_table(index="case", columns="impl", values="tbps",
                                 aggfunc="last").round(2).to_string())
    bad = df[df.status.isin(["failed", "error"])]
    for _, r in bad.iterrows():
        print("FAILED", r.case, r.impl, r["mode"], str(r.reason)[:150])
PY
