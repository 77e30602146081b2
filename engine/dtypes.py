"""Dtype names: the one table. Every accepted spelling (bf16, bfloat16, torch.bfloat16, ...)
maps to the torch name; tune files, studies and suites' short forms (bf16, fp16, fp32, fp8)
come from it, as do the torch dtypes and element sizes. The harness reads it from here."""

from __future__ import annotations

from typing import Any

import torch

# Every accepted spelling -> the torch name.
ALIASES: dict[str, str] = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn",
}
SHORT: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
                         "float8_e4m3fn": "fp8"}
TORCH: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int8": torch.int8,
}
# The input dtypes the generated kernels take (their TileLang name is the torch name).
KERNEL_DTYPES: dict[torch.dtype, str] = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: Any) -> str:
    """'bf16', 'bfloat16', torch.bfloat16 -> 'bfloat16' (the torch name); ValueError naming
    the known dtypes otherwise."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; known dtypes: float16 (fp16), bfloat16 "
                         "(bf16), float32 (fp32), float8_e4m3fn (fp8)")
    return ALIASES[name]


def short_dtype_name(dtype: Any) -> str:
    """'bfloat16', 'bf16', torch.bfloat16 -> 'bf16' (the tune-file and study name)."""
    return SHORT[dtype_name(dtype)]


def torch_dtype(dtype: Any) -> torch.dtype:
    return TORCH[dtype_name(dtype)]


def elem_bytes(dtype: Any) -> int:
    return torch_dtype(dtype).itemsize
