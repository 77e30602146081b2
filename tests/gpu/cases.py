"""The GPU tests' case grid: (variant, dtype, B, Hq, Hkv, Sq, Skv, D, Dv) tuples."""

from __future__ import annotations

import torch

from engine.variants import VARIANTS

BF16, FP16 = torch.bfloat16, torch.float16


def cross_product(head_dims: list[tuple[int, int]]) -> list[tuple]:
    """Every variant x dtype x head dims x GQA ratio (1 and 4) at a length (600) that is not a
    multiple of any block size."""
    return [
        (name, dt, 1, 8, hkv, 600, 600, D, Dv)
        for name in VARIANTS
        for dt in (BF16, FP16)
        for D, Dv in head_dims
        for hkv in (8, 2)
    ]


def case_id(c: tuple) -> str:
    name, dt, B, Hq, Hkv, Sq, Skv, D, Dv = c
    return f"{name}-{'bf16' if dt is BF16 else 'fp16'}-B{B}-H{Hq}x{Hkv}-S{Sq}x{Skv}-D{D}x{Dv}"


def selected_params(request, param: str) -> set:
    """The values of parameter `param` among the session's selected tests of the requesting
    module: a precompile fixture compiles only what will run (under pytest -k, say)."""
    return {item.callspec.params[param] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
            and param in item.callspec.params}
