#!/usr/bin/env bash
# Run by scripts/test.sh after pytest (with .venv on PATH): build the dashboard from the committed
# results into artifacts/dashboard/, then gate the newest H100 run of each suite against
# results/baseline/h100.csv. No committed H100 run or no baseline yet: says so and passes.
# A regression beyond the threshold (and the runs' noise) exits non-zero and fails CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m attnbench report --results results --out artifacts/dashboard
python -m attnbench compare --against-baseline --gpu h100 --results results --missing-ok \
  --markdown artifacts/dashboard/gate.md
