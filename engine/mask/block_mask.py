"""create_block_mask: the seeds' (and FlexAttention's) block-mask object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.dsl.io import CustomIO
from engine.ir.trace import trace_mask
from engine.mask.analysis import EMPTY, FULL, PARTIAL, BlockClasses, classify


@dataclass(frozen=True)
class BlockMask:
    """A mask function plus its block classification for one problem size.

    Pass it to AttentionEngine as `block_mask=` (or pass the function as `mask_mod=`).
    """

    mask_mod: Callable
    batch: int
    heads: int
    seqlen_q: int
    seqlen_kv: int
    block_classes: BlockClasses

    @property
    def classes(self) -> torch.Tensor:
        return self.block_classes.classes

    def counts(self) -> dict[str, int]:
        c = self.classes
        return {
            "empty": int((c == EMPTY).sum()),
            "partial": int((c == PARTIAL).sum()),
            "full": int((c == FULL).sum()),
        }

    def sparsity(self) -> float:
        """Fraction of blocks skipped."""
        return 1.0 - self.block_classes.density()

    def __repr__(self) -> str:
        return (
            f"BlockMask(B={self.batch}, H={self.heads}, Sq={self.seqlen_q}, Skv={self.seqlen_kv}, "
            f"block={self.block_classes.block_M}x{self.block_classes.block_N}, {self.counts()})"
        )


def create_block_mask(
    mask_mod: Callable,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    custom_fwd_inputs: CustomIO | None = None,
    custom_tensors: dict[str, torch.Tensor] | None = None,
) -> BlockMask:
    """Trace `mask_mod(b, h, q_idx, kv_idx)` and classify its blocks (no Q_LEN x KV_LEN tensor)."""
    for name, val in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"create_block_mask: {name}={val!r}: expected a positive int")
    bm, bn = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    expr = trace_mask(mask_mod, custom_fwd_inputs)
    classes = classify(expr, B, H, Q_LEN, KV_LEN, bm, bn, custom_tensors)
    return BlockMask(mask_mod, B, H, Q_LEN, KV_LEN, classes)
