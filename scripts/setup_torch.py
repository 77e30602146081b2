"""torch for scripts/setup.sh: where to install it from, and whether the installed build fits
this machine. Run with the environment's own python (stdlib only; torch may not be there yet).

    python scripts/setup_torch.py install torch==2.13.0  # unless torch is there already
    python scripts/setup_torch.py index torch==2.13.0    # print the extra index it would use
    python scripts/setup_torch.py check                  # exit 1 if torch is a CUDA build on
                                                         # a machine with no NVIDIA GPU

The index: ATTNBENCH_TORCH_INDEX_URL when set ("" = pip's own configuration only). Unset, on a
machine with an NVIDIA GPU: pip's configuration (PyPI's torch is the CUDA build). Without a GPU:
pip's configuration when it already yields a CPU build (a "+cpu" version, as a local wheel folder
may hold), else PyTorch's CPU index. It is given to pip as --extra-index-url: a build there
("2.13.0+cpu") outranks PyPI's plain "2.13.0", and torch's dependencies still come from PyPI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_VAR = "ATTNBENCH_TORCH_INDEX_URL"


def has_gpu() -> bool:
    """An NVIDIA GPU with a loaded driver (asked of nvidia-smi and the driver; never of CUDA)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU " in out.stdout


def pip_resolves(requirement: str) -> str | None:
    """The version pip's own configuration would install for `requirement`, or None."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
           "--quiet", "--report", "-", requirement]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return json.loads(out.stdout)["install"][0]["metadata"]["version"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        return None


def choose_index(env_value: str | None, gpu: bool, resolved: Callable[[], str | None]) -> str:
    """The extra index URL for torch ("" = none); `resolved` is asked only when it matters."""
    if env_value is not None:
        return env_value
    if gpu:
        return ""
    version = resolved() or ""
    return "" if version.endswith("+cpu") else CPU_INDEX


def build_problem(version: str, cuda: str | None, gpu: bool) -> str | None:
    """Why this torch build does not fit the machine, or None."""
    if cuda is None or gpu:
        return None
    return (
        f"torch {version} is a CUDA {cuda} build, but this machine has no NVIDIA GPU: it needs "
        f"the CPU build (the CUDA one is gigabytes that cannot run here). Fix: rm -rf .venv && "
        f"{INDEX_VAR}={CPU_INDEX} scripts/setup.sh"
    )


def index_for(requirement: str) -> str:
    return choose_index(os.environ.get(INDEX_VAR), has_gpu(), lambda: pip_resolves(requirement))


def install(requirement: str) -> int:
    if importlib.util.find_spec("torch") is not None:
        return 0
    index = index_for(requirement)
    print(f"attnbench setup: {requirement} from {index or 'pip configured indexes'}",
          file=sys.stderr)
    extra = ["--extra-index-url", index] if index else []
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", *extra, requirement]).returncode


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "install":
        return install(argv[1])
    if len(argv) == 2 and argv[0] == "index":
        print(index_for(argv[1]))
        return 0
    if argv == ["check"]:
        import torch

        problem = build_problem(torch.__version__, torch.version.cuda, has_gpu())
        if problem:
            print(f"setup.sh: {problem}", file=sys.stderr)
            return 1
        return 0
    print("usage: setup_torch.py install|index REQUIREMENT | check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
