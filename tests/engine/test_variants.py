"""The variant library: engine output against each variant's torch formulation, the FlexAttention
and SDPA forms, and unmasked_fraction against brute force."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.reference import executor
from engine.variants import VARIANTS, Variant, get_variant

NAMES = sorted(VARIANTS)
SOFTMAX_PLAIN = {"softmax", "softmax_causal", "softmax_gqa"}  # what SDPA can express


def _shape(v: Variant, Sq: int, Skv: int) -> dict:
    if v.needs_equal_seqlens:
        Skv = Sq
    return dict(
        batch=2, heads_q=4, heads_kv=2, seqlen_q=Sq, seqlen_kv=Skv, head_dim=16, head_dim_v=8
    )


def _customs(inputs):
    return {n: t for n, t in inputs.items() if n not in "qkv"}


@pytest.mark.parametrize(
    "sq,skv", [(40, 40), (24, 40), (40, 21)], ids=["square", "sq<skv", "sq>skv"]
)
@pytest.mark.parametrize("name", NAMES)
def test_engine_matches_torch_reference(name, sq, skv):
    v = VARIANTS[name]
    shape = _shape(v, sq, skv)
    inputs = v.make_inputs(**shape, dtype=torch.float32, seed=sq + skv)
    for n in "qkv":
        assert inputs[n].abs().min() > 0 and inputs[n].std() > 0.5  # random, never zeros
    mod = v.build(**shape, dtype=torch.float32, backend="reference")
    out = mod(inputs["q"], inputs["k"], inputs["v"], **_customs(inputs))
    want = v.torch_reference(inputs, dtype=torch.float64)
    assert out.shape == want.shape == (2, shape["seqlen_q"], 4, 8)
    assert executor.rel_err(out, want) < 1e-5


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_engine_low_precision_matches_torch_reference(name, dtype, tol):
    v = VARIANTS[name]
    shape = _shape(v, 32, 32)
    inputs = v.make_inputs(**shape, dtype=dtype, seed=5)
    mod = v.build(**shape, dtype=dtype, backend="reference")
    out = mod(inputs["q"], inputs["k"], inputs["v"], **_customs(inputs))
    assert out.dtype == dtype
    assert executor.rel_err(out, v.torch_reference(inputs, dtype=torch.float64)) < tol


@pytest.mark.parametrize("block_N", [13, 16])
@pytest.mark.parametrize("name", NAMES)
def test_online_executor_matches_materialized(name, block_N):
    v = VARIANTS[name]
    shape = _shape(v, 40, 40)
    inputs = v.make_inputs(**shape, dtype=torch.float32, seed=7)
    mod = v.build(**shape, dtype=torch.float32, backend="reference")
    args = (mod.spec, inputs["q"], inputs["k"], inputs["v"], _customs(inputs))
    o_m, f_m = executor.forward(*args, dtype=torch.float64)
    o_o, f_o = executor.forward(*args, mode="online", block_N=block_N, dtype=torch.float64)
    torch.testing.assert_close(o_o, o_m, rtol=1e-10, atol=1e-10)
    for n in f_m:
        torch.testing.assert_close(f_o[n], f_m[n], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_and_flex_forms_are_present_as_documented(name):
    v = VARIANTS[name]
    inputs = v.make_inputs(**_shape(v, 24, 24), dtype=torch.float32, seed=1)
    sdpa, flex = v.sdpa_kwargs(inputs), v.flex_mods(inputs)
    if name in SOFTMAX_PLAIN:
        assert sdpa == {"is_causal": v.causal, "scale": 16**-0.5}
    else:
        assert sdpa is None, f"{name}: SDPA cannot express it"
    if v.family != "softmax":
        assert flex is None, f"{name}: FlexAttention cannot express a non-softmax normaliser"
    elif v.mask != "none":
        assert flex is not None and len(flex) == 2 and callable(flex[1])


@pytest.mark.parametrize("name", [n for n in NAMES if n in SOFTMAX_PLAIN])
def test_sdpa_form_matches_engine(name):
    v = VARIANTS[name]
    shape = _shape(v, 24, 40)
    inputs = v.make_inputs(**shape, dtype=torch.float32, seed=2)
    out = v.build(**shape, dtype=torch.float32, backend="reference")(
        inputs["q"], inputs["k"], inputs["v"]
    )
    q, k, vv = (inputs[n].double().transpose(1, 2) for n in "qkv")
    want = F.scaled_dot_product_attention(
        q, k, vv, enable_gqa=True, **v.sdpa_kwargs(inputs)
    ).transpose(1, 2)
    assert executor.rel_err(out, want) < 1e-5


def _dense_flex(v: Variant, inputs: dict, dtype=torch.float64) -> torch.Tensor:
    """Attention evaluated densely with the variant's FlexAttention score_mod/mask_mod."""
    score_mod, mask_mod = v.flex_mods(inputs)
    q, k, vv = (inputs[n].to(dtype) for n in "qkv")
    g = q.shape[2] // k.shape[2]
    k, vv = k.repeat_interleave(g, 2), vv.repeat_interleave(g, 2)
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    qi, ki = torch.arange(Sq).view(1, 1, -1, 1), torch.arange(Skv).view(1, 1, 1, -1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~torch.broadcast_to(mask_mod(b, h, qi, ki), s.shape), -math.inf)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


@pytest.mark.parametrize("name", [n for n in NAMES if VARIANTS[n].flex_fn is not None])
def test_flex_form_matches_engine(name):
    v = VARIANTS[name]
    shape = _shape(v, 40, 40)
    inputs = v.make_inputs(**shape, dtype=torch.float32, seed=3)
    out = v.build(**shape, dtype=torch.float32, backend="reference")(
        inputs["q"], inputs["k"], inputs["v"], **_customs(inputs)
    )
    assert executor.rel_err(out, _dense_flex(v, inputs)) < 1e-5


def _brute_fraction(v: Variant, Sq: int, Skv: int) -> float:
    inputs = v.make_inputs(
        batch=1,
        heads_q=1,
        heads_kv=1,
        seqlen_q=Sq,
        seqlen_kv=Skv,
        head_dim=16,
        head_dim_v=16,
        dtype=torch.float32,
    )
    qi, ki = torch.arange(Sq).view(1, 1, -1, 1), torch.arange(Skv).view(1, 1, 1, -1)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    if v.flex_fn is not None and v.flex_mods(inputs)[1] is not None:
        allowed = torch.broadcast_to(v.flex_mods(inputs)[1](b, h, qi, ki), (1, 1, Sq, Skv))
    elif v.mask == "causal":
        allowed = torch.broadcast_to(qi >= ki, (1, 1, Sq, Skv))
    else:
        assert v.mask == "none"
        allowed = torch.ones(1, 1, Sq, Skv, dtype=torch.bool)
    return allowed.double().mean().item()


# 1300 > the 1024 window/prefix, and not a multiple of the 128 analysis block.
@pytest.mark.parametrize("sq,skv", [(1300, 1300), (700, 1300), (96, 96)])
@pytest.mark.parametrize("name", NAMES)
def test_unmasked_fraction_against_brute_force(name, sq, skv):
    v = VARIANTS[name]
    if v.needs_equal_seqlens and sq != skv:
        pytest.skip(f"{name} needs equal sequence lengths")
    got = v.unmasked_fraction(sq, skv)
    assert got == pytest.approx(_brute_fraction(v, sq, skv), abs=1e-12)
    assert 0 < got <= 1


def test_known_fractions():
    assert VARIANTS["softmax"].unmasked_fraction(100, 100) == 1.0
    assert VARIANTS["softmax_causal"].unmasked_fraction(100, 100) == pytest.approx(101 / 200)


def test_get_variant():
    assert get_variant("alibi") is VARIANTS["alibi"]
    with pytest.raises(ValueError, match=r"unknown variant 'nope'; known: .*softmax_causal"):
        get_variant("nope")


def test_variant_build_refuses_unsupported_shapes():
    with pytest.raises(ValueError, match="variant document: document needs seqlen_q == seqlen_kv"):
        VARIANTS["document"].build(
            batch=1,
            heads_q=2,
            heads_kv=2,
            seqlen_q=16,
            seqlen_kv=32,
            head_dim=8,
            head_dim_v=8,
            dtype=torch.float32,
            backend="reference",
        )
    with pytest.raises(ValueError, match="heads_q=3 is not a multiple of heads_kv=2"):
        VARIANTS["softmax"].build(
            batch=1,
            heads_q=3,
            heads_kv=2,
            seqlen_q=16,
            seqlen_kv=16,
            head_dim=8,
            head_dim_v=8,
            dtype=torch.float32,
            backend="reference",
        )


@pytest.mark.parametrize("name", NAMES)
def test_learnable_inputs_are_float_customs(name):
    v = VARIANTS[name]
    inputs = v.make_inputs(**_shape(v, 16, 16), dtype=torch.float32, requires_grad=True)
    parts = v.spec_parts(**_shape(v, 16, 16))
    for n in v.learnable:
        assert (
            n in parts.custom_fwd_inputs
            and inputs[n].is_floating_point()
            and inputs[n].requires_grad
        )
