"""engine.flex_attention on the GPU (pytest -m gpu): the generated kernels against torch's
FlexAttention for functions with captured tensors and torch calls, bf16, GQA 4 (issue 19)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import engine
from engine.reference.executor import rel_err

pytestmark = pytest.mark.gpu

B, HQ, HKV, S, D = 2, 8, 2, 1000, 128


def _cases():
    slopes = torch.rand(HQ, device="cuda")
    doc = torch.sort(torch.randint(0, 4, (B, S), device="cuda"), dim=1).values

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def dilated(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 2 == 0) & (q_idx >= kv_idx)

    return {"alibi_document": (alibi, document), "softcap_dilated": (softcap, dilated)}


@pytest.mark.parametrize("name", ["alibi_document", "softcap_dilated"])
def test_front_door_kernels_match_torch_flex(name):
    score_mod, mask_mod = _cases()[name]
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16)
               for h in (HQ, HKV, HKV))
    got = engine.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True,
                                block_mask=engine.create_block_mask(mask_mod, B, None, S, S))
    bm = torch_flex.create_block_mask(mask_mod, B, None, S, S, device="cuda")
    want = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    assert not torch.isnan(got).any()
    assert rel_err(got, want) < 1e-2, f"rel err {rel_err(got, want):.3e}"


def test_front_door_compiles_to_one_graph_on_the_gpu():
    import torch._dynamo

    score_mod, mask_mod = _cases()["alibi_document"]
    bm = engine.create_block_mask(mask_mod, B, None, S, S)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16)
               for h in (HQ, HKV, HKV))

    def call(q, k, v):
        return engine.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                     enable_gqa=True)

    torch._dynamo.reset()
    assert torch._dynamo.explain(call)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True)(q, k, v)
    assert rel_err(got, call(q, k, v)) < 1e-3


def test_front_door_learnable_table_gradient_matches_torch():
    """A captured T5-style table (integer dims (heads, 32), read at [h, bucket]) that requires
    grad: q, k, v and the table's gradients (the table's summed in a shared row per thread
    block) against float32 torch."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    table = torch.randn(HQ, 32, device="cuda", generator=gen).requires_grad_()
    rel = torch.arange(S, device="cuda").view(1, -1) - torch.arange(S, device="cuda").view(-1, 1)
    buckets = (rel > 0).long() * 16 + rel.abs().clamp(max=15)

    def t5(score, b, h, q_idx, kv_idx):
        return score + table[h, buckets[q_idx, kv_idx]]

    q, k, v = (torch.randn(B, h, S, D, device="cuda", generator=gen).bfloat16().requires_grad_()
               for h in (HQ, HKV, HKV))
    out = engine.flex_attention(q, k, v, score_mod=t5, enable_gqa=True)
    do = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    got = torch.autograd.grad(out, (q, k, v, table), do)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v, table)]
    rk, rv = (t.repeat_interleave(HQ // HKV, 1) for t in ref[1:3])
    s = ref[0] @ rk.transpose(-1, -2) / D ** 0.5 + ref[3][:, buckets]
    want = torch.autograd.grad(torch.softmax(s, -1) @ rv, ref, do.float())
    for name, a, w in zip(("dq", "dk", "dv", "dtable"), got, want, strict=True):
        assert not torch.isnan(a).any(), name
        assert rel_err(a, w) < 2e-2, f"{name}: rel err {rel_err(a, w):.3e}"
