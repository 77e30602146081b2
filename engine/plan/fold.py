"""Dilated masks as more heads over shorter rows (the forward's and the backward's plans).

Where a mask says `(q_idx - kv_idx) % d == 0` (engine.mask.congruence), query i*d + r meets
keys j*d + r only: each residue r is an attention of its own over rows and keys d times
shorter. A kernel then runs d times as many heads: head y is query head y % Hq of residue
y // Hq. Q [B, S, Hq, D] viewed as [B, S / d, d * Hq, D] (no copy) holds exactly those rows
at head y, and K and V likewise at kv head y // G, so the kernels tile the folded shape as
they tile any other, and only the positions and the head that the spec reads change.
"""

from __future__ import annotations

import dataclasses
import os

from engine.ir.spec import TracedSpec
from engine.mask.analysis import mask_reads, reads_data
from engine.mask.congruence import congruence
from engine.plan.shape import KernelShape

# On by default; ATTNBENCH_FOLD_ROWS=0 turns it off (to measure what it gains).
FOLD_ROWS = os.environ.get("ATTNBENCH_FOLD_ROWS", "1") == "1"


@dataclasses.dataclass(frozen=True)
class RowFold:
    """`spec` without the congruence (the mask the tiles evaluate), `tiled` the shape the
    kernels tile (`stride` times the heads, rows `stride` times shorter)."""

    stride: int
    spec: TracedSpec
    tiled: KernelShape

    @property
    def heads_q(self) -> int:
        """The problem's query heads."""
        return self.tiled.heads_q // self.stride

    def position(self, row: str, head: str) -> str:
        """The text of the position of tile row `row` of folded head `head`."""
        return f"({row} * {self.stride} + {head} // {self.heads_q})"

    def head_of(self, head: str) -> str:
        """The text of the problem's query head of folded head `head`."""
        return f"{head} % {self.heads_q}"


def index_texts(fold: RowFold | None, q_row: str, kv_row: str, head: str
                ) -> tuple[str, str, str]:
    """The texts of the query position, the key position and the query head that a
    kernel's tile element reads, from its rows' and its head's (the same without a fold)."""
    if fold is None:
        return q_row, kv_row, head
    return fold.position(q_row, head), fold.position(kv_row, head), fold.head_of(head)


def row_fold(spec: TracedSpec, shape: KernelShape) -> RowFold | None:
    """The fold of a dilated mask, where its lengths divide by the stride and its block tables
    need no per-batch, per-head or data rows (None: no fold)."""
    c = congruence(spec.mask) if FOLD_ROWS and not shape.dynamic else None
    if c is None or shape.seqlen_q % c.stride or shape.seqlen_kv % c.stride \
            or reads_data(spec.mask) or mask_reads(spec.mask, "b") or mask_reads(spec.mask, "h"):
        return None
    d = c.stride
    tiled = dataclasses.replace(shape, seqlen_q=shape.seqlen_q // d,
                                seqlen_kv=shape.seqlen_kv // d, heads_q=shape.heads_q * d,
                                heads_kv=shape.heads_kv * d)
    return RowFold(d, dataclasses.replace(spec, mask=c.rest), tiled)
