"""The TileLang backend: generated forward kernels behind a torch.autograd.Function.

The backward runs the reference executor's rules on the GPU (materialised in row chunks)
until generated backward kernels land."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.codegen.forward import generate_forward
from engine.mask.analysis import BlockClasses
from engine.plan.config import KernelConfig, check_config
from engine.plan.defaults import default_forward_config
from engine.plan.shape import KERNEL_DTYPES, KernelShape
from engine.runtime.compile import compile_source
from engine.runtime.mask_tables import MaskTables
from engine.runtime.reference_backend import GRAD_ANCHOR, reference_backward

log = logging.getLogger("engine")
# Tests set this to fill outputs with NaN before each launch, to prove every element is written.
POISON_OUTPUTS = False


@dataclass
class ForwardKernel:
    shape: KernelShape
    config: KernelConfig
    source: str
    tables: MaskTables
    kernel: Any = None

    def compiled(self) -> Any:
        if self.kernel is None:
            self.kernel = compile_source(self.source)
        return self.kernel


@dataclass
class Kernels:
    forward: ForwardKernel

    @property
    def forward_source(self) -> str:
        return self.forward.source


def _select_config(mod) -> KernelConfig:
    p = mod.problem
    if mod.config is not None:
        return check_config(mod.config, p.head_dim, p.head_dim_v)
    # The tune file named by the user, else the default one for this GPU
    # (results/tune/<gpu>/attention_fwd.json); a missing or unreadable file means defaults.
    from engine.tuning.tune_file import lookup

    shape = dict(batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, seqlen_q=p.seqlen_q,
                 seqlen_kv=p.seqlen_kv, head_dim=p.head_dim, head_dim_v=p.head_dim_v)
    hit = lookup(mod.tune_file, template="attention_fwd", spec_hash=mod.spec_hash,
                 dtype=KERNEL_DTYPES.get(mod.dtype, str(mod.dtype)), mode="fwd", gpu=_gpu_name(), shape=shape)
    if hit is not None:
        return hit[0]
    return default_forward_config(p.head_dim, p.head_dim_v)


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def kernels_for(mod) -> Kernels:
    if mod._kernels is None:
        cfg = _select_config(mod)
        shape = KernelShape.of(mod)
        tables = MaskTables(mod.spec.mask, shape, cfg.block_M, cfg.block_N, _forward_layout)
        src = generate_forward(mod.spec, shape, cfg)
        mod._kernels = Kernels(ForwardKernel(shape, cfg, src, tables))
    return mod._kernels


def _forward_layout(bc: BlockClasses) -> tuple[torch.Tensor, ...]:
    """Per query block: first and one-past-last non-empty key block, and the class table."""
    lo, hi = bc.loop_bounds()
    return lo, hi, bc.classes


def forward_kernel_call(mod, q, k, v, custom: list[torch.Tensor]):
    fk = kernels_for(mod).forward
    names = mod.custom_io.names()
    cdict = dict(zip(names, custom, strict=True))
    lo, hi, cls = fk.tables.get(cdict, q.device)
    p = mod.problem
    alloc = (
        (lambda *s, dtype: torch.full(s, float("nan"), dtype=dtype, device=q.device))
        if POISON_OUTPUTS
        else (lambda *s, dtype: torch.empty(s, dtype=dtype, device=q.device))
    )
    o = alloc(p.batch, p.seqlen_q, p.heads_q, p.head_dim_v, dtype=q.dtype)
    finals = [
        alloc(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32) for _ in mod.spec.final_names
    ]
    c32 = [t.detach().float().contiguous() for t in custom]
    fk.compiled()(q.contiguous(), k.contiguous(), v.contiguous(), *c32, lo, hi, cls, o, *finals)
    return o, finals


class TileLangAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod, _unused, anchor, q, k, v, *custom):
        # argument positions match ReferenceAttention's, so the backward is shared
        o, finals = forward_kernel_call(mod, q, k, v, list(custom))
        ctx.spec, ctx.names, ctx.final_names = (
            mod.spec,
            tuple(mod.custom_io.names()),
            mod.spec.final_names,
        )
        ctx.save_for_backward(q, k, v, o, *finals, *custom)
        ctx.mark_non_differentiable(*finals)
        return (o, *finals)

    @staticmethod
    def backward(ctx, do, *_unused):
        return reference_backward(ctx, do)


def run(mod, q, k, v, custom: list[torch.Tensor]):
    o, *finals = TileLangAttention.apply(mod, None, GRAD_ANCHOR, q, k, v, *custom)
    return o, dict(zip(mod.spec.final_names, finals, strict=True))
