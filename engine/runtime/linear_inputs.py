"""LinearAttentionEngine's argument checks: the meta tensors, and one call's q, k, v, decay,
initial state and packed-sequence offsets (the offsets' values too: a host synchronisation).
Each error names the argument and what was expected."""

from __future__ import annotations

from typing import Any

import torch

from engine.problem import LinearProblem
from engine.runtime.arg_checks import check_meta_tensors, check_placement, expect_tensor
from engine.runtime.persistent import capturing

LAYOUT = "runtime layout [B, H, T, D]"


def check_linear_meta(qkv_meta: Any) -> tuple[LinearProblem, torch.dtype]:
    dtype = check_meta_tensors(qkv_meta, "B, H, T, D")
    (B, HQ, T, D), (Bk, HK, Tk, Dk), (Bv, H, Tv, Dv) = (tuple(t.shape) for t in qkv_meta)
    if not B == Bk == Bv:
        raise ValueError(f"qkv_meta: batch sizes differ (q {B}, k {Bk}, v {Bv})")
    if not T == Tk == Tv:
        raise ValueError(f"qkv_meta: lengths differ (q {T}, k {Tk}, v {Tv})")
    if Dk != D:
        raise ValueError(f"qkv_meta: k head dim {Dk} != q head dim {D}")
    for name, h in (("q", HQ), ("k", HK)):
        if H % h:
            raise ValueError(f"qkv_meta: {name} heads {h} must divide v's heads {H} (each "
                             f"group of H // H{name.upper()} output heads reads one {name} head)")
    return LinearProblem(B, HQ, HK, H, T, D, Dv), dtype


def check_linear_args(p: LinearProblem, dtype: torch.dtype, q: Any, k: Any, v: Any, decay: Any,
                      initial_state: Any, cu_seqlens: Any) -> tuple[int, int]:
    """(B, T) of a call (q's), after checking every tensor argument against the module's
    problem; ValueError/TypeError naming the argument otherwise."""
    q = expect_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q: shape {tuple(q.shape)}; expected 4 dims (B, HQ, T, D) ({LAYOUT})")
    B, T = q.shape[0], q.shape[2]
    want = {"q": (B, p.heads_q, T, p.head_dim), "k": (B, p.heads_k, T, p.head_dim),
            "v": (B, p.heads, T, p.head_dim_v)}
    for name, t in (("q", q), ("k", k), ("v", v)):
        t = expect_tensor(name, t)
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}; expected {want[name]} ({LAYOUT}; "
                             "heads and head dims from qkv_meta, B and T from q)")
        check_placement(name, t, dtype, q.device)
    _check_float32("decay", decay, (B, p.heads, T), q.device, "[B, H, T] log decays or the "
                   "decay_mod's input")
    N = _check_offsets(cu_seqlens, B, q.device)
    if initial_state is not None:
        _check_float32("initial_state", initial_state, (N, p.heads, p.head_dim, p.head_dim_v),
                       q.device, "[N, H, D, Dv], N the batch or the number of sequences")
    return B, T


def _check_float32(name: str, t: Any, want: tuple, device: torch.device, what: str) -> None:
    t = expect_tensor(name, t)
    if tuple(t.shape) != want:
        raise ValueError(f"{name}: shape {tuple(t.shape)}; expected {want} ({what})")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: dtype {t.dtype}; expected torch.float32")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}; expected {device} (the device of q)")


def _check_offsets(cu_seqlens: Any, B: int, device: torch.device) -> int:
    """The number of sequences: B, or N for cu_seqlens int32 [N + 1] (then B must be 1)."""
    if cu_seqlens is None:
        return B
    t = expect_tensor("cu_seqlens", cu_seqlens)
    if t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2 or t.device != device:
        raise ValueError(f"cu_seqlens: {t.dtype} {tuple(t.shape)} on {t.device}; expected "
                         f"torch.int32 (N + 1,) with N >= 1 on {device} (sequence offsets)")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch 1, got q with batch {B} "
                         "(pack the sequences along T)")
    return t.numel() - 1


def check_offset_values(cu_seqlens: torch.Tensor, T: int) -> None:
    """cu_seqlens starts at 0, ends at T and never decreases (reads the values back: a host
    synchronisation, skipped while a CUDA graph is captured)."""
    if capturing(cu_seqlens.device):
        return
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != T:
        raise ValueError(f"cu_seqlens: runs {first}..{last}; expected 0..{T} (T, q's length)")
    drops = (cu_seqlens[1:] < cu_seqlens[:-1]).nonzero()
    if drops.numel():
        i = int(drops[0])
        raise ValueError(f"cu_seqlens: decreases at entry {i + 1} ({int(cu_seqlens[i])} -> "
                         f"{int(cu_seqlens[i + 1])}); expected non-decreasing offsets")
