"""`attnbench --version`: the package, torch, TileLang, nvcc and the GPU, without importing
TileLang or initialising CUDA, and without crashing when a piece is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch

import attnbench
from attnbench import version_info

REPO = Path(__file__).resolve().parents[1]


def test_version_flag_prints_the_stack():
    done = subprocess.run([sys.executable, "-m", "attnbench", "--version"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"attnbench {attnbench.__version__} (checkout {REPO}")
    assert f"torch {torch.__version__} (" in done.stdout
    assert f"tilelang {metadata.version('tilelang')}" in lines
    assert any(line.startswith("nvcc") for line in lines)
    if not torch.cuda.is_available():
        assert lines[-1].startswith("gpu: none")


def test_version_imports_no_tilelang_and_initialises_no_cuda():
    probe = (
        "import json, sys, contextlib, io, torch\n"
        "from attnbench.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--version'])\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "print(json.dumps({'code': code, 'cuda': torch.cuda.is_initialized(),\n"
        "                  'tilelang': any(m.split('.')[0] == 'tilelang' for m in sys.modules)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "cuda": False, "tilelang": False}


class _NoCuda:
    def __getattr__(self, name):
        raise AssertionError(f"torch.cuda.{name} asked on a CPU build")


def _fake_torch(cuda: str | None, gpus: list[tuple[str, tuple[int, int]]] | None = None):
    if cuda is None:
        return SimpleNamespace(__version__="2.13.0+cpu", version=SimpleNamespace(cuda=None),
                               cuda=_NoCuda())
    gpus = gpus or []
    return SimpleNamespace(
        __version__="2.13.0+cu130", version=SimpleNamespace(cuda=cuda),
        cuda=SimpleNamespace(device_count=lambda: len(gpus),
                             get_device_name=lambda i: gpus[i][0],
                             get_device_capability=lambda i: gpus[i][1]),
    )


def test_gpu_line_names_each_device_of_a_cuda_build():
    torch_ = _fake_torch("13.0", [("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA H200", (9, 0))])
    text = version_info.version_text(torch_)
    assert "torch 2.13.0+cu130 (CUDA 13.0)" in text
    assert text.endswith("gpu: cuda:0 NVIDIA H100 80GB HBM3 (sm_90); cuda:1 NVIDIA H200 (sm_90)")
    assert version_info.gpu_line(_fake_torch("13.0", [])) == "gpu: none (no CUDA device visible)"


def test_cpu_build_never_asks_cuda():
    text = version_info.version_text(_fake_torch(None))
    assert "torch 2.13.0+cpu (CPU build)" in text and text.endswith("gpu: none (torch is a CPU build)")


def test_missing_tilelang_and_torch_do_not_crash(monkeypatch):
    real = metadata.version

    def version(dist):
        if dist == "tilelang":
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(version_info.metadata, "version", version)
    lines = version_info.version_text("ModuleNotFoundError: No module named 'torch'").splitlines()
    assert "tilelang: not installed (kernels need it)" in lines
    assert "torch: cannot import (ModuleNotFoundError: No module named 'torch')" in lines
    assert lines[-1] == "gpu: unknown (torch cannot be imported)"


def test_nvcc_line_without_nvcc(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert version_info.nvcc_line().startswith("nvcc: not found")
