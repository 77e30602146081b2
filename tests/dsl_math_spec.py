"""One attention spec that uses every math function and the integer arithmetic of the DSL
(issue 19): smooth functions and rounding in score_mod, // and % on indices in mask_mod. Shared
by the CPU compile test and the GPU tests."""

from __future__ import annotations

import torch

from engine import AttentionEngine, OnlineSoftmax, meta_tensor


def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
    s = score * 0.125
    smooth = (s.sin() + s.cos() + (0.1 * s).tan() + (s * s + 1.0).sqrt() + (s * s + 1.0).rsqrt()
              + s.abs().log1p() + (0.5 * s).expm1() + s.erf() + s.softplus() - 0.1 * s.square())
    rounded = round(2.0 * s) + (3.0 * s).floor() - (s * 0.5).ceil() + (s % 0.75)
    return smooth + 0.01 * rounded + ((q_idx - kv_idx) // 7).float() * 0.01


def mask_mod(b, h, q_idx, kv_idx):
    return (((q_idx - kv_idx) % 3 != 1) | (q_idx // 64 == kv_idx // 64)) & (q_idx >= kv_idx)


def module(dtype: torch.dtype, B: int, Hq: int, Hkv: int, S: int, D: int,
           backend: str = "tilelang") -> AttentionEngine:
    meta = tuple(meta_tensor(B, h, S, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
    return AttentionEngine(meta, score_mod=score_mod, mask_mod=mask_mod,
                           online_func=OnlineSoftmax(), backend=backend)
