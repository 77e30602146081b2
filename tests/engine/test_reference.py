"""The reference executor: materialised and block-online forwards agree with each other and with
torch's scaled_dot_product_attention; fully masked rows; fp16/bf16/fp32 inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import AttentionEngine, OnlineIdentity, OnlineRetention, OnlineSoftmax, meta_tensor
from engine.ir.trace import trace_spec
from engine.reference import executor


def _inputs(B=2, Hq=4, Hkv=2, Sq=40, Skv=56, D=16, Dv=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Sq, Hq, D, generator=g).to(dtype),
        torch.randn(B, Skv, Hkv, D, generator=g).to(dtype),
        torch.randn(B, Skv, Hkv, Dv, generator=g).to(dtype),
    )


def _scale_mod(D):
    c = 1.0 / math.sqrt(D)

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * c

    return score_mod


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _sdpa(q, k, v, causal_: bool):
    """SDPA in float64 on [B,S,H,D] tensors (GQA by repeating k/v heads)."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal_).transpose(1, 2)


SHAPES = {
    "gqa_sq_lt_skv_dv_ne_d": dict(B=2, Hq=4, Hkv=2, Sq=40, Skv=56, D=16, Dv=24),
    "mha_sq_gt_skv": dict(B=1, Hq=3, Hkv=3, Sq=50, Skv=33, D=8, Dv=8),
    "mqa_square": dict(B=2, Hq=4, Hkv=1, Sq=37, Skv=37, D=16, Dv=8),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_softmax_materialized_matches_sdpa(shape, is_causal):
    q, k, v = _inputs(**shape)
    spec = trace_spec(_scale_mod(shape["D"]), causal if is_causal else None, OnlineSoftmax())
    o, fin = executor.forward(spec, q, k, v, mode="materialized", dtype=torch.float64)
    torch.testing.assert_close(o, _sdpa(q, k, v, is_causal), rtol=1e-10, atol=1e-10)
    # The final row scale is the log-sum-exp of the scaled scores.
    g = shape["Hq"] // shape["Hkv"]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) / math.sqrt(
        shape["D"]
    )
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    rows = torch.isfinite(lse)
    torch.testing.assert_close(fin["lse"][rows.expand_as(fin["lse"])], lse[rows.expand_as(lse)])


# block_N values: dividing Skv (8, 28), not dividing it (5, 17), one block (56), larger (64).
@pytest.mark.parametrize("block_N", [5, 8, 17, 28, 56, 64])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_softmax_online_matches_materialized_and_sdpa(block_N, is_causal):
    shape = SHAPES["gqa_sq_lt_skv_dv_ne_d"]
    q, k, v = _inputs(**shape, seed=block_N)
    spec = trace_spec(_scale_mod(shape["D"]), causal if is_causal else None, OnlineSoftmax())
    o_m, f_m = executor.forward(spec, q, k, v, mode="materialized", dtype=torch.float64)
    o_o, f_o = executor.forward(spec, q, k, v, mode="online", block_N=block_N, dtype=torch.float64)
    torch.testing.assert_close(o_o, o_m, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_o["lse"], f_m["lse"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o_o, _sdpa(q, k, v, is_causal), rtol=1e-10, atol=1e-10)


def _retention_torch(q, k, v, allowed):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    s = s * allowed
    r = s.abs().sum(-1, keepdim=True).clamp(min=1.0)
    return torch.einsum("bhqk,bkhd->bqhd", s / r, v.double())


@pytest.mark.parametrize("block_N", [7, 16, 33])
@pytest.mark.parametrize("online", ["retention", "identity"])
def test_other_normalisers_online_matches_materialized(block_N, online):
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, Sq=30, Skv=33, D=8, Dv=8, seed=3)
    of = OnlineRetention() if online == "retention" else OnlineIdentity()
    spec = trace_spec(_scale_mod(8), causal, of)
    o_m, f_m = executor.forward(spec, q, k, v, dtype=torch.float64)
    o_o, f_o = executor.forward(spec, q, k, v, mode="online", block_N=block_N, dtype=torch.float64)
    torch.testing.assert_close(o_o, o_m, rtol=1e-10, atol=1e-10)
    for n in f_m:
        torch.testing.assert_close(f_o[n], f_m[n], rtol=1e-10, atol=1e-10)
    allowed = torch.ones(30, 33).tril().bool()
    if online == "retention":
        want = _retention_torch(q, k, v, allowed)
    else:
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(8) * allowed
        want = torch.einsum("bhqk,bkhd->bqhd", s, v.double())
    torch.testing.assert_close(o_m, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode,block_N", [("materialized", 64), ("online", 6), ("online", 13)])
@pytest.mark.parametrize("online", ["softmax", "retention"])
def test_fully_masked_rows_give_zeros_not_nan(mode, block_N, online):
    q, k, v = _inputs(B=2, Hq=2, Hkv=2, Sq=24, Skv=26, D=8, Dv=8, seed=4)

    def mask_mod(b, h, q_idx, kv_idx):  # rows 0..6 see nothing; others are causal from key 5
        return (q_idx >= kv_idx) & (kv_idx >= 5) & (q_idx >= 7)

    of = OnlineSoftmax() if online == "softmax" else OnlineRetention()
    spec = trace_spec(_scale_mod(8), mask_mod, of)
    o, fin = executor.forward(spec, q, k, v, mode=mode, block_N=block_N, dtype=torch.float64)
    assert not torch.isnan(o).any() and all(not torch.isnan(f).any() for f in fin.values())
    assert torch.equal(o[:, :7], torch.zeros_like(o[:, :7]))
    assert (o[:, 7:].abs().sum(-1) > 0).all()
    # Rows with no key report the epilogue's value at the initial state: lse = log(0) + (-inf)
    # for softmax, r = max(0, 1) for retention.
    ((n, f),) = fin.items()
    empty_row = -math.inf if online == "softmax" else 1.0
    assert torch.equal(f[:, :, :7], torch.full_like(f[:, :, :7], empty_row)), n
    assert torch.isfinite(f[:, :, 7:]).all()
    qi, ki = torch.arange(24).view(-1, 1), torch.arange(26).view(1, -1)
    allowed = (qi >= ki) & (ki >= 5) & (qi >= 7)
    if online == "softmax":
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(8)
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~allowed, -math.inf), -1), nan=0.0)
        want = torch.einsum("bhqk,bkhd->bqhd", p, v.double())
    else:
        want = _retention_torch(q, k, v, allowed)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_backward_is_finite():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, Sq=16, Skv=16, D=8, Dv=8, seed=5)
    meta = tuple(
        meta_tensor(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype)
        for t in (q, k, v)
    )
    mod = AttentionEngine(
        meta,
        score_mod=_scale_mod(8),
        mask_mod=lambda b, h, qi, ki: (qi >= ki) & (qi >= 4),
        backend="reference",
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = mod(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    assert torch.equal(leaves[0].grad[:, :4], torch.zeros_like(leaves[0].grad[:, :4]))


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]
)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_engine_dtypes_match_sdpa(dtype, tol, is_causal):
    q, k, v = _inputs(B=1, Hq=4, Hkv=2, Sq=32, Skv=48, D=16, Dv=16, seed=6, dtype=dtype)
    meta = tuple(
        meta_tensor(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=dtype) for t in (q, k, v)
    )
    mod = AttentionEngine(
        meta, score_mod=_scale_mod(16), mask_mod=causal if is_causal else None, backend="reference"
    )
    out, fin = mod(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == (1, 32, 4, 16)
    assert fin["lse"].shape == (1, 4, 32)
    # Against SDPA on the same (rounded) inputs in float64: only the output rounding differs.
    want = _sdpa(q, k, v, is_causal)
    assert executor.rel_err(out, want) < tol
    # ...and the online executor at this dtype agrees with the materialised one.
    spec = mod.spec
    o_on, _ = executor.forward(spec, q, k, v, mode="online", block_N=12)
    o_ma, _ = executor.forward(spec, q, k, v)
    torch.testing.assert_close(o_on, o_ma, rtol=1e-5, atol=1e-5)


def test_q_chunking_does_not_change_the_result():
    q, k, v = _inputs(B=1, Hq=2, Hkv=2, Sq=45, Skv=45, D=8, Dv=8, seed=7)
    spec = trace_spec(_scale_mod(8), causal, OnlineSoftmax())
    o1, f1 = executor.forward(spec, q, k, v, dtype=torch.float64)
    o2, f2 = executor.forward(spec, q, k, v, dtype=torch.float64, q_chunk=16)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(f1["lse"], f2["lse"], rtol=0, atol=1e-12)


def test_bad_mode_is_refused():
    q, k, v = _inputs(B=1, Hq=1, Hkv=1, Sq=4, Skv=4, D=4, Dv=4)
    spec = trace_spec(None, None, OnlineSoftmax())
    with pytest.raises(ValueError, match="mode='blocked': expected 'materialized' or 'online'"):
        executor.forward(spec, q, k, v, mode="blocked")


def test_rel_err_flags_nan():
    x = torch.randn(4)
    assert math.isnan(executor.rel_err(x.clone().fill_(math.nan), x))
    assert executor.rel_err(x, x) == 0.0


@pytest.mark.parametrize("name", ["alibi", "document", "retnet", "sigmoid"])
def test_first_group_slice_is_the_slice_of_the_full_problem(name):
    """What the tuner checks a full-size kernel against: the reference of batch 0 and kv head
    0's query heads equals that part of the full reference, output and gradients."""
    from engine.reference.executor import backward, first_group, forward
    from engine.variants import VARIANTS

    v = VARIANTS[name]
    sizes = dict(batch=2, heads_q=6, heads_kv=2, seqlen_q=96, seqlen_kv=96, head_dim=32,
                 head_dim_v=32)
    mod = v.build(**sizes, dtype=torch.float32, backend="reference")
    inp = v.make_inputs(**sizes, dtype=torch.float32, device="cpu", seed=5)
    customs = {n: inp[n] for n in mod.custom_io.names()}
    o, fin = forward(mod.spec, inp["q"], inp["k"], inp["v"], customs)
    do = torch.randn_like(o)
    full = backward(mod.spec, inp["q"], inp["k"], inp["v"], customs, o, fin, do)
    sq, sk, sv, sc = first_group(inp["q"], inp["k"], inp["v"], customs, mod.custom_io.decls)
    assert sq.shape[:3] == (1, 96, 3) and sk.shape[:3] == (1, 96, 1)
    so, sfin = forward(mod.spec, sq, sk, sv, sc)
    torch.testing.assert_close(so, o[:1, :, :3])
    part = backward(mod.spec, sq, sk, sv, sc, so, sfin, do[:1, :, :3])
    torch.testing.assert_close(part[0], full[0][:1, :, :3])
    torch.testing.assert_close(part[1], full[1][:1, :, :1])
    torch.testing.assert_close(part[2], full[2][:1, :, :1])
