"""A linear case's inputs as flash-linear-attention's simple-GLA call takes them.

fla's `chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None)` computes, in its layout
[B, T, H, D] with q, k and v of the same H heads,

    o_t = scale * sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s,   G = cumsum(g) over t

(g [B, T, H] float32 log decays, or g_gamma [H]: a fixed log decay per head; `chunk_retention`
is this call with g_gamma = log(1 - 2^(-5 - h))). That is the engine's linear layer after the
variant's mods, so each variant maps onto it (`fla_call`), every conversion made here, before
any timing:

    simple_gla     q, k, v as given (one q or k head broadcast to all H, as for mamba2);
                   scale = D^-0.5 (the variant's q_mod); g = decay (already a log decay:
                   logsigmoid)
    retnet_linear  q, k, v as given; scale = D^-0.5; g_gamma = log(decay) of one position (the
                   decay input is the fixed per-head gamma, the same at every batch and time)
    mamba2         SSD with a scalar decay per head: q = C and k = B broadcast from their one
                   head to all H, v = x * dt, g = dt * A, scale = 1

The leaves of a gradient run are fla's own tensors (the broadcast copies, v * dt, g); `grads_back`
takes their gradients back to the case's q, k, v and learnable inputs (simple GLA's decay,
Mamba2's dt and A) by the chain rule (sum over the broadcast heads, times dt, ...) so that they
are checked against the variant's reference like every row's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnbench.linear import linear_sizes


@dataclass(frozen=True)
class FlaCall:
    """The arguments of one `chunk_simple_gla` call ([B, T, H, D]) and the way back."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    g_gamma: torch.Tensor | None
    scale: float
    # fla's gradients of `leaves` -> the case's: dq, dk, dv [B, H, T, D], then the learnable
    # inputs' (attnbench.linear.learned_names)
    grads_back: Callable[[tuple], tuple]

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        """q, k, v and (a data-dependent decay) g: the tensors a backward differentiates."""
        return (self.q, self.k, self.v, *(() if self.g is None else (self.g,)))

    def kwargs(self) -> dict:
        return {"g": self.g, "g_gamma": self.g_gamma, "scale": self.scale}


def to_fla(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, ...] -> a contiguous [B, T, H, ...]."""
    return x.transpose(1, 2).contiguous()


def from_fla(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, T, ...] (a view)."""
    return x.transpose(1, 2)


def _leaf(x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(needs_grad)


def _qk(inputs: dict, sizes: dict, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in fla's layout with the value heads (a single shared head broadcast)."""
    heads = sizes["heads"]
    return tuple(_leaf(to_fla(inputs[n].expand(-1, heads, -1, -1)), needs_grad)  # type: ignore
                 for n in ("q", "k"))


def _grads_back(sizes: dict, dv_scale: torch.Tensor | None = None,
                learned: Callable[[tuple], tuple] = lambda grads: ()
                ) -> Callable[[tuple], tuple]:
    """fla's gradients (dq, dk, dv and, with a data-dependent decay, dg) -> the case's: dq, dk
    summed over a broadcast head, dv times `dv_scale` ([B, H, T]) where fla's v was v * dv_scale,
    then `learned(grads)`: the gradients of the case's learnable inputs
    (attnbench.linear.learned_names), in its layout."""
    def back(grads: tuple) -> tuple:
        dq, dk, dv = (from_fla(x) for x in grads[:3])
        if sizes["heads_q"] == 1 < sizes["heads"]:
            dq = dq.float().sum(1, keepdim=True)
        if sizes["heads_k"] == 1 < sizes["heads"]:
            dk = dk.float().sum(1, keepdim=True)
        if dv_scale is not None:
            dv = dv.float() * dv_scale.unsqueeze(-1)
        return dq, dk, dv, *learned(grads)

    return back


def _simple_gla(inputs: dict, sizes: dict, needs_grad: bool) -> FlaCall:
    q, k = _qk(inputs, sizes, needs_grad)
    v = _leaf(to_fla(inputs["v"]), needs_grad)
    g = _leaf(to_fla(inputs["decay"].float()), needs_grad)
    return FlaCall(q, k, v, g, None, sizes["head_dim"] ** -0.5,
                   _grads_back(sizes, learned=lambda grads: (from_fla(grads[3]),)))


def _retnet_linear(inputs: dict, sizes: dict, needs_grad: bool) -> FlaCall:
    decay = inputs["decay"].float()
    gamma = decay[0, :, 0]
    if not torch.equal(decay, gamma.view(1, -1, 1).expand_as(decay)):
        raise ValueError("retnet_linear's decay input must be one fixed gamma per head (the same "
                         "at every batch and position) to map onto fla's g_gamma")
    q, k = _qk(inputs, sizes, needs_grad)
    v = _leaf(to_fla(inputs["v"]), needs_grad)
    return FlaCall(q, k, v, None, gamma.log().contiguous(), sizes["head_dim"] ** -0.5,
                   _grads_back(sizes))


def _mamba2(inputs: dict, sizes: dict, needs_grad: bool) -> FlaCall:
    dt, a = inputs["dt"].float(), inputs["A"].float()  # [B, H, T], (1, H)
    q, k = _qk(inputs, sizes, needs_grad)
    x = inputs["v"]
    v = _leaf(to_fla((x.float() * dt.unsqueeze(-1)).to(x.dtype)), needs_grad)
    g = _leaf(to_fla(inputs["decay"].float() * a.view(1, -1, 1)), needs_grad)

    def learned(grads: tuple) -> tuple:
        # dt (the decay and the value weight: one tensor) and A, by the chain rule through
        # v = x * dt and g = dt * A
        dv, dg = from_fla(grads[2]).float(), from_fla(grads[3]).float()
        ddt = (dv * x.float()).sum(-1) + dg * a.view(1, -1, 1)
        return ddt, (dg * dt).sum((0, 2)).view_as(a)

    return FlaCall(q, k, v, g, None, 1.0, _grads_back(sizes, dt, learned))


# linear variant -> its mapping (module docstring)
MAPPINGS: dict[str, Callable[[dict, dict, bool], FlaCall]] = {
    "simple_gla": _simple_gla,
    "retnet_linear": _retnet_linear,
    "mamba2": _mamba2,
}


def head_problem(case) -> str | None:
    """Why fla's call cannot take the case's head counts (q, k and v of the same heads; one
    shared q/k head is broadcast), or None."""
    for name, n in (("heads_q", case.heads_q), ("heads_k", case.heads_kv)):
        if n not in (1, case.heads):
            return (f"{name} {n} is neither 1 (broadcast) nor the value heads {case.heads}: "
                    "fla's simple GLA takes q, k and v with the same heads")
    return None


def fla_call(case, inputs: dict, needs_grad: bool) -> FlaCall:
    """The `chunk_simple_gla` arguments of a linear case of a variant in MAPPINGS."""
    if case.variant not in MAPPINGS:
        raise ValueError(f"no fla mapping for linear variant {case.variant!r}; mapped: "
                         f"{', '.join(sorted(MAPPINGS))}")
    problem = head_problem(case)
    if problem is not None:
        raise ValueError(problem)
    return MAPPINGS[case.variant](inputs, linear_sizes(case), needs_grad)
