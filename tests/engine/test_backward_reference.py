"""The backward through the user's rules (reference backend) against torch autograd through
independent forward formulations: every library variant, learnable CustomIO tensors, GQA,
Dv != D, retain_graph, a non-contiguous incoming gradient, and no_grad."""

from __future__ import annotations

import math

import pytest
import torch

from engine import (
    AttentionEngine,
    CustomIO,
    OnlineFunc,
    OnlineSoftmax,
    SymbolScalar,
    Var,
    meta_tensor,
)
from engine.reference import executor
from engine.variants import VARIANTS

SHAPE = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=24, seqlen_kv=24, head_dim=16, head_dim_v=24)


def _run_engine(variant, inputs, do, **build):
    mod = variant.build(**SHAPE, dtype=inputs["q"].dtype, backend="reference", **build)
    customs = {n: t for n, t in inputs.items() if n not in "qkv"}
    out = mod(inputs["q"], inputs["k"], inputs["v"], **customs)
    out.backward(do)
    return out


def _grads(inputs, names):
    return {n: inputs[n].grad for n in names}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_backward_matches_autograd_of_torch_reference(name):
    v = VARIANTS[name]
    wrt = ("q", "k", "v", *v.learnable)
    inputs = v.make_inputs(**SHAPE, dtype=torch.float32, seed=1, requires_grad=True)
    assert all(inputs[n].requires_grad for n in wrt)
    do = torch.randn(2, 24, 4, 24, generator=torch.Generator().manual_seed(2))
    out = _run_engine(v, inputs, do)
    got = _grads(inputs, wrt)

    ref_inputs = {n: t.detach().clone().requires_grad_(n in wrt) for n, t in inputs.items()}
    want_out = v.torch_reference(ref_inputs, dtype=torch.float64)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    want_out.backward(do.double())
    for n in wrt:
        assert got[n] is not None, f"{name}: no gradient for {n}"
        assert got[n].shape == inputs[n].shape and got[n].dtype == inputs[n].dtype
        err = executor.rel_err(got[n], ref_inputs[n].grad)
        assert err < 1e-5, f"{name}: d{n} rel err {err:.2e}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_backward_matches_autograd_through_the_evaluator(name):
    """The materialised reference forward is differentiable: autograd through it is a second,
    independent derivation of the same gradients (float64 all the way)."""
    v = VARIANTS[name]
    wrt = ("q", "k", "v", *v.learnable)
    inputs = v.make_inputs(**SHAPE, dtype=torch.float32, seed=3)
    inputs = {n: (t.double() if t.is_floating_point() else t) for n, t in inputs.items()}
    mod = v.build(**SHAPE, dtype=torch.float32, backend="reference")
    spec, names = mod.spec, mod.custom_io.names()
    do = torch.randn(2, 24, 4, 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    leaves = {n: t.clone().requires_grad_(n in wrt) for n, t in inputs.items()}
    customs = {n: leaves[n] for n in names}
    o, _ = executor.forward(
        spec, leaves["q"], leaves["k"], leaves["v"], customs, dtype=torch.float64
    )
    o.backward(do)
    o2, fin = executor.forward(
        spec,
        inputs["q"],
        inputs["k"],
        inputs["v"],
        {n: inputs[n] for n in names},
        dtype=torch.float64,
    )
    dq, dk, dv, cg = executor.backward(
        spec,
        inputs["q"],
        inputs["k"],
        inputs["v"],
        {n: inputs[n] for n in names},
        o2,
        fin,
        do,
        dtype=torch.float64,
        custom_grads=tuple(v.learnable),
    )
    got = {"q": dq, "k": dk, "v": dv, **cg}
    for n in wrt:
        torch.testing.assert_close(
            got[n], leaves[n].grad, rtol=1e-9, atol=1e-10, msg=f"{name}: d{n}"
        )


def _softmax_module(B=1, Hq=4, Hkv=2, Sq=20, Skv=28, D=8, Dv=12, dtype=torch.float32, mask=True):
    meta = (
        meta_tensor(B, Hq, Sq, D, dtype=dtype),
        meta_tensor(B, Hkv, Skv, D, dtype=dtype),
        meta_tensor(B, Hkv, Skv, Dv, dtype=dtype),
    )
    c = 1 / math.sqrt(D)
    return AttentionEngine(
        meta,
        CustomIO({}),
        score_mod=lambda s, io, b, h, qi, ki: s * c,
        mask_mod=(lambda b, h, qi, ki: qi >= ki) if mask else None,
        online_func=OnlineSoftmax(),
        backend="reference",
    )


def _qkv(B=1, Hq=4, Hkv=2, Sq=20, Skv=28, D=8, Dv=12, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, Sq, Hq, D, generator=g).to(dtype).requires_grad_(True),
        torch.randn(B, Skv, Hkv, D, generator=g).to(dtype).requires_grad_(True),
        torch.randn(B, Skv, Hkv, Dv, generator=g).to(dtype).requires_grad_(True),
    ]


def _sdpa_grads(q, k, v, do, causal=True):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, enable_gqa=True
    ).transpose(1, 2)
    out.backward(do.double())
    return out, [t.grad for t in leaves]


def test_gqa_dv_ne_d_grads_match_sdpa():
    mod, (q, k, v) = _softmax_module(), _qkv()
    out = mod(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(do)
    want, grads = _sdpa_grads(q, k, v, do)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for t, g in zip((q, k, v), grads, strict=True):
        torch.testing.assert_close(t.grad.double(), g, rtol=1e-4, atol=1e-5)


def test_retain_graph_accumulates_the_same_gradient_twice():
    mod, (q, k, v) = _softmax_module(), _qkv(seed=1)
    out = mod(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(10))
    out.backward(do, retain_graph=True)
    first = [t.grad.clone() for t in (q, k, v)]
    out.backward(do)
    for t, g in zip((q, k, v), first, strict=True):
        torch.testing.assert_close(t.grad, 2 * g)


def test_non_contiguous_incoming_gradient():
    mod, (q, k, v) = _softmax_module(), _qkv(seed=2)
    out = mod(q, k, v)
    # A gradient that is a transposed view (same shape as out, different strides).
    base = torch.randn(
        out.shape[0],
        out.shape[2],
        out.shape[1],
        out.shape[3],
        generator=torch.Generator().manual_seed(11),
    )
    do = base.transpose(1, 2)
    assert do.shape == out.shape and not do.is_contiguous()
    out.backward(do)
    _, grads = _sdpa_grads(q, k, v, do.contiguous())
    for t, g in zip((q, k, v), grads, strict=True):
        torch.testing.assert_close(t.grad.double(), g, rtol=1e-4, atol=1e-5)


def test_no_grad_builds_no_graph():
    mod, (q, k, v) = _softmax_module(), _qkv(seed=3)
    with torch.no_grad():
        out = mod(q, k, v)
    assert out.grad_fn is None and not out.requires_grad
    with_grad = mod(q, k, v)
    torch.testing.assert_close(out, with_grad.detach())


def test_only_some_inputs_require_grad():
    mod, (q, k, v) = _softmax_module(), _qkv(seed=4)
    k2, v2 = k.detach(), v.detach()
    out = mod(q, k2, v2)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(12))
    out.backward(do)
    _, grads = _sdpa_grads(q, k, v, do)
    torch.testing.assert_close(q.grad.double(), grads[0], rtol=1e-4, atol=1e-5)
    assert k2.grad is None and v2.grad is None


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_low_precision_grads_keep_dtype_and_match(dtype, tol):
    mod, (q, k, v) = _softmax_module(dtype=dtype), _qkv(seed=5, dtype=dtype)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = mod(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(13)).to(dtype)
    out.backward(do)
    _, grads = _sdpa_grads(q, k, v, do)
    for t, g in zip((q, k, v), grads, strict=True):
        assert t.grad.dtype == dtype
        assert executor.rel_err(t.grad, g) < tol


def test_masked_entries_with_overflowing_score_mod_derivative_give_finite_grads():
    """RetNet-style decay exp((q-kv)*log_decay) overflows above the diagonal (masked) when the
    decay is strong; masked entries must not poison the gradients."""
    v = VARIANTS["retnet"]
    shape = dict(SHAPE, heads_kv=4, seqlen_q=128, seqlen_kv=128)
    inputs = v.make_inputs(**shape, dtype=torch.float32, seed=6, requires_grad=True)
    with torch.no_grad():
        inputs["log_decay"].fill_(-1.0)  # exp(127) overflows float32 at masked (q < kv) entries
    mod = v.build(**shape, dtype=torch.float32, backend="reference")
    out = mod(inputs["q"], inputs["k"], inputs["v"], inputs["log_decay"])
    assert torch.isfinite(out).all()
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(14)))
    for n in ("q", "k", "v", "log_decay"):
        assert torch.isfinite(inputs[n].grad).all(), n


_TEMP_IO = CustomIO({"temp": ("heads",)})


class _TempSoftmax(OnlineFunc):
    """softmax(temp[h] * s): the learnable temperature is read in the online functions only."""

    def __init__(self):
        super().__init__(
            {"m": SymbolScalar("m", Var("-inf")), "r": SymbolScalar("r", Var(0.0))},
            {"lse": SymbolScalar("lse", Var(0.0))},
        )

    @staticmethod
    def online_fwd(scores, rs, b, h, q_idx):
        return OnlineSoftmax.online_fwd(scores * _TEMP_IO["temp"], rs, b, h, q_idx)

    @staticmethod
    def online_fwd_epilogue(o, rs, b, h, q_idx):
        return OnlineSoftmax.online_fwd_epilogue(o, rs, b, h, q_idx)

    @staticmethod
    def forward(scores, fin, b, h, q_idx, kv_idx):
        return (scores * _TEMP_IO["temp"] - fin["lse"]).exp()

    @staticmethod
    def backward(dp, p, fin, doosum, b, h, q_idx, kv_idx):
        return (dp - doosum) * p * _TEMP_IO["temp"]


def test_learnable_customio_read_in_online_functions_is_not_silently_zero():
    q, k, v = (t.detach() for t in _qkv(seed=7))
    q.requires_grad_(True)
    temp = (torch.rand(4, generator=torch.Generator().manual_seed(3)) + 0.5).requires_grad_(True)
    meta = (
        meta_tensor(1, 4, 20, 8, dtype=torch.float32),
        meta_tensor(1, 2, 28, 8, dtype=torch.float32),
        meta_tensor(1, 2, 28, 12, dtype=torch.float32),
    )
    mod = AttentionEngine(
        meta,
        _TEMP_IO,
        score_mod=lambda s, io, b, h, qi, ki: s * (8**-0.5),
        online_func=_TempSoftmax(),
        backend="reference",
    )
    out = mod(q, k, v, temp)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(15))
    try:
        out.backward(do)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        assert "temp" in str(exc)  # a clear refusal naming the input is acceptable
        return
    ref_t = temp.detach().double().requires_grad_(True)
    kh, vh = (t.double().repeat_interleave(2, 2) for t in (k, v))
    s = (
        torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), kh)
        * (8**-0.5)
        * ref_t.view(1, -1, 1, 1)
    )
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vh)
    want.backward(do.double())
    torch.testing.assert_close(temp.grad.double(), ref_t.grad, rtol=1e-4, atol=1e-6)
