#!/usr/bin/env bash
# Everything GPU-side in one call (the device tool runs it in the repo root with $OUT set):
# GPU tests, then the benchmark suites; results under $OUT, a short table last.
# Usage: scripts/gpu.sh [tests] [SUITE[:impl,impl]] ...   (default: tests llama3 variants)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT/runs"
if [ -f .gpu/install.sh ]; then source .gpu/install.sh >/dev/null; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export ATTNBENCH_KERNEL_DIR=/tmp/attnbench-kernels TILELANG_CACHE_DIR=/tmp/tilelang-cache
# The generated backward kernels (off by default until verified here; see tilelang_backend).
export ATTNBENCH_KERNEL_BACKWARD=${ATTNBENCH_KERNEL_BACKWARD:-1}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests llama3 variants)
for step in "${steps[@]}"; do
  start=$(date +%s)
  if [ "$step" = tests ]; then
    python -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
  else
    suite=${step%%:*}; impls=""
    [ "$suite" != "$step" ] && impls="--impl ${step#*:}"
    python scripts/gpu_precompile.py "$suite" 2>&1 | grep -v INFO | tail -5
    python -m attnbench run suite "$suite" $impls --out "$OUT/runs" 2>&1 | grep -v INFO > "$OUT/$suite.log"
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
    bad = df[df.status.isin(["failed", "error"])]
    for _, r in bad.iterrows():
        print("FAILED", r.case, r.impl, r["mode"], str(r.reason)[:150])
PY
