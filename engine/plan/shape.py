"""KernelShape: the problem a generated kernel (forward or backward) is compiled for, with its
dtype and the mask tables' layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.dsl.expr import Expr
from engine.dtypes import KERNEL_DTYPES
from engine.mask.analysis import mask_reads, table_dims
from engine.problem import SIZE_KEYS, Problem


@dataclass(frozen=True, kw_only=True)
class KernelShape(Problem):
    dtype: str  # "float16" | "bfloat16"
    mask_batch: int  # leading dims of the block tables (1 when the mask ignores b / h)
    mask_heads: int
    # Batch and sequence lengths as runtime symbols (B, Sq, Skv) rather than constants: one
    # compiled kernel then serves every length (the sizes above still drive the mask tables).
    dynamic: bool = False
    mask_by_batch: bool = False  # the mask reads b: its tables have a batch dim (B when dynamic)

    @classmethod
    def for_problem(cls, p: Problem, dtype: torch.dtype, mask: Expr | None,
                    dynamic: bool = False) -> KernelShape:
        """The shape of problem `p` in `dtype` with `mask` (the spec's)."""
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"dtype {dtype}: kernels support float16 and bfloat16")
        mb, mh = table_dims(mask, p.batch, p.heads_q)
        return cls(**{k: getattr(p, k) for k in SIZE_KEYS}, dtype=KERNEL_DTYPES[dtype],
                   mask_batch=mb, mask_heads=mh, dynamic=bool(dynamic),
                   mask_by_batch=mask_reads(mask, "b"))

    @classmethod
    def of(cls, mod: Any) -> KernelShape:
        """The shape of an AttentionEngine module (its problem, dtype, mask and dynamic
        shapes)."""
        return cls.for_problem(mod.problem, mod.dtype, mod.spec.mask,
                               bool(getattr(mod, "dynamic_shapes", False)))

    # Texts of the sizes in generated source: symbols when dynamic, else constants.
    @property
    def b_text(self) -> str:
        return "B" if self.dynamic else str(self.batch)

    @property
    def sq_text(self) -> str:
        return "Sq" if self.dynamic else str(self.seqlen_q)

    @property
    def skv_text(self) -> str:
        return "Skv" if self.dynamic else str(self.seqlen_kv)

    @property
    def dim_sizes(self) -> dict[str, int | str]:
        """The extents of CustomIO's named dims: numbers, or the symbols of a dynamic shape."""
        if not self.dynamic:
            return self.named_sizes()
        return {**self.named_sizes(), "batch": self.b_text, "seq_len": self.sq_text,
                "seq_len_kv": self.skv_text}

    @property
    def mask_batch_text(self) -> str:
        """The block tables' batch dim (B, whatever B is, when dynamic and per batch)."""
        return "B" if self.dynamic and self.mask_by_batch else str(self.mask_batch)

    @property
    def mask_batch_index(self) -> str:
        """How a thread block indexes the tables' batch dim: its batch, or 0 if shared."""
        return "bz" if self.mask_batch > 1 or (self.dynamic and self.mask_by_batch) else "0"

    def last_text(self, axis: str) -> str:
        """The last valid query ("q") or key ("kv") position, as source text."""
        if self.dynamic:
            return f"{self.sq_text if axis == 'q' else self.skv_text} - 1"
        return str((self.seqlen_q if axis == "q" else self.seqlen_kv) - 1)

    def blocks_text(self, length_text: str, length: int, block: int) -> str:
        """The number of `block`-sized blocks covering a length, as source text (a grid
        extent; block tables take their own symbols, see table_blocks_text)."""
        if self.dynamic:
            return f"T.ceildiv({length_text}, {block})"
        return str(-(-length // block))

    def table_blocks_text(self, axis: str, length: int, block: int) -> str:
        """A block table's dim: its own symbol when dynamic (NQB/NKB for the query/key axis),
        so that every tensor dim binds to a plain symbol at launch."""
        if self.dynamic:
            return "NQB" if axis == "q" else "NKB"
        return str(-(-length // block))

    @property
    def preamble(self) -> str:
        """The module-level source line that declares the symbols (empty when static)."""
        if not self.dynamic:
            return ""
        return 'B, Sq, Skv, NQB, NKB = T.dynamic("B, Sq, Skv, NQB, NKB")'
