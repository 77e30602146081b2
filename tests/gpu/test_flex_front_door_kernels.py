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
