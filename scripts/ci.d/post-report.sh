#!/usr/bin/env bash
# Run by scripts/test.sh after pytest (with .venv on PATH): build the dashboard from results/runs
# (and results/local, if this machine has one) into artifacts/dashboard/, then gate the newest
# committed H100 run of each suite against results/baseline/h100.csv.
# Fails CI on a regression beyond the threshold and the runs' noise, on an engine row of the
# baseline that is absent from the newest run (a run cut short), and on an empty run.
# --nothing-to-gate-ok: with no committed H100 run or no baseline yet it says so and passes;
# it never excuses missing rows (a run filtered on purpose is gated with --allow-missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m attnbench report --results results --out artifacts/dashboard
python -m attnbench compare --against-baseline --gpu h100 --results results --same-run \
  --nothing-to-gate-ok \
  --markdown artifacts/dashboard/gate.md
