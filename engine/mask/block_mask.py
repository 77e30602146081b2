"""create_block_mask: the seeds' (and FlexAttention's) block-mask object."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.dsl.expr import index_leaf
from engine.dsl.io import CustomIO
from engine.dsl.torch_funcs import TensorCapture
from engine.ir.trace import call_hook, trace_mask
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
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: str | torch.device | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    custom_fwd_inputs: CustomIO | None = None,
    custom_tensors: dict[str, torch.Tensor] | None = None,
) -> BlockMask:
    """Trace `mask_mod(b, h, q_idx, kv_idx)` and classify its blocks (no Q_LEN x KV_LEN tensor).

    FlexAttention's signature: B or H None means the mask is the same for every batch or head
    (it must not read b or h then); `device` is accepted for compatibility (the classification
    runs on the CPU). A mask written for FlexAttention may read tensors from its scope
    (document ids): they are captured and their data classify the blocks."""
    B, H = (1 if x is None else x for x in (B, H))
    for name, val in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"create_block_mask: {name}={val!r}: expected a positive int")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise ValueError(f"create_block_mask: device={device!r}: expected a str or torch.device")
    bm, bn = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    captured = TensorCapture()  # first learn which tensors of its scope the mask reads
    with captured.active():
        call_hook("mask_mod", mask_mod, tuple(index_leaf(n) for n in ("b", "h", "q", "kv")))
    decls = dict(custom_fwd_inputs.decls) if custom_fwd_inputs is not None else {}
    decls.update({n: dims for n, (_, dims) in captured.inputs.items()})
    with TensorCapture().active():  # the same tensors, read again under the same names
        expr = trace_mask(mask_mod, CustomIO(decls))
    customs = dict(custom_tensors or {})
    customs.update({n: t.detach().cpu() for n, (t, _) in captured.inputs.items()})
    classes = classify(expr, B, H, Q_LEN, KV_LEN, bm, bn, customs)
    return BlockMask(mask_mod, B, H, Q_LEN, KV_LEN, classes)
