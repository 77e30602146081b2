"""scripts/setup.sh's torch: the CPU build wherever pip's configuration does not already offer one
(scripts/setup_torch.py index), and a clear failure when a CUDA build lands on a machine with no
GPU (scripts/setup_torch.py check)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.script_module import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "setup_torch.py"

setup_torch = load_script("setup_torch")


def _never():
    raise AssertionError("pip asked although the answer was already known")


def test_index_variable_wins_even_empty():
    url = "https://download.pytorch.org/whl/cu130"
    assert setup_torch.choose_index(url, gpu=False, resolved=_never) == url
    assert setup_torch.choose_index("", gpu=False, resolved=_never) == ""


def test_without_gpu_the_cpu_index_unless_pip_already_offers_a_cpu_build():
    cpu = setup_torch.CPU_INDEX
    assert cpu == "https://download.pytorch.org/whl/cpu"
    assert setup_torch.choose_index(None, gpu=False, resolved=lambda: "2.13.0+cpu") == ""
    assert setup_torch.choose_index(None, gpu=False, resolved=lambda: "2.13.0") == cpu
    assert setup_torch.choose_index(None, gpu=False, resolved=lambda: None) == cpu
    assert setup_torch.choose_index(None, gpu=True, resolved=_never) == ""


def test_a_cuda_build_without_gpu_is_a_problem():
    msg = setup_torch.build_problem("2.13.0+cu130", "13.0", gpu=False)
    assert "torch 2.13.0+cu130 is a CUDA 13.0 build, but this machine has no NVIDIA GPU" in msg
    assert "ATTNBENCH_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh" in msg
    assert setup_torch.build_problem("2.13.0+cpu", None, gpu=False) is None
    assert setup_torch.build_problem("2.13.0+cu130", "13.0", gpu=True) is None


def _no_gpu_env(tmp_path: Path, **extra: str) -> dict:
    if setup_torch.has_gpu():
        pytest.skip("this machine has an NVIDIA GPU")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "ATTNBENCH_")) and k != "PYTHONPATH"}
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    env["PATH"] = str(bare)  # no nvidia-smi
    env.update(extra)
    return env


def _fake_torch(root: Path, cuda: str | None) -> Path:
    pkg = root / "torch"
    (pkg / "version").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"__version__ = {'2.13.0+cu130' if cuda else '2.13.0+cpu'!r}\nfrom torch import version\n")
    (pkg / "version" / "__init__.py").write_text(f"cuda = {cuda!r}\n")
    return root


@pytest.mark.parametrize("cuda", ["13.0", None])
def test_check_fails_on_a_cuda_build_without_gpu(cuda, tmp_path):
    env = _no_gpu_env(tmp_path, PYTHONPATH=str(_fake_torch(tmp_path / "site", cuda)))
    done = subprocess.run([sys.executable, SCRIPT, "check"], env=env, capture_output=True,
                          text=True, timeout=60)
    if cuda is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 1
        assert done.stderr.startswith("setup.sh: torch 2.13.0+cu130 is a CUDA 13.0 build")


def _fake_wheel(folder: Path, version: str) -> None:
    folder.mkdir(exist_ok=True)
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.mark.parametrize("offered,expected", [("2.13.0+cpu", ""),
                                              ("2.13.0", "https://download.pytorch.org/whl/cpu")])
def test_index_asks_pip_what_its_configuration_offers(offered, expected, tmp_path):
    _fake_wheel(tmp_path / "wheels", offered)
    env = _no_gpu_env(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
                      PIP_FIND_LINKS=str(tmp_path / "wheels"))
    done = subprocess.run([sys.executable, SCRIPT, "index", "torch==2.13.0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
