"""KernelShape: the static sizes a generated kernel (forward or backward) is compiled for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.mask.analysis import table_dims

KERNEL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class KernelShape:
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str  # "float16" | "bfloat16"
    mask_batch: int  # leading dims of the block tables (1 when the mask ignores b / h)
    mask_heads: int

    @classmethod
    def of(cls, mod: Any) -> KernelShape:
        """The shape of an AttentionEngine module (its problem, dtype and mask)."""
        p = mod.problem
        if mod.dtype not in KERNEL_DTYPES:
            raise ValueError(f"dtype {mod.dtype}: kernels support float16 and bfloat16")
        mb, mh = table_dims(mod.spec.mask, p.batch, p.heads_q)
        return cls(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim,
                   p.head_dim_v, KERNEL_DTYPES[mod.dtype], mb, mh)
