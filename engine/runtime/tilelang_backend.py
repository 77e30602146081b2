"""The TileLang backend: generated forward kernels behind a torch.autograd.Function.

The backward runs the generated backward kernels (engine.runtime.backward_kernels) when
KERNEL_BACKWARD is on and the spec allows it; otherwise the reference executor's rules on the
GPU (materialised in row chunks), with a log line saying why. KERNEL_BACKWARD is on by default
(the backward kernels pass tests/gpu on the H100); ATTNBENCH_KERNEL_BACKWARD=0 turns it off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.codegen.forward import generate_forward
from engine.mask.analysis import BlockClasses
from engine.plan.config import KernelConfig, check_config
from engine.plan.defaults import default_forward_config
from engine.plan.shape import KernelShape
from engine.runtime.compile import compile_source
from engine.runtime.mask_tables import MaskTables
from engine.runtime.reference_backend import GRAD_ANCHOR, reference_backward

log = logging.getLogger("engine")
# Tests set this to fill outputs with NaN before each launch, to prove every element is written.
POISON_OUTPUTS = False
KERNEL_BACKWARD = os.environ.get("ATTNBENCH_KERNEL_BACKWARD", "1") != "0"
_logged: set[str] = set()


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
    from engine.tuning.select import tuned_config

    return tuned_config(mod, "attention_fwd", "fwd") or default_forward_config(
        p.head_dim, p.head_dim_v, spec=mod.spec
    )


def kernels_for(mod) -> Kernels:
    if mod._kernels is None:
        cfg = _select_config(mod)
        shape = KernelShape.of(mod)
        tables = MaskTables(mod.spec.mask, shape, cfg.block_M, cfg.block_N, forward_layout)
        src = generate_forward(mod.spec, shape, cfg)
        mod._kernels = Kernels(ForwardKernel(shape, cfg, src, tables))
    return mod._kernels


def forward_layout(bc: BlockClasses) -> tuple[torch.Tensor, ...]:
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
        ctx.mod = mod
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
        n_custom = len(ctx.names)
        if not any(ctx.needs_input_grad[3:]):
            return (None,) * (6 + n_custom)
        reason = kernel_backward_problem(ctx.mod, ctx.needs_input_grad[6:])
        if reason is not None:
            if reason not in _logged:
                _logged.add(reason)
                log.info("engine: backward by the reference rules: %s", reason)
            return reference_backward(ctx, do)
        from engine.runtime.backward_kernels import backward_kernel_call

        q, k, v, o, *rest = ctx.saved_tensors
        nf = len(ctx.final_names)
        wants = _wanted_custom_grads(ctx.mod, ctx.needs_input_grad[6:])
        dq, dk, dv, dc = backward_kernel_call(
            ctx.mod, q, k, v, o, rest[:nf], do, rest[nf:], custom_grads=wants
        )
        return (None, None, None, dq, dk, dv, *(dc.get(n) for n in ctx.names))


def _wanted_custom_grads(mod, custom_needs_grad) -> tuple[str, ...]:
    return tuple(
        n for n, need in zip(mod.custom_io.names(), custom_needs_grad, strict=False) if need
    )


def kernel_backward_problem(mod, custom_needs_grad=()) -> str | None:
    """Why `mod`'s backward cannot run as generated kernels (None: it can)."""
    if not KERNEL_BACKWARD:
        return "kernel backward is off (ATTNBENCH_KERNEL_BACKWARD=0 is set)"
    from engine.plan.config import ConfigError
    from engine.runtime.backward_kernels import backward_kernels_for

    try:
        backward_kernels_for(mod, custom_grads=_wanted_custom_grads(mod, custom_needs_grad))
    except (NotImplementedError, ConfigError, ValueError) as exc:
        return str(exc)
    return None


def run(mod, q, k, v, custom: list[torch.Tensor]):
    if mod.tune and not mod._tune_checked:
        # Once per module, before its kernel is built: the tuned entry is then picked up by
        # _select_config like any other.
        from engine.tuning.autotune import ensure_tuned

        mod._tune_checked = True
        ensure_tuned(mod, q, k, v, custom)
        mod._kernels = None
    o, *finals = TileLangAttention.apply(mod, None, GRAD_ANCHOR, q, k, v, *custom)
    return o, dict(zip(mod.spec.final_names, finals, strict=True))
