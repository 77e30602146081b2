"""The environment a result row was measured in: gpu, driver, cuda, torch, triton, tilelang,
git sha. Versions come from package metadata (no heavy imports); missing pieces read "".
"""

from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def git_sha() -> str:
    """HEAD's sha, with "-dirty" when tracked files changed; "" outside git or with no commit.
    ATTNBENCH_GIT_SHA overrides it: a copy of the tree on another machine (scripts/gpu.sh on the
    device) may carry a stale .git, so the sender states the commit it sent."""
    if os.environ.get("ATTNBENCH_GIT_SHA"):
        return os.environ["ATTNBENCH_GIT_SHA"]
    sha = _run(["git", "rev-parse", "HEAD"])
    if sha and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        sha += "-dirty"
    return sha


@functools.cache
def environment(device: str) -> dict[str, str]:
    """Columns gpu, driver, cuda, torch, triton, tilelang, git_sha for `device` (cpu|cuda)."""
    import torch

    env = {
        "gpu": "cpu", "driver": "", "cuda": torch.version.cuda or "",
        "torch": torch.__version__, "triton": _version("triton"),
        "tilelang": _version("tilelang"), "git_sha": git_sha(),
    }
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        lines = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = lines.splitlines()[0] if lines else ""
    return env
