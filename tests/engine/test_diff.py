"""Symbolic differentiation (engine/ir/diff.py): for every op of the DSL, diff(expr, score)
evaluated equals torch.autograd's derivative of the evaluated expression at random points."""

from __future__ import annotations

import pytest
import torch

from engine import where
from engine.dsl.expr import custom_leaf, index_leaf, leaf
from engine.ir.diff import diff
from engine.reference.evaluate import Env, evaluate, index_tensors

B, H, M, N = 1, 2, 6, 9
S = leaf("score", ("m", "n"))
R = leaf("rowscale", ("m",), "r")
Q, KV = index_leaf("q"), index_leaf("kv")
C = custom_leaf("w", ("heads",))


def _points(seed: int):
    """Random points away from the non-differentiable ones of abs/max/min/where used below."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, M, N, generator=g, dtype=torch.float64)
    s = torch.where(s.abs() < 0.15, s + 0.4 * torch.sign(s + 1e-12), s)
    r = torch.randn(B, H, M, 1, generator=g, dtype=torch.float64)
    w = torch.rand(H, generator=g, dtype=torch.float64) + 0.5
    return s, r, w


def _env(s, r, w):
    return Env(
        dtype=torch.float64,
        device=torch.device("cpu"),
        leaves={"score": s},
        rowscale={"r": r},
        index=index_tensors(B, H, torch.arange(M), torch.arange(N), torch.device("cpu")),
        customs={"w": w},
    )


EXPRS = {
    "identity": S,
    "const": R * 3.0 + 1.0,  # does not depend on the score: derivative 0
    "neg": -S,
    "add": S + R,
    "radd": 2.0 + S,
    "sub": S - R,
    "rsub": R - S,
    "mul": S * R,
    "mul_self": S * S,
    "div_num": S / (R.abs() + 0.5),
    "div_den": R / S,
    "div_both": S / (S * S + 1.0),
    "rdiv": 1.0 / S,
    "exp": (S * 0.5).exp(),
    "exp2": S.exp2(),
    "log": (S * S + 0.3).log(),
    "log2": (S.abs() + 0.2).log2(),
    "tanh": (S * 0.7).tanh(),
    "sigmoid": (S - R).sigmoid(),
    "abs": S.abs(),
    "abs_shift": (S - R).abs() * 2.0,
    "pow0": S.pow(0),
    "pow1": S.pow(1),
    "pow2": S.pow(2),
    "pow3": S**3,
    "pow_half": (S * S + 1.0).pow(0.5),
    "pow_neg": (S.abs() + 1.0) ** -1.5,
    "rpow": 3.0**S,
    "max_row": S.max(R),
    "max_const": S.max(0.0),
    "max_rev": R.max(S),
    "min_row": S.min(R),
    "min_const": (S * 2.0).min(0.3),
    "where": where(S > R, S * S, S * -3.0),
    "where_logic": where((S > 0) & ~(R > 0.5) | (S < -1.0), S.exp(), R),
    "index_mul": (Q - KV) * S * 0.1,
    "index_where": where(Q >= KV, S, S * 0.5),
    "custom_mul": S * C + C,
    "softcap": (S * (1.0 / 30.0)).tanh() * 30.0,
    "alibi": S * 0.25 + C * (KV - Q),
    "retnet": S * 0.25 * ((Q - KV) * (C * -0.1)).exp(),
    "nested": ((S * R).sigmoid() + (S - 1.0).abs().log()) / (S.exp() + 1.0),
}


@pytest.mark.parametrize("name", EXPRS)
@pytest.mark.parametrize("seed", [0, 1])
def test_diff_wrt_score_matches_autograd(name, seed):
    expr = EXPRS[name]
    s, r, w = _points(seed)
    s = s.requires_grad_(True)
    (val,) = evaluate([expr], _env(s, r, w))
    val = torch.broadcast_to(val, s.shape)
    (want,) = torch.autograd.grad(val.sum(), s, allow_unused=True) if val.requires_grad else (None,)
    want = torch.zeros_like(s) if want is None else want
    (got,) = evaluate([diff(expr, S)], _env(s.detach(), r, w))
    got = torch.broadcast_to(got.to(torch.float64), s.shape)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["custom_mul", "alibi", "retnet"])
def test_diff_wrt_custom_read_matches_autograd(name):
    """d expr / d (custom read), summed over the tile the read broadcasts along, equals autograd's
    gradient of the custom tensor (what the backward scatters into learnable CustomIO tensors)."""
    expr = EXPRS[name]
    s, r, w = _points(3)
    w = w.requires_grad_(True)
    (val,) = evaluate([expr], _env(s, r, w))
    (want,) = torch.autograd.grad(torch.broadcast_to(val, s.shape).sum(), w)
    (got,) = evaluate([diff(expr, C)], _env(s, r, w.detach()))
    got = torch.broadcast_to(got.to(torch.float64), s.shape).sum(dim=(0, 2, 3))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_diff_of_a_reduction_is_refused():
    with pytest.raises(ValueError, match="cannot differentiate a row reduction"):
        diff(S - S.get_reduce("max"), S)


def test_diff_simplifies_trivial_cases():
    assert diff(S, S).op == "const" and diff(S, S).attr == 1.0
    assert diff(R * 2.0, S).op == "const" and diff(R * 2.0, S).attr == 0.0
    assert diff(S * 0.5, S).key == leaf("x", ()).wrap(0.5).key
