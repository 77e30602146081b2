"""AttentionEngine's argument checks: each error names the tensor, the field and the expected
value. Also the two spellings of the mask (mask_mod= / block_mask=)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import (
    AttentionEngine,
    ConfigError,
    CustomIO,
    OnlineSoftmax,
    create_block_mask,
    meta_tensor,
)

B, HQ, HKV, SQ, SKV, D, DV = 2, 4, 2, 12, 20, 8, 16


def _meta(dtype=torch.float32, **over):
    s = dict(B=B, HQ=HQ, HKV=HKV, SQ=SQ, SKV=SKV, D=D, DV=DV) | over
    return (
        meta_tensor(s["B"], s["HQ"], s["SQ"], s["D"], dtype=dtype),
        meta_tensor(s["B"], s["HKV"], s["SKV"], s["D"], dtype=dtype),
        meta_tensor(s["B"], s["HKV"], s["SKV"], s["DV"], dtype=dtype),
    )


def _qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, SQ, HQ, D, generator=g).to(dtype),
        torch.randn(B, SKV, HKV, D, generator=g).to(dtype),
        torch.randn(B, SKV, HKV, DV, generator=g).to(dtype),
    )


def _sm(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
    return score * (1 / math.sqrt(D))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


IO = CustomIO({"bias": ("heads",), "qs": ("batch", "seq_len")})


def _sm_io(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
    return score * (1 / math.sqrt(D)) + custom_fwd_inputs["bias"] + custom_fwd_inputs["qs"]


def _customs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"bias": torch.randn(HQ, generator=g), "qs": torch.randn(B, SQ, generator=g)}


@pytest.fixture(scope="module")
def mod():
    return AttentionEngine(_meta(), IO, score_mod=_sm_io, mask_mod=causal, backend="reference")


# ----------------------------------------------------------------------------- runtime tensors
def _replace(i, t):
    q, k, v = _qkv()
    return tuple(t if j == i else x for j, x in enumerate((q, k, v)))


@pytest.mark.parametrize(
    "which,bad,match",
    [
        (
            0,
            lambda: torch.randn(B, HQ, SQ, D),
            r"q: shape \(2, 4, 12, 8\) does not match qkv_meta; expected "
            r"\(2, 12, 4, 8\) \(runtime layout \[B, S, H, D\]\)",
        ),
        (
            1,
            lambda: torch.randn(B, SKV, HQ, D),
            r"k: shape \(2, 20, 4, 8\) .*expected \(2, 20, 2, 8\)",
        ),
        (
            2,
            lambda: torch.randn(B, SKV, HKV, D),
            r"v: shape \(2, 20, 2, 8\) .*expected \(2, 20, 2, 16\)",
        ),
        (0, lambda: torch.randn(B, SQ, HQ), r"q: shape \(2, 12, 4\) does not match qkv_meta"),
        (
            1,
            lambda: torch.randn(B, SKV, HKV, D, dtype=torch.float64),
            r"k: dtype torch.float64; expected torch.float32 \(from qkv_meta\)",
        ),
        (
            2,
            lambda: torch.randn(B, SKV, HKV, DV).half(),
            r"v: dtype torch.float16; expected torch.float32",
        ),
        (
            1,
            lambda: torch.randn(B, SKV, HKV, D, device="meta"),
            r"k: on meta; expected cpu \(the device of q\)",
        ),
        (
            2,
            lambda: torch.randn(B, SKV, HKV, DV * 2)[..., ::2],
            r"v: last-dim stride 2; expected 1 \(call .contiguous\(\)\)",
        ),
        (0, lambda: torch.randn(B, SQ, HQ, D).numpy(), r"q: expected a torch.Tensor, got ndarray"),
    ],
)
def test_runtime_tensor_errors(mod, which, bad, match):
    args = _replace(which, bad())
    with pytest.raises((ValueError, TypeError), match=match):
        mod(*args, **_customs())


def test_strided_inputs_with_unit_last_dim_are_accepted(mod):
    """A transposed-storage q (strided heads) is accepted: only the last dim must be unit-stride."""
    q, k, v = _qkv()
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q2.is_contiguous() and q2.stride(-1) == 1
    torch.testing.assert_close(mod(q2, k, v, **_customs()), mod(q, k, v, **_customs()))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (
            lambda m, q, k, v, c: m(q, k, v),
            TypeError,
            r"missing custom input 'bias' \(declared dims \('heads',\)\)",
        ),
        (lambda m, q, k, v, c: m(q, k, v, bias=c["bias"]), TypeError, r"missing custom input 'qs'"),
        (
            lambda m, q, k, v, c: m(q, k, v, c["bias"], c["qs"], c["qs"]),
            TypeError,
            r"got 3 positional custom inputs; declared: \['bias', 'qs'\]",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, **c, extra=c["bias"]),
            TypeError,
            r"unexpected input 'extra'; declared CustomIO inputs: \['bias', 'qs'\]",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, c["bias"], bias=c["bias"], qs=c["qs"]),
            TypeError,
            r"custom input 'bias' given twice",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, bias=c["bias"][:2], qs=c["qs"]),
            ValueError,
            r"custom input 'bias': shape \(2,\); expected \(4,\) \(dims \('heads',\)\)",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, bias=c["bias"], qs=c["qs"].t()),
            ValueError,
            r"custom input 'qs': shape \(12, 2\); expected \(2, 12\) "
            r"\(dims \('batch', 'seq_len'\)\)",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, bias=[1.0] * HQ, qs=c["qs"]),
            TypeError,
            r"custom input 'bias': expected a torch.Tensor, got list",
        ),
        (
            lambda m, q, k, v, c: m(q, k, v, bias=c["bias"].to("meta"), qs=c["qs"]),
            ValueError,
            r"custom input 'bias': on meta; expected cpu",
        ),
    ],
)
def test_custom_input_errors(mod, call, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        call(mod, q, k, v, _customs())


def test_custom_inputs_positional_or_by_name_give_the_same_result(mod):
    q, k, v = _qkv()
    c = _customs()
    a = mod(q, k, v, c["bias"], c["qs"])
    b = mod(q, k, v, qs=c["qs"], bias=c["bias"])
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and the custom tensors matter
    c2 = _customs(seed=2)
    assert not torch.allclose(a, mod(q, k, v, **c2))


def test_no_customs_declared_refuses_extra_input():
    m = AttentionEngine(_meta(), score_mod=_sm, backend="reference")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"got 1 positional custom inputs; declared: none"):
        m(q, k, v, torch.randn(3))


# ----------------------------------------------------------------------------- qkv_meta and options
@pytest.mark.parametrize(
    "meta,match",
    [
        (
            lambda: _meta(HQ=6, HKV=4),
            r"qkv_meta: q heads 6 must be a multiple of kv heads 4 \(GQA\)",
        ),
        (
            lambda: (_meta()[0], _meta(dtype=torch.float16)[1], _meta()[2]),
            r"qkv_meta: q, k, v dtypes differ: torch.float32, torch.float16, torch.float32",
        ),
        (
            lambda: (torch.empty(B, HQ, SQ, D, dtype=torch.float64, device="meta"),) * 3,
            r"qkv_meta: dtype torch.float64 not supported",
        ),
        (
            lambda: (_meta()[0], _meta(B=3)[1], _meta()[2]),
            r"qkv_meta: batch sizes differ \(q 2, k 3, v 2\)",
        ),
        (
            lambda: (_meta()[0], _meta(D=16)[1], _meta()[2]),
            r"qkv_meta: k head dim 16 != q head dim 8",
        ),
        (
            lambda: (_meta()[0], _meta()[1], _meta(SKV=21)[2]),
            r"qkv_meta: v \(H=2, S=21\) must match k \(H=2, S=20\)",
        ),
        (lambda: _meta()[:2], r"qkv_meta: expected a tuple of 3 meta tensors"),
        (
            lambda: (_meta()[0], torch.empty(2, 3), _meta()[2]),
            r"qkv_meta\[k\]: expected a 4-d tensor",
        ),
    ],
)
def test_bad_qkv_meta(meta, match):
    with pytest.raises(ValueError, match=match):
        AttentionEngine(meta(), score_mod=_sm, backend="reference")


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 2, 3, 4), r"meta_tensor\(B, H, S, D\): expected 4 positive ints, got \(0, 2, 3, 4\)"),
        ((1, 2, 3), r"expected 4 positive ints"),
    ],
)
def test_bad_meta_tensor(args, match):
    with pytest.raises(ValueError, match=match):
        meta_tensor(*args)
    with pytest.raises(ValueError, match=r"meta_tensor: dtype torch.int32 not supported"):
        meta_tensor(1, 2, 3, 4, dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(backend="cuda"),
            r"backend='cuda': expected one of \('auto', 'reference', 'tilelang'\)",
        ),
        (dict(config={"block_M": 64}), r"config: expected a KernelConfig, got dict"),
        (dict(tune="yes"), r"tune: expected a bool, got 'yes'"),
        (dict(mask_mod=causal, block_mask=causal), r"give the mask once: mask_mod= or block_mask="),
    ],
)
def test_bad_engine_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionEngine(_meta(), score_mod=_sm, **kwargs)
    assert issubclass(ConfigError, Exception)


# ----------------------------------------------------------------------------- mask spellings
def _sdpa_causal(q, k, v):
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, enable_gqa=True
    ).transpose(1, 2)


@pytest.mark.parametrize("how", ["mask_mod", "block_mask_fn", "block_mask_obj"])
def test_mask_spellings_agree(how):
    q, k, v = _qkv(seed=3)
    if how == "mask_mod":
        kw = dict(mask_mod=causal)
    elif how == "block_mask_fn":
        kw = dict(block_mask=causal)  # seed 002 passes the function itself
    else:
        kw = dict(block_mask=create_block_mask(causal, B, HQ, SQ, SKV, BLOCK_SIZE=4))
    m = AttentionEngine(
        _meta(), CustomIO({}), score_mod=_sm, online_func=OnlineSoftmax(), backend="reference", **kw
    )
    ref = AttentionEngine(_meta(), score_mod=_sm, mask_mod=causal, backend="reference")
    assert m.spec_hash == ref.spec_hash
    out = m(q, k, v)
    torch.testing.assert_close(out.double(), _sdpa_causal(q, k, v), rtol=1e-5, atol=1e-5)


def test_introspection():
    m = AttentionEngine(_meta(), score_mod=_sm, mask_mod=causal, backend="reference")
    assert m.spec_hash in m.ir_text and "mask = ge(q_idx, kv_idx)" in m.ir_text
    r = repr(m)
    assert f"spec={m.spec_hash}" in r and "Hq=4" in r and "Hkv=2" in r and "backend=reference" in r
    assert m.resolved_backend(torch.device("cpu")) == "reference"
    auto = AttentionEngine(_meta(), score_mod=_sm, backend="auto")
    assert auto.resolved_backend(torch.device("cpu")) == "reference"  # no Hopper GPU here
