#!/usr/bin/env bash
# The project's test command (README quickstart; .ci/run calls exactly this).
# Sets up .venv (scripts/setup.sh: torch, the project, nvcc when the machine has none), starts
# what the tests need (scripts/ci.d/pre-*.sh: e.g. a PostgreSQL server, headless Chromium; what
# they start is stopped on exit, scripts/ci.d/on-exit.sh), runs ruff and the CPU test suite (with
# the nvcc compiles of the kernels and a wheel installed into a fresh venv), then the post steps
# (scripts/ci.d/post-*.sh: e.g. the regression gate and the dashboard build). Extra arguments go
# to pytest. Under CI=true a skipped compile test fails the run (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
source scripts/ci.d/on-exit.sh
for f in scripts/ci.d/pre-*.sh; do [ -e "$f" ] && source "$f"; done
echo "test.sh: $(attnbench --version | grep -E '^(torch|nvcc)' | paste -sd ';' -)" >&2
ruff check .
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exit 5 means no test ran: that is a failure, never a silent pass.
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
[ "$rc" -eq 0 ] || exit "$rc"
for f in scripts/ci.d/post-*.sh; do [ -e "$f" ] && bash "$f"; done
echo "test.sh: all checks passed"
