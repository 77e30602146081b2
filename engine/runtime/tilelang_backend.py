"""The TileLang backend: generated forward kernels behind a torch.autograd.Function.

The backward runs the generated backward kernels (engine.kernels.attention_bwd) when
KERNEL_BACKWARD is on and the spec allows it; otherwise the reference executor's rules on the
GPU (materialised in row chunks), with a log line saying why. KERNEL_BACKWARD is on by default
(the backward kernels pass tests/gpu on the H100); ATTNBENCH_KERNEL_BACKWARD=0 turns it off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.kernels.attention_bwd.launch import BackwardKernels
from engine.kernels.attention_bwd.plan import check_backward_config
from engine.kernels.attention_fwd.launch import ForwardKernel
from engine.kernels.attention_fwd.plan import check_config
from engine.kernels.registry import ATTENTION_BWD, ATTENTION_FWD
from engine.plan.config import ConfigError, KernelConfig
from engine.plan.shape import KERNEL_DTYPES, KernelShape
from engine.runtime.reference_backend import GRAD_ANCHOR, reference_backward
from engine.tuning.select import tuned_config

log = logging.getLogger("engine")
# Tests set this to fill outputs with NaN before each launch, to prove every element is written.
POISON_OUTPUTS = False
KERNEL_BACKWARD = os.environ.get("ATTNBENCH_KERNEL_BACKWARD", "1") != "0"
_logged: set[str] = set()


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
    # (results/tune/<gpu>/<kind>.json); a missing or unreadable file means defaults.
    return tuned_config(mod, ATTENTION_FWD) or ATTENTION_FWD.default(
        p.head_dim, p.head_dim_v, spec=mod.spec
    )


def kernels_for(mod) -> Kernels:
    if mod._kernels is None:
        fk = ATTENTION_FWD.build(mod.spec, KernelShape.of(mod), _select_config(mod))
        mod._kernels = Kernels(fk)
    return mod._kernels


def forward_kernel_call(mod, q, k, v, custom: list[torch.Tensor]):
    fk = kernels_for(mod).forward
    cdict = dict(zip(mod.custom_io.names(), custom, strict=True))
    return ATTENTION_FWD.launch(fk, q, k, v, cdict, poison=POISON_OUTPUTS)


def backward_kernels_for(
    mod,
    config: KernelConfig | None = None,
    custom_grads: tuple[str, ...] = (),
    deterministic: bool | None = None,
) -> BackwardKernels:
    """Generate (not compile) the backward kernels of an AttentionEngine module, producing the
    gradients of the CustomIO tensors named in `custom_grads` too; cached on the module.
    `deterministic` defaults to the module's setting."""
    custom_grads = tuple(custom_grads)
    det = bool(mod.deterministic if deterministic is None else deterministic)
    cache = mod.__dict__.setdefault("_bwd_kernels", {})
    key = (config, custom_grads, det)
    if key in cache:
        return cache[key]
    if mod.dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype {mod.dtype}: backward kernels support {sorted(map(str, KERNEL_DTYPES))}")
    p = mod.problem
    spec = mod.spec
    n_rows = len(spec.final_names) + int(spec.uses_doosum)
    cfg = config or mod.backward_config or tuned_config(mod, ATTENTION_BWD)
    if cfg is None:
        cfg = ATTENTION_BWD.default(p.head_dim, p.head_dim_v)
    else:
        cfg = check_backward_config(cfg, p.head_dim, p.head_dim_v, n_rows=n_rows)
    bk = ATTENTION_BWD.build(spec, KernelShape.of(mod), cfg, custom_grads, det)
    cache[key] = bk
    return bk


def backward_kernel_call(
    mod,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    finals: list[torch.Tensor] | dict[str, torch.Tensor],
    do: torch.Tensor,
    custom: list[torch.Tensor],
    custom_grads: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """dq, dk, dv (input dtype and layouts) of `mod`'s attention for output gradient `do`, and
    the gradients of the CustomIO tensors named in `custom_grads` (each in its tensor's dtype).

    `finals` are the forward's final row scales ([B, Hq, Sq] fp32, in spec.final_names order or
    by name); `custom` the CustomIO tensors in mod.custom_io.names() order."""
    names = list(mod.custom_io.names())
    if len(custom) != len(names):
        raise ValueError(f"custom: {len(custom)} tensors; expected {len(names)} ({names})")
    unknown = sorted(set(custom_grads) - set(names))
    if unknown:
        raise ValueError(f"custom_grads: {unknown} are not CustomIO inputs ({names})")
    spec = mod.spec
    if isinstance(finals, dict):
        finals = [finals[n] for n in spec.final_names]
    if len(finals) != len(spec.final_names):
        raise ValueError(f"finals: {len(finals)} tensors; expected {list(spec.final_names)}")
    bk = backward_kernels_for(mod, custom_grads=tuple(custom_grads))
    cdict = dict(zip(names, custom, strict=True))
    return ATTENTION_BWD.launch(bk, q, k, v, o, list(finals), do, cdict)


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
