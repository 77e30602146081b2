"""The linear-attention variant library: each entry is a LinearAttentionEngine spec (its
q/k/v/decay mods and custom inputs), realistic random inputs, and an independent plain-torch
formulation (the quadratic masked form, no engine code) to check the engine against.

sizes: a dict with batch, heads_q, heads_k, heads, seqlen, head_dim, head_dim_v (q
[B, heads_q, T, D], k [B, heads_k, T, D], v [B, heads, T, Dv]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.dsl.expr import where
from engine.dsl.io import CustomIO, meta_tensor

SIZE_KEYS = ("batch", "heads_q", "heads_k", "heads", "seqlen", "head_dim", "head_dim_v")


@dataclass(frozen=True)
class LinearVariant:
    """A linear attention variant.

    make_args(sizes) -> LinearAttentionEngine keyword arguments (q_mod, k_mod, v_mod,
    decay_mod, custom_io); make_custom(sizes, gen) -> decay [B, H, T] float32 and the custom
    tensors in declaration order; reference_fn(inputs) -> o [B, H, T, Dv] float32 (float64 for
    float64 inputs), written in plain torch. learnable: the inputs besides q, k and v that a
    training step differentiates (the decay or custom inputs; as Variant.learnable).
    """

    name: str
    description: str
    make_args: Callable[[dict], dict[str, Any]]
    make_custom: Callable[[dict, torch.Generator], dict[str, torch.Tensor]]
    reference_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    learnable: tuple[str, ...] = ()

    def make_inputs(self, sizes: dict, dtype: torch.dtype, device: str | torch.device = "cpu",
                    seed: int = 0, requires_grad: bool = False) -> dict[str, torch.Tensor]:
        """q, k, v (standard normal in `dtype`, layout [B, H, T, D]), decay (float32) and the
        custom tensors, in the module's positional order; requires_grad: q, k, v and the
        learnable ones. Tensors listed twice (Mamba2's dt is the decay input and a custom
        input) are one tensor, so that both uses add to one gradient."""
        _check_sizes(sizes)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        B, T = sizes["batch"], sizes["seqlen"]
        out = {
            "q": torch.randn(B, sizes["heads_q"], T, sizes["head_dim"], generator=gen),
            "k": torch.randn(B, sizes["heads_k"], T, sizes["head_dim"], generator=gen),
            "v": torch.randn(B, sizes["heads"], T, sizes["head_dim_v"], generator=gen),
        }
        out = {n: t.to(device=device, dtype=dtype) for n, t in out.items()}
        moved: dict[int, torch.Tensor] = {}  # one device copy per distinct tensor
        for n, t in self.make_custom(sizes, gen).items():
            out[n] = moved.setdefault(id(t), t.to(device))
        if requires_grad:
            for n in ("q", "k", "v", *self.learnable):
                out[n].requires_grad_(True)
        return out

    def build(self, sizes: dict, dtype: torch.dtype, backend: str = "auto", config: Any = None,
              backward_config: Any = None):
        """The LinearAttentionEngine of this variant at `sizes`."""
        from engine.linear_api import LinearAttentionEngine

        _check_sizes(sizes)
        B, T = sizes["batch"], sizes["seqlen"]
        meta = (meta_tensor(B, sizes["heads_q"], T, sizes["head_dim"], dtype=dtype),
                meta_tensor(B, sizes["heads_k"], T, sizes["head_dim"], dtype=dtype),
                meta_tensor(B, sizes["heads"], T, sizes["head_dim_v"], dtype=dtype))
        return LinearAttentionEngine(meta, **self.make_args(sizes), backend=backend,
                                     config=config, backward_config=backward_config)


def _check_sizes(sizes: dict) -> None:
    missing = [k for k in SIZE_KEYS if k not in sizes]
    if missing:
        raise ValueError(f"sizes: missing {missing}; expected the keys {SIZE_KEYS}")
    for name in ("heads_q", "heads_k"):
        if sizes["heads"] % sizes[name]:
            raise ValueError(f"sizes: {name}={sizes[name]} does not divide heads={sizes['heads']}")


# ---------------------------------------------------------------- the independent formulation
def quadratic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None
              ) -> torch.Tensor:
    """o = (q k^T * exp(G_t - G_s) for s <= t, else 0) v, G = cumsum(g) over T, in float32
    (float64 stays float64); q and k heads repeated to v's. g None: no decay."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    H, T = v.shape[1], v.shape[2]
    q = q.to(dt).repeat_interleave(H // q.shape[1], dim=1)
    k = k.to(dt).repeat_interleave(H // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if g is None:
        weights = causal.to(dt)
    else:
        G = g.to(dt).cumsum(-1)
        diff = G[..., :, None] - G[..., None, :]
        # masked entries set to 0 before exp: there the difference is positive and may overflow
        weights = torch.where(causal, torch.exp(torch.where(causal, diff, 0.0)), 0.0)
    return (scores * weights) @ v.to(dt)


def _f(x: torch.Tensor) -> torch.Tensor:
    """x in float32 (float64 stays float64), the references' precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scaled_q(sizes: dict) -> Callable:
    scale = sizes["head_dim"] ** -0.5

    def q_mod(q, custom_io):
        return q * scale

    return q_mod


# ---------------------------------------------------------------- mamba2
def _mamba2_args(sizes: dict) -> dict[str, Any]:
    # decay is dt, g = dt * A; the input is x * dt; q = C and k = B are shared by all heads
    return dict(
        decay_mod=lambda decay, custom_io: decay * custom_io.input_tensors["A"],
        v_mod=lambda v, custom_io: v * custom_io.input_tensors["dt"],
        custom_io=CustomIO({"A": (1, "heads"), "dt": ("batch", "heads", "seq_len")}),
    )


def _mamba2_custom(sizes: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    B, H, T = sizes["batch"], sizes["heads"], sizes["seqlen"]
    A = -torch.exp(torch.randn(1, H, generator=gen) * 0.5)
    # Mamba2's init: a per-head dt0 log-uniform in [1e-3, 1e-1], bias = softplus^-1(dt0)
    dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3))
                    + math.log(1e-3))
    bias = dt0 + torch.log(-torch.expm1(-dt0))
    dt = F.softplus(torch.randn(B, H, T, generator=gen) * 0.5 + bias.view(1, H, 1))
    return {"decay": dt, "A": A, "dt": dt}


def _mamba2_ref(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    A, dt = inputs["A"], inputs["dt"]
    g = inputs["decay"] * A.view(1, -1, 1)
    return quadratic(inputs["q"], inputs["k"], _f(inputs["v"]) * dt[..., None], g)


# ---------------------------------------------------------------- simple GLA / gated retention
def _simple_gla_args(sizes: dict) -> dict[str, Any]:
    return dict(q_mod=_scaled_q(sizes))


def _simple_gla_custom(sizes: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    B, H, T = sizes["batch"], sizes["heads"], sizes["seqlen"]
    return {"decay": F.logsigmoid(torch.randn(B, H, T, generator=gen))}


def _simple_gla_ref(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    q = _f(inputs["q"]) * inputs["q"].shape[-1] ** -0.5
    return quadratic(q, inputs["k"], inputs["v"], inputs["decay"])


# ---------------------------------------------------------------- RetNet linear retention
def _retnet_args(sizes: dict) -> dict[str, Any]:
    return dict(q_mod=_scaled_q(sizes), decay_mod=lambda decay, custom_io: decay.log())


def retnet_gammas(heads: int) -> torch.Tensor:
    """RetNet's per-head decays gamma_h = 1 - 2^(-5 - h)."""
    return 1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float64))


def _retnet_custom(sizes: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    B, H, T = sizes["batch"], sizes["heads"], sizes["seqlen"]
    gamma = retnet_gammas(H).to(torch.float32).view(1, H, 1)
    return {"decay": gamma.expand(B, H, T).contiguous()}


def _retnet_ref(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    q = _f(inputs["q"]) * inputs["q"].shape[-1] ** -0.5
    return quadratic(q, inputs["k"], inputs["v"], torch.log(inputs["decay"]))


# ---------------------------------------------------------------- linear attention, elu + 1
def _elu1(x):
    return where(x > 0, x + 1, x.exp())  # elu(x) + 1: positive features


def _linear_elu_args(sizes: dict) -> dict[str, Any]:
    return dict(q_mod=_elu1, k_mod=_elu1)


def _linear_elu_custom(sizes: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    # g = 0: no decay is this variant's definition, not a placeholder input
    return {"decay": torch.zeros(sizes["batch"], sizes["heads"], sizes["seqlen"])}


def _linear_elu_ref(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    q, k = (F.elu(_f(inputs[n])) + 1 for n in ("q", "k"))
    return quadratic(q, k, inputs["v"], None)


LINEAR_VARIANTS: dict[str, LinearVariant] = {
    v.name: v
    for v in (
        LinearVariant(
            "mamba2", "Mamba2 SSD (one group): q = C, k = B shared by all heads, v = x * dt, "
            "g = dt * A per head", _mamba2_args, _mamba2_custom, _mamba2_ref,
            learnable=("A", "dt")),
        LinearVariant(
            "simple_gla", "simple GLA / gated retention (YOCO): q scaled by D^-0.5, a "
            "data-dependent scalar log decay per head and token", _simple_gla_args,
            _simple_gla_custom, _simple_gla_ref, learnable=("decay",)),
        LinearVariant(
            "retnet_linear", "RetNet's linear retention: q scaled by D^-0.5, a fixed decay "
            "gamma_h = 1 - 2^(-5-h) per head (decay_mod takes its log)", _retnet_args,
            _retnet_custom, _retnet_ref),
        LinearVariant(
            "linear_elu", "linear attention with the feature map elu(x) + 1 on q and k, no "
            "decay and no normaliser", _linear_elu_args, _linear_elu_custom, _linear_elu_ref),
    )
}


def get_linear_variant(name: str) -> LinearVariant:
    """The linear variant called `name`; a ValueError lists the known names otherwise."""
    try:
        return LINEAR_VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown linear variant {name!r}; known: {', '.join(sorted(LINEAR_VARIANTS))}"
        ) from None
