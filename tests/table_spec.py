"""Table lookups and index arithmetic (issue 19) in one spec: a learnable relative-position
bias table read at h, q_idx - kv_idx + S - 1, T5-style buckets of |q_idx - kv_idx| into a
learnable (heads, 32) table, and a mask that reads a per-position table at q_idx // 2. Shared
by the CPU compile test and the GPU tests."""

from __future__ import annotations

import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor, where

BUCKETS = 32


def customs(B: int, Hq: int, S: int) -> CustomIO:
    return CustomIO({"rel": ("heads", 2 * S - 1), "t5": ("heads", BUCKETS),
                     "seg": ("batch", (S + 1) // 2)})


def bucket(q_idx, kv_idx):
    """T5's bidirectional buckets, simplified: exact up to 8, then log-spaced up to 128."""
    d = (q_idx - kv_idx).abs()
    far = 8 + ((d.float() / 8.0).log() / 2.772588722239781 * 8.0).floor().long()
    return where(d < 8, d, far.min(BUCKETS // 2 - 1)) + where(q_idx < kv_idx, BUCKETS // 2, 0)


def module(dtype: torch.dtype, B: int, Hq: int, Hkv: int, S: int, D: int,
           backend: str = "tilelang") -> AttentionEngine:
    io = customs(B, Hq, S)

    def score_mod(score, c, b, h, q_idx, kv_idx):
        return score * D**-0.5 + c["rel"][h, q_idx - kv_idx + (S - 1)] \
            + c["t5"][h, bucket(q_idx, kv_idx)]

    def mask_mod(b, h, q_idx, kv_idx):
        # pairs of positions form segments; a query sees its own segment's keys or earlier ones
        return io["seg"][b, q_idx // 2] >= io["seg"][b, kv_idx // 2]

    meta = tuple(meta_tensor(B, h, S, D, dtype=dtype) for h in (Hq, Hkv, Hkv))
    return AttentionEngine(meta, io, score_mod=score_mod, mask_mod=mask_mod,
                           online_func=OnlineSoftmax(), backend=backend)


def inputs(B: int, Hq: int, S: int, device: str, generator: torch.Generator) -> dict:
    """rel and t5 random (learnable), seg a non-decreasing segment id per position pair."""
    g = dict(device=device, generator=generator)
    seg = torch.randint(0, 3, (B, (S + 1) // 2), **g).cumsum(-1).float()
    return {"rel": torch.randn(Hq, 2 * S - 1, **g), "t5": torch.randn(Hq, BUCKETS, **g),
            "seg": seg}


def torch_reference(q, k, v, rel, t5, seg) -> torch.Tensor:
    """The same attention written directly in torch ([B, S, H, D] layout), float64."""
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    qi, ki = torch.arange(S, device=q.device).view(-1, 1), torch.arange(S, device=q.device).view(1, -1)
    d = (qi - ki).abs()
    far = 8 + torch.floor(torch.log(d.double() / 8.0) / 2.772588722239781 * 8.0).long()
    bk = torch.where(d < 8, d, far.clamp(max=BUCKETS // 2 - 1)) + (qi < ki).long() * (BUCKETS // 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(G, 2)) * D**-0.5
    s = s + rel.double()[:, qi - ki + S - 1] + t5.double()[:, bk]
    allowed = seg[:, qi // 2] >= seg[:, ki // 2]  # [B, S, S]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().repeat_interleave(G, 2))
