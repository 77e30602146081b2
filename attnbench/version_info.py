"""`attnbench --version`: this package's version and what it runs on (torch, TileLang, nvcc, the
GPU). Cheap and safe: TileLang is never imported (its version comes from package metadata, so a
missing or broken TileLang cannot crash it), and CUDA is never asked about unless torch is a CUDA
build (a CPU build has nothing to initialise)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from types import ModuleType

import attnbench
from attnbench.resources import checkout_root


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _import_torch() -> ModuleType | str:
    """torch, or why it cannot be imported."""
    try:
        import torch
    except Exception as exc:  # a broken install (a missing shared library) is not a crash here
        return f"{type(exc).__name__}: {exc}"
    return torch


def torch_line(torch: ModuleType | str) -> str:
    if isinstance(torch, str):
        return f"torch: cannot import ({torch})"
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return f"torch {torch.__version__} ({build})"


def gpu_line(torch: ModuleType | str) -> str:
    if isinstance(torch, str):
        return "gpu: unknown (torch cannot be imported)"
    if not torch.version.cuda:
        return "gpu: none (torch is a CPU build)"
    count = torch.cuda.device_count()  # asks the driver; creates no CUDA context
    if count == 0:
        return "gpu: none (no CUDA device visible)"
    gpus = []
    for i in range(count):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    return "gpu: " + "; ".join(gpus)


def nvcc_line() -> str:
    """The nvcc that TileLang would use first: on PATH, else under CUDA_HOME."""
    path = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if path is None and home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        path = os.path.join(home, "bin", "nvcc")
    if path is None:
        return "nvcc: not found (kernels cannot be compiled here; scripts/setup.sh installs one)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvcc: {path} (does not run: {exc})"
    release = re.search(r"release ([\d.]+)", out)
    return f"nvcc {release.group(1) if release else '(unknown release)'} ({path})"


def version_text(torch: ModuleType | str | None = None) -> str:
    """The lines `attnbench --version` prints; `torch` is for tests (default: import it)."""
    torch = _import_torch() if torch is None else torch
    root = checkout_root()
    where = f"checkout {root}" if root else f"installed at {os.path.dirname(attnbench.__file__)}"
    tilelang = _dist_version("tilelang")
    return "\n".join([
        f"attnbench {attnbench.__version__} ({where})",
        f"python {platform.python_version()}",
        torch_line(torch),
        f"tilelang {tilelang}" if tilelang else "tilelang: not installed (kernels need it)",
        nvcc_line(),
        gpu_line(torch),
    ])
