"""The engine's attention as torch.library custom ops, so that `torch.compile(fullgraph=True)`
traces a model through an AttentionEngine without a graph break (issue 20).

Under torch.compile, `AttentionEngine.forward` calls `engine::attention_forward` instead of its
autograd Function: the op is opaque to dynamo, its fake implementation gives the output shapes,
and its registered backward calls `engine::attention_backward`. Both run exactly what the eager
module runs (the generated kernels on a Hopper GPU, else the reference executor). A module is
named in the ops by an integer handle (a constant for the compiler), given at construction;
`torch.export` keeps the ops and their handles in its graph, so an exported program runs in the
process that holds its modules.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor, nn

from engine.runtime.reference_backend import reference_grads

_MODULES: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def register(mod: nn.Module) -> int:
    """A handle naming `mod` in the ops (the module is not kept alive by it)."""
    handle = next(_HANDLES)
    _MODULES[handle] = weakref.ref(mod, lambda _ref, h=handle: _MODULES.pop(h, None))
    return handle


def _module(handle: int) -> nn.Module:
    mod = _MODULES.get(handle)
    if mod is None or mod() is None:
        raise RuntimeError(f"engine op: no AttentionEngine with handle {handle} in this process "
                           "(it was freed, or the program was exported by another process: an "
                           "exported program runs beside the modules it was exported from)")
    return mod()


def compiled_forward(mod: nn.Module, q: Tensor, k: Tensor, v: Tensor,
                     custom: list[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """(o, finals) through the custom op (what `forward` does under torch.compile)."""
    o, *finals = attention_forward(mod._op_handle, q, k, v, list(custom))
    return o, dict(zip(mod.spec.final_names, finals, strict=True))


@torch.library.custom_op("engine::attention_forward", mutates_args=())
def attention_forward(handle: int, q: Tensor, k: Tensor, v: Tensor,
                      custom: list[Tensor]) -> list[Tensor]:
    mod = _module(handle)
    with torch.no_grad():
        o, finals = mod.eager_forward(q, k, v, list(custom))
    # contiguous, as the fake says (the kernels' outputs are; the reference's o is a view)
    return [o.contiguous(), *(finals[n].contiguous() for n in mod.spec.final_names)]


@attention_forward.register_fake
def _(handle, q, k, v, custom):
    mod = _module(handle)
    B, Sq, Hq, _ = q.shape
    fin_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = q.new_empty(B, Sq, Hq, v.shape[-1])
    return [o, *(q.new_empty(B, Hq, Sq, dtype=fin_dtype) for _ in mod.spec.final_names)]


@torch.library.custom_op("engine::attention_backward", mutates_args=())
def attention_backward(handle: int, q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                       finals: list[Tensor], do: Tensor, custom: list[Tensor],
                       wants: list[bool]) -> list[Tensor]:
    """[dq, dk, dv, then the gradient of each custom tensor whose `wants` is set]."""
    mod = _module(handle)
    names = mod.spec.custom_names
    want = tuple(n for n, w in zip(names, wants, strict=True) if w)
    if mod.resolved_backend(q.device) == "tilelang":
        from engine.runtime.tilelang_backend import kernel_grads

        dq, dk, dv, grads = kernel_grads(mod._kernel_cache, mod.kernel_request(), q, k, v, o,
                                         finals, do.contiguous(), custom, want)
    else:
        dq, dk, dv, grads = reference_grads(mod.spec, names, q, k, v, o, finals, do, custom,
                                            want)
    # an integer custom tensor has no gradient: zeros keep the op's output list fixed
    dc = (grads[n] if n in grads else torch.zeros_like(c)
          for n, c in zip(names, custom, strict=True) if n in want)
    return [t.contiguous() for t in (dq, dk, dv, *dc)]


@attention_backward.register_fake
def _(handle, q, k, v, o, finals, do, custom, wants):
    like = (q, k, v, *(c for c, w in zip(custom, wants, strict=True) if w))
    return [t.new_empty(t.shape) for t in like]


def _setup_context(ctx, inputs, output) -> None:
    handle, q, k, v, custom = inputs
    o, *finals = output
    ctx.handle, ctx.n_finals = handle, len(finals)
    # which custom tensors want a gradient (needs_input_grad's layout for a list argument
    # differs between eager autograd and AOT tracing)
    ctx.wants = [bool(c.requires_grad) for c in custom]
    ctx.save_for_backward(q, k, v, o, *finals, *custom)
    ctx.mark_non_differentiable(*finals)  # row scales, as in the eager module


def _backward(ctx, grads):
    q, k, v, o, *rest = ctx.saved_tensors
    finals, custom = rest[:ctx.n_finals], rest[ctx.n_finals:]
    wants = ctx.wants
    dq, dk, dv, *dc = attention_backward(ctx.handle, q, k, v, o, list(finals), grads[0],
                                         list(custom), wants)
    it = iter(dc)
    return None, dq, dk, dv, [next(it) if w else None for w in wants]


torch.library.register_autograd("engine::attention_forward", _backward,
                                setup_context=_setup_context)
