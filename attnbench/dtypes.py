"""Dtype names: the one table of spellings that suite files and the CLI accept.

Suites name dtypes as torch does (float16, bfloat16, float32); the tuner, tune files and study
names use the short forms (fp16, bf16, fp32). Either spelling is accepted everywhere.
"""

from __future__ import annotations

# Every accepted spelling -> the torch name.
ALIASES: dict[str, str] = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
SHORT: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def dtype_name(text: str) -> str:
    """'bf16', 'bfloat16' -> 'bfloat16' (the torch name); ValueError for an unknown name."""
    name = str(text).strip().lower()
    if name not in ALIASES:
        raise ValueError(f"unknown dtype {text!r}; known dtypes: float16 (fp16), "
                         "bfloat16 (bf16), float32 (fp32)")
    return ALIASES[name]


def short_dtype_name(text: str) -> str:
    """'bfloat16', 'bf16' -> 'bf16' (the tune-file name); ValueError for an unknown name."""
    return SHORT[dtype_name(text)]
