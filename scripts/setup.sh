#!/usr/bin/env bash
# One-step, idempotent set-up of a development environment in .venv (Python >= 3.11, no GPU
# needed). torch is installed first, as the local CPU build (torch==2.13.0), because anything
# that depends on torch installed before it makes pip fetch the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.attnbench-setup
want="$(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "attnbench setup: installing into .venv (one time)" >&2
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==${ATTNBENCH_TORCH_VERSION:-2.13.0}"
fi
"$VPY" -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
