"""The reference backend: the reference executor behind a torch.autograd.Function."""

from __future__ import annotations

import torch

from engine.ir.spec import TracedSpec
from engine.reference import executor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: TracedSpec, names: tuple[str, ...], anchor, q, k, v, *custom):
        cdt = compute_dtype(q.dtype)
        customs = dict(zip(names, custom, strict=True))
        o, finals = executor.forward(spec, q, k, v, customs, dtype=cdt)
        o = o.to(q.dtype)
        ctx.spec, ctx.names, ctx.final_names = spec, names, tuple(finals)
        ctx.save_for_backward(q, k, v, o, *finals.values(), *custom)
        ctx.mark_non_differentiable(*finals.values())
        return (o, *finals.values())

    @staticmethod
    def backward(ctx, do, *_unused):
        return reference_backward(ctx, do)


def reference_backward(ctx, do):
    """Gradients by the reference rules; ctx saved (q, k, v, o, *finals, *custom) and has
    spec, names, final_names. Returns grads for (None, None, None, q, k, v, *custom)."""
    if not any(ctx.needs_input_grad[3:]):
        return (None,) * (6 + len(ctx.names))  # only the anchor: nothing to compute
    q, k, v, o, *rest = ctx.saved_tensors
    nf = len(ctx.final_names)
    custom = rest[nf:]
    want = tuple(n for n, needs in zip(ctx.names, ctx.needs_input_grad[6:], strict=True)
                 if needs)
    dq, dk, dv, grads = reference_grads(ctx.spec, ctx.names, q, k, v, o, rest[:nf], do, custom,
                                        want)
    return (None, None, None, dq, dk, dv, *(grads.get(n) for n in ctx.names))


def reference_grads(spec: TracedSpec, names: tuple[str, ...], q, k, v, o, finals, do, custom,
                    want: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """dq, dk, dv (the inputs' dtypes) and {name: gradient} of the CustomIO tensors in `want`
    (floating point ones), by the reference rules; `finals` in spec.final_names order."""
    customs = dict(zip(names, custom, strict=True))
    want = tuple(n for n in want if customs[n].is_floating_point())
    # Gradients of CustomIO tensors are derived through score_mod only; one that the online
    # functions read would get a silently wrong gradient, so refuse it.
    bad = sorted(set(want) & spec.online_custom_reads())
    if bad:
        raise RuntimeError(
            f"CustomIO input(s) {bad} require grad but are read in the online functions; the engine "
            "differentiates CustomIO tensors only through score_mod (detach them or move the use "
            "into score_mod)"
        )
    fin = dict(zip(spec.final_names, finals, strict=True))
    dq, dk, dv, cg = executor.backward(
        spec, q, k, v, customs, o, fin, do, dtype=compute_dtype(q.dtype), custom_grads=want
    )
    grads = {n: cg[n].to(customs[n].dtype) for n in want if n in cg}
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads


# In grad mode the output always joins the autograd graph through this anchor, so that
# `out.backward()` runs even when q, k, v do not require grad (as in the seed examples).
GRAD_ANCHOR = torch.empty(0, requires_grad=True)


def run(spec: TracedSpec, names: tuple[str, ...], q, k, v, custom: list[torch.Tensor]):
    o, *finals = ReferenceAttention.apply(spec, names, GRAD_ANCHOR, q, k, v, *custom)
    return o, dict(zip(spec.final_names, finals, strict=True))
