"""What the TileLang backend needs from the machine, and a clear message when it is missing."""

from __future__ import annotations

import functools
import shutil

import torch


def hopper_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when TileLang kernels can run here; otherwise the reason they cannot."""
    if device.type != "cuda":
        return f"tensors are on {device.type}, kernels need a CUDA Hopper GPU"
    return _cuda_problem(device, dtype)


@functools.lru_cache(maxsize=64)  # asked on every module call
def choose_backend(requested: str, device: torch.device, dtype: torch.dtype
                   ) -> tuple[str, str | None]:
    """(backend, fallback) for `requested` ("auto", "reference" or "tilelang") on `device`:
    "tilelang" where the kernels can run, a RuntimeError where they were asked for and cannot,
    and for "auto" elsewhere "reference" with `fallback` the reason (the caller logs it)."""
    if requested == "reference":
        return "reference", None
    reason = hopper_problem(device, dtype)
    if requested == "tilelang" and reason is not None:
        raise RuntimeError(f"backend='tilelang' cannot run here: {reason}")
    return ("tilelang", None) if reason is None else ("reference", reason)


@functools.lru_cache(maxsize=64)
def _cuda_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    # once per (device, dtype): querying the capability was ~20 us of every module call
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return f"GPU {name} is sm_{major}{minor}; kernels target sm_90a (H100/H200)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: kernels support float16 and bfloat16"
    return None


def require_nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        import os

        for cand in ("/usr/local/cuda/bin/nvcc",):
            if os.path.exists(cand):
                return cand
        raise RuntimeError(
            "nvcc not found: the TileLang backend compiles kernels with CUDA's nvcc "
            "(install the CUDA toolkit or put nvcc on PATH)"
        )
    return path


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (decode sizes its key splits by them)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
