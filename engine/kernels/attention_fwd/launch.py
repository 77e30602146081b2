"""Build and launch the forward kernel: its source and block tables at a config, compiled on
first use, called with the mask's tables and freshly allocated outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.ir.spec import TracedSpec
from engine.kernels.attention_fwd.codegen import generate_forward
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.runtime.compile import compile_source
from engine.runtime.mask_tables import MaskTables, forward_layout


@dataclass
class ForwardKernel:
    shape: KernelShape
    config: KernelConfig
    source: str
    tables: MaskTables
    final_names: tuple[str, ...] = ()
    kernel: Any = None

    def sources(self) -> list[str]:
        return [self.source]

    def compiled(self) -> Any:
        if self.kernel is None:
            self.kernel = compile_source(self.source)
        return self.kernel


def build_forward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> ForwardKernel:
    """The forward kernel of `spec` at `shape` and `cfg`, generated (not compiled)."""
    tables = MaskTables(spec.mask, shape, cfg.block_M, cfg.block_N, forward_layout)
    return ForwardKernel(shape, cfg, generate_forward(spec, shape, cfg), tables,
                         tuple(spec.final_names))


def launch_forward(fk: ForwardKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   custom: dict[str, torch.Tensor], poison: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(o, finals) of the forward kernel; `custom` the CustomIO tensors by name, in declaration
    order. `poison` fills the outputs with NaN first (tests: every element must be written)."""
    lo, hi, cls = fk.tables.get(custom, q.device)
    s = fk.shape
    fill = (lambda *d, dtype: torch.full(d, float("nan"), dtype=dtype, device=q.device)) if poison \
        else (lambda *d, dtype: torch.empty(d, dtype=dtype, device=q.device))
    o = fill(s.batch, s.seqlen_q, s.heads_q, s.head_dim_v, dtype=q.dtype)
    finals = [fill(s.batch, s.heads_q, s.seqlen_q, dtype=torch.float32) for _ in fk.final_names]
    c32 = [t.detach().float().contiguous() for t in custom.values()]
    fk.compiled()(q.contiguous(), k.contiguous(), v.contiguous(), *c32, lo, hi, cls, o, *finals)
    return o, finals
