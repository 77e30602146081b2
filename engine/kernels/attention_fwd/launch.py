"""Build and launch the forward kernel: its source and block tables at a config, compiled on
first use, called by name with the mask's tables and freshly allocated outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ir.spec import TracedSpec
from engine.kernels.attention_fwd import walk
from engine.kernels.attention_fwd.codegen import generate_forward
from engine.kernels.attention_fwd.plan import walks_full_run
from engine.plan.config import KernelConfig
from engine.plan.fold import row_fold
from engine.plan.shape import KernelShape
from engine.runtime.kernel import Kernel
from engine.runtime.mask_tables import (
    FORWARD_TABLES,
    WS_FORWARD_TABLES,
    MaskTables,
    forward_layout,
    ws_forward_layout,
)


@dataclass
class ForwardKernel:
    shape: KernelShape
    config: KernelConfig
    kernel: Kernel
    tables: MaskTables
    final_names: tuple[str, ...] = ()
    tiled: KernelShape | None = None  # the shape the kernel tiles, where it folds the rows

    @property
    def source(self) -> str:
        return self.kernel.source

    def sources(self) -> list[str]:
        return [self.source]

    def compile(self) -> None:
        self.kernel.compiled()


def build_forward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> ForwardKernel:
    """The forward kernel of `spec` at `shape` and `cfg`, generated (not compiled)."""
    fold = row_fold(spec, shape)
    kspec, tiled = (fold.spec, fold.tiled) if fold else (spec, shape)
    layout, names = (ws_forward_layout, WS_FORWARD_TABLES) if walks_full_run(kspec, tiled, cfg) \
        else (forward_layout, FORWARD_TABLES)
    extra = None
    if walk.walks_table(kspec, tiled, cfg):
        blocks, _ = walk.static_blocks(tiled, cfg.block_M)
        key_blocks = -(-tiled.seqlen_kv // cfg.block_N)
        extra, names = walk.WalkTable(tiled, blocks, key_blocks), (*names, "Walk")
    tables = MaskTables(kspec.mask, tiled, cfg.block_M, cfg.block_N, layout, names,
                        fold.stride if fold else 1, extra=extra)
    return ForwardKernel(shape, cfg, Kernel(generate_forward(spec, shape, cfg)), tables,
                         tuple(spec.final_names), tiled if fold else None)


def launch_forward(fk: ForwardKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   custom: dict[str, torch.Tensor], poison: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(o, finals) of the forward kernel; `custom` the CustomIO tensors by name. `poison`
    fills the outputs with NaN first (tests: every element must be written)."""
    s, dev = fk.shape, q.device
    fill = (lambda *d, dtype: torch.full(d, float("nan"), dtype=dtype, device=dev)) if poison \
        else (lambda *d, dtype: torch.empty(d, dtype=dtype, device=dev))
    o = fill(s.batch, s.seqlen_q, s.heads_q, s.head_dim_v, dtype=q.dtype)
    finals = {f"F_{n}": fill(s.batch, s.heads_q, s.seqlen_q, dtype=torch.float32)
              for n in fk.final_names}
    q, k, v, o_k = q.contiguous(), k.contiguous(), v.contiguous(), o
    if fk.tiled is not None:  # a folded kernel: [B, S, H, D] viewed as its rows and heads
        ts = fk.tiled
        q, o_k = (x.view(ts.batch, ts.seqlen_q, ts.heads_q, -1) for x in (q, o))
        k, v = (x.view(ts.batch, ts.seqlen_kv, ts.heads_kv, -1) for x in (k, v))
    fk.kernel(Q=q, K=k, V=v,
              **{f"C_{n}": t.detach().float().contiguous() for n, t in custom.items()},
              **fk.tables.named(custom, dev), O=o_k, **finals)
    return o, list(finals.values())
