#!/usr/bin/env bash
# The project's test command (README quickstart; .ci/run calls exactly this).
# Sets up .venv, starts what the tests need (scripts/ci.d/pre-*.sh: e.g. a PostgreSQL server,
# headless Chromium), runs ruff and the CPU test suite, then the post steps (scripts/ci.d/post-*.sh:
# e.g. the regression gate and the dashboard build). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
for f in scripts/ci.d/pre-*.sh; do [ -e "$f" ] && source "$f"; done
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
