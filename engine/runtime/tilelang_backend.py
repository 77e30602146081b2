"""The TileLang backend: generated forward kernels behind a torch.autograd.Function.

The backward runs the generated backward kernels (engine.kernels.attention_bwd) when
KERNEL_BACKWARD is on and the spec allows it; otherwise the reference executor's rules on the
GPU (materialised in row chunks), with a log line saying why. KERNEL_BACKWARD is on by default
(the backward kernels pass tests/gpu on the H100); ATTNBENCH_KERNEL_BACKWARD=0 turns it off.

The functions here take a module's KernelCache and a KernelRequest (spec, problem, options),
never the module.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.kernels.registry import ATTENTION_BWD, ATTENTION_FWD
from engine.plan.config import ConfigError
from engine.plan.request import KernelRequest
from engine.runtime.kernel_cache import KernelCache
from engine.runtime.reference_backend import GRAD_ANCHOR, reference_grads

log = logging.getLogger("engine")
# Tests set this to fill outputs with NaN before each launch, to prove every element is written.
POISON_OUTPUTS = False
KERNEL_BACKWARD = os.environ.get("ATTNBENCH_KERNEL_BACKWARD", "1") != "0"
_logged: set[str] = set()


def kernel_backward_enabled() -> bool:
    """Whether backward passes may run the generated kernels (ATTNBENCH_KERNEL_BACKWARD)."""
    return KERNEL_BACKWARD


def backward_problem(cache: KernelCache, req: KernelRequest,
                     custom_grads: tuple[str, ...] = ()) -> str | None:
    """Why the backward (with the gradients of `custom_grads`) cannot run as generated
    kernels (None: it can)."""
    if not KERNEL_BACKWARD:
        return "kernel backward is off (ATTNBENCH_KERNEL_BACKWARD=0 is set)"
    try:
        cache.backward(req, custom_grads=tuple(custom_grads))
    except (NotImplementedError, ConfigError, ValueError) as exc:
        return str(exc)
    return None


def forward_kernel_call(cache: KernelCache, req: KernelRequest, q, k, v,
                        custom: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(o, finals) of the forward kernel; `custom` the CustomIO tensors in declaration order."""
    cdict = dict(zip(req.spec.custom_names, custom, strict=True))
    return ATTENTION_FWD.launch(cache.forward(req), q, k, v, cdict, poison=POISON_OUTPUTS)


def backward_kernel_call(
    cache: KernelCache,
    req: KernelRequest,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    finals: list[torch.Tensor] | dict[str, torch.Tensor],
    do: torch.Tensor,
    custom: list[torch.Tensor],
    custom_grads: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """dq, dk, dv (input dtype and layouts) for output gradient `do`, and the gradients of the
    CustomIO tensors named in `custom_grads` (each in its tensor's dtype).

    `finals` are the forward's final row scales ([B, Hq, Sq] fp32, in spec.final_names order or
    by name); `custom` the CustomIO tensors in declaration order."""
    spec = req.spec
    names = list(spec.custom_names)
    if len(custom) != len(names):
        raise ValueError(f"custom: {len(custom)} tensors; expected {len(names)} ({names})")
    unknown = sorted(set(custom_grads) - set(names))
    if unknown:
        raise ValueError(f"custom_grads: {unknown} are not CustomIO inputs ({names})")
    if isinstance(finals, dict):
        finals = [finals[n] for n in spec.final_names]
    if len(finals) != len(spec.final_names):
        raise ValueError(f"finals: {len(finals)} tensors; expected {list(spec.final_names)}")
    bk = cache.backward(req, custom_grads=tuple(custom_grads))
    cdict = dict(zip(names, custom, strict=True))
    return ATTENTION_BWD.launch(bk, q, k, v, o, list(finals), do, cdict)


def kernel_grads(cache: KernelCache, req: KernelRequest, q, k, v, o, finals, do, custom,
                 want: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """dq, dk, dv and {name: gradient} of the CustomIO tensors in `want`: by the generated
    backward kernels where they can run, else by the reference rules (said once in the log)."""
    reason = backward_problem(cache, req, want)
    if reason is None:
        return backward_kernel_call(cache, req, q, k, v, o, finals, do, custom, custom_grads=want)
    if reason not in _logged:
        _logged.add(reason)
        log.info("engine: backward by the reference rules: %s", reason)
    spec = req.spec
    return reference_grads(spec, spec.custom_names, q, k, v, o, finals, do, custom, want)


class TileLangAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cache, req, anchor, q, k, v, *custom):
        # argument positions match ReferenceAttention's, so the backward is shared
        o, finals = forward_kernel_call(cache, req, q, k, v, list(custom))
        ctx.cache, ctx.req = cache, req
        ctx.spec, ctx.names, ctx.final_names = req.spec, req.spec.custom_names, req.spec.final_names
        ctx.save_for_backward(q, k, v, o, *finals, *custom)
        ctx.mark_non_differentiable(*finals)
        return (o, *finals)

    @staticmethod
    def backward(ctx, do, *_unused):
        n_custom = len(ctx.names)
        if not any(ctx.needs_input_grad[3:]):
            return (None,) * (6 + n_custom)
        wants = tuple(n for n, need in zip(ctx.names, ctx.needs_input_grad[6:], strict=False)
                      if need)
        q, k, v, o, *rest = ctx.saved_tensors
        nf = len(ctx.final_names)
        dq, dk, dv, dc = kernel_grads(ctx.cache, ctx.req, q, k, v, o, rest[:nf], do, rest[nf:],
                                      wants)
        return (None, None, None, dq, dk, dv, *(dc.get(n) for n in ctx.names))


def run(cache: KernelCache, req: KernelRequest, q, k, v, custom: list[torch.Tensor]):
    if not torch.is_grad_enabled():
        # Inference (no_grad, inference_mode): no graph to record, so the kernel is called
        # directly; the autograd Function's apply costs about a third of the module's own
        # host time per call (CPU profile, results/NOTES.md 68).
        o, finals = forward_kernel_call(cache, req, q, k, v, custom)
    else:
        o, *finals = TileLangAttention.apply(cache, req, GRAD_ANCHOR, q, k, v, *custom)
    return o, dict(zip(req.spec.final_names, finals, strict=True))
