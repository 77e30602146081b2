"""More math and integer arithmetic in the DSL (issue 19): every function traced, run on the
reference executor and compared with the same function written directly in torch, forward and
gradients; floor-semantics `//` and `%` on indices in masks, with the block classification
checked against the element-wise mask; the error paths."""

from __future__ import annotations

import math

import pytest
import torch

import engine
from engine import AttentionEngine, OnlineSoftmax, meta_tensor
from engine.dsl.expr import DSLError, Expr, index_leaf
from engine.mask.analysis import EMPTY, FULL, classify

B, HQ, HKV, S, D = 2, 4, 2, 40, 16
SCALE = D**-0.5

# name -> (the DSL score_mod body on the scaled score s, the same in torch). Inputs are kept
# inside each function's domain (tan away from its poles, sqrt/rsqrt of a positive value).
MATH = {
    "sin": (lambda s: s.sin(), torch.sin),
    "cos": (lambda s: engine.cos(s), torch.cos),
    "tan": (lambda s: (0.3 * s).tan(), lambda s: torch.tan(0.3 * s)),
    "sqrt": (lambda s: (s * s + 1.0).sqrt(), lambda s: torch.sqrt(s * s + 1.0)),
    "rsqrt": (lambda s: engine.rsqrt(s * s + 0.5), lambda s: torch.rsqrt(s * s + 0.5)),
    "log1p": (lambda s: s.abs().log1p(), lambda s: torch.log1p(s.abs())),
    "expm1": (lambda s: engine.expm1(0.5 * s), lambda s: torch.expm1(0.5 * s)),
    "erf": (lambda s: 2.0 * s.erf(), lambda s: 2.0 * torch.erf(s)),
    "softplus": (lambda s: engine.softplus(3.0 * s), lambda s: torch.nn.functional.softplus(3.0 * s)),
    "square": (lambda s: -engine.square(s), lambda s: -(s**2)),
    "floor": (lambda s: s + engine.floor(4.0 * s) / 4.0, lambda s: s + torch.floor(4.0 * s) / 4.0),
    "ceil": (lambda s: s + math.ceil(2.0 * s), lambda s: s + torch.ceil(2.0 * s)),
    "round": (lambda s: s + round(3.0 * s), lambda s: s + torch.round(3.0 * s)),
    "long": (lambda s: s - (2.0 * s).long(), lambda s: s - (2.0 * s).long()),
    "float_mod": (lambda s: s % 0.75, lambda s: torch.remainder(s, 0.75)),
    "float_floordiv": (lambda s: s + s // 0.5, lambda s: s + torch.div(s, 0.5, rounding_mode="floor")),
}


def _inputs(seed: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (HQ, HKV, HKV))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _module(score_body=None, mask_mod=None) -> AttentionEngine:
    meta = tuple(meta_tensor(B, h, S, D, dtype=torch.float32) for h in (HQ, HKV, HKV))

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        s = score * SCALE
        return score_body(s) if score_body else s

    return AttentionEngine(meta, score_mod=score_mod, mask_mod=mask_mod,
                           online_func=OnlineSoftmax(), backend="reference")


def _torch_attention(q, k, v, score_fn=None, mask=None):
    """The same attention written directly in torch, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    g = HQ // HKV
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * SCALE
    if score_fn is not None:
        s = score_fn(s)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(g, 2))


@pytest.mark.parametrize("name", sorted(MATH))
def test_math_forward_and_gradients_match_torch(name):
    dsl, ref = MATH[name]
    mod = _module(dsl)
    q, k, v = _inputs(seed=len(name), requires_grad=True)
    out = mod(q, k, v)
    do = torch.randn_like(out)
    out.backward(do)
    got = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = _torch_attention(q2, k2, v2, ref)
    want.backward(do.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for n, a, b in zip("qkv", got, (q2.grad, k2.grad, v2.grad), strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5,
                                   msg=f"d{n} of {name}")


def _pos():
    i = torch.arange(S)
    return i.view(-1, 1), i.view(1, -1)


# Masks people write for FlexAttention with integer arithmetic, as DSL and as torch.
MASKS = {
    "dilated": (lambda b, h, q, kv: ((q - kv) % 2 == 0) & (q >= kv),
                lambda q, kv: ((q - kv) % 2 == 0) & (q >= kv)),
    "neighbourhood_2d": (  # a 5 x 8 image, flattened; keys within 1 row and 2 columns
        lambda b, h, q, kv: ((q // 8 - kv // 8).abs() <= 1) & ((q % 8 - kv % 8).abs() <= 2),
        lambda q, kv: ((q // 8 - kv // 8).abs() <= 1) & ((q % 8 - kv % 8).abs() <= 2)),
    "chunked_causal": (lambda b, h, q, kv: (q // 16 == kv // 16) & (q >= kv),
                       lambda q, kv: (q // 16 == kv // 16) & (q >= kv)),
    "negative_divisor": (lambda b, h, q, kv: (q - kv) % -3 == -1,
                         lambda q, kv: torch.remainder(q - kv, -3) == -1),
    "strided_float": (lambda b, h, q, kv: ((q * 0.5).floor() - (kv * 0.5).ceil()).long() >= 0,
                      lambda q, kv: (torch.floor(q * 0.5) - torch.ceil(kv * 0.5)).long() >= 0),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_integer_masks_match_torch(name):
    dsl, ref = MASKS[name]
    q, k, v = _inputs(seed=7)
    mask = ref(*_pos())
    torch.testing.assert_close(_module(mask_mod=dsl)(q, k, v).double(),
                               _torch_attention(q, k, v, None, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("block", [(8, 8), (16, 8), (5, 7)])
def test_block_classes_never_call_a_mixed_block_empty_or_full(name, block):
    dsl, ref = MASKS[name]
    mask = ref(*_pos())
    idx = {n: index_leaf(n) for n in ("b", "h", "q", "kv")}
    expr = Expr.wrap(dsl(idx["b"], idx["h"], idx["q"], idx["kv"]))
    bm, bn = block
    classes = classify(expr, B, HQ, S, S, bm, bn).classes[0, 0]
    for qb in range(classes.shape[0]):
        for kb in range(classes.shape[1]):
            tile = mask[qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
            if classes[qb, kb] == EMPTY:
                assert not tile.any(), (qb, kb)
            if classes[qb, kb] == FULL:
                assert tile.all(), (qb, kb)


def test_affine_floor_division_classifies_whole_chunks_exactly():
    idx = {n: index_leaf(n) for n in ("b", "h", "q", "kv")}
    chunk = Expr.wrap(idx["q"] // 16 == idx["kv"] // 16)
    classes = classify(chunk, 1, 1, 64, 64, 16, 16).classes[0, 0]
    assert torch.equal(classes, torch.eye(4, dtype=torch.int8) * FULL)


@pytest.mark.parametrize("bad, match", [
    (lambda q: q // q, "nonzero constant divisor"),
    (lambda q: q % 0, "nonzero constant divisor"),
    (lambda q: 7 // q, "nonzero constant divisor"),
    (lambda q: (q > 1) % 2, "boolean"),
    (lambda q: round(q * 1.0, 2), "ndigits"),
    (lambda q: q.cosh(), "no operation 'cosh'.*sin, cos"),
])
def test_bad_integer_arithmetic_is_a_clear_error(bad, match):
    with pytest.raises(DSLError, match=match):
        bad(index_leaf("q"))


def test_integer_results_stay_integers():
    q, kv = index_leaf("q"), index_leaf("kv")
    assert (q // 4).dtype == (q % 4).dtype == (q - kv).abs().dtype == "int"
    assert (q * 0.5).long().dtype == "int" and (q // 2.5).dtype == "float"
    assert q.floor() is q and q.long() is q and q.float().dtype == "float"
    assert (q > kv).float().dtype == "float"


class _GpuIntrinsics:
    """The TileLang names an emitted power uses, with the GPU's semantics: pow lowers to
    exp2(c * log2(x)), NaN for a negative base whatever the exponent."""

    @staticmethod
    def pow(x, c):
        return torch.exp2(c * torch.log2(x))

    abs = staticmethod(torch.abs)
    if_then_else = staticmethod(torch.where)
    float32 = staticmethod(float)


@pytest.mark.parametrize("c", [0, 1, 2, 3, 4, 5, 6, -1, -3, 0.5])
def test_emitted_powers_match_torch_on_negative_bases(c):
    from engine.codegen.emit import Emitter

    x = index_leaf("q").float() * 0.5 - 1.25  # any float expression will do
    text = Emitter(lambda n: "x" if n is x else None).text(x.pow(c))
    xs = torch.tensor([-2.5, -1.0, -0.3, 0.4, 1.7], dtype=torch.float64)
    got = eval(text, {"T": _GpuIntrinsics}, {"x": xs})  # noqa: S307 - our own emitted text
    want = xs.pow(c)
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64).expand_as(xs), want,
                               equal_nan=c == 0.5)
