#!/usr/bin/env bash
# One-step, idempotent set-up of a development environment in .venv (Python >= 3.11, no GPU
# needed). torch is installed first, because anything that depends on torch installed before it
# makes pip fetch PyPI's multi-GB CUDA build. Without a GPU it is the CPU build, from pip's own
# configuration when that already offers one, else from PyTorch's CPU index
# (ATTNBENCH_TORCH_INDEX_URL overrides: scripts/setup_torch.py), and verified afterwards.
# Then this project with its dev tools, and, when the machine has no nvcc, CUDA's compiler from
# PyPI (the "nvcc" extra), linked as .venv/bin/nvcc, so that kernels compile on any machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

install_project() {
  echo "attnbench setup: installing into .venv (one time)" >&2
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VPY" scripts/setup_torch.py install "torch==${ATTNBENCH_TORCH_VERSION:-2.13.0}"
  "$VPY" -m pip install -q -e ".[dev]"
  "$VPY" scripts/setup_torch.py check
}

# nvcc on PATH or under CUDA_HOME is the machine's; .venv/bin/nvcc points at the one used.
ensure_nvcc() {
  if [ -L .venv/bin/nvcc ] && [ ! -e .venv/bin/nvcc ]; then rm .venv/bin/nvcc; fi  # dangling
  if [ -e .venv/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then return 0; fi
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    ln -s "$CUDA_HOME/bin/nvcc" .venv/bin/nvcc
    return 0
  fi
  echo "attnbench setup: no nvcc on this machine: installing CUDA's compiler from PyPI" >&2
  "$VPY" -m pip install -q -e ".[nvcc]"
  ln -s "$("$VPY" -c 'from importlib import metadata
print(next(f.locate() for f in metadata.files("nvidia-cuda-nvcc") if f.name == "nvcc"))')" \
    .venv/bin/nvcc
}

stamp=.venv/.attnbench-setup
want="$(cat pyproject.toml scripts/setup.sh scripts/setup_torch.py | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  install_project
  echo "$want" > "$stamp"
fi
ensure_nvcc
