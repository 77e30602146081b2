"""engine.flex_attention and engine.create_block_mask against torch's FlexAttention (eager, on
the CPU) for functions written as FlexAttention's users write them: torch calls, tensors
captured from the scope, GQA, the log-sum-exp, gradients of a captured tensor; the module cache;
table lookups (a learnable relative-bias table, T5 buckets), the errors (issue 19)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import engine
from engine import TraceError
from engine.flex import _MODULES

B, HQ, S, D = 2, 4, 48, 16
GEN = torch.Generator().manual_seed(19)
SLOPES = torch.tensor([2.0 ** (-8.0 * (i + 1) / HQ) for i in range(HQ)])
DOC = torch.cat([torch.zeros(B, 20, dtype=torch.long), torch.ones(B, 17, dtype=torch.long),
                 torch.full((B, S - 37), 2, dtype=torch.long)], 1)
DOC[1, :9] = 3  # the second sequence's documents differ
PREFIX = torch.tensor([10, 30])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 16)


def document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


def dilated(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 2 == 0) & (q_idx >= kv_idx)


def neighbourhood_2d(b, h, q_idx, kv_idx):  # a 6 x 8 image, flattened
    return (torch.abs(q_idx // 8 - kv_idx // 8) <= 1) & (torch.abs(q_idx % 8 - kv_idx % 8) <= 2)


REL = torch.randn(HQ, 2 * S - 1, generator=GEN)
_d = torch.arange(S).view(1, -1) - torch.arange(S).view(-1, 1)  # kv_idx - q_idx
# T5's relative buckets, precomputed as its users do (bidirectional, 16 per direction)
T5_BUCKETS = (_d > 0).long() * 16 + torch.where(
    _d.abs() < 8, _d.abs(),
    (8 + torch.log(_d.abs().clamp(min=1) / 8.0) / math.log(128 / 8) * 8).long().clamp(max=15))
T5_TABLE = torch.randn(HQ, 32, generator=GEN)
GATE = torch.randn(HQ, generator=GEN)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + REL[h, q_idx - kv_idx + S - 1]


def t5_bias(score, b, h, q_idx, kv_idx):
    return score + T5_TABLE[h, T5_BUCKETS[q_idx, kv_idx]]


def key_gate(score, b, h, q_idx, kv_idx):  # a per-head learned gate on the keys
    return score * torch.sigmoid(GATE[h])


TEMP = torch.tensor(0.7)


def torch_calls(score, b, h, q_idx, kv_idx):
    """Scalar tensor on the left, clamp, where, maximum, relu, as torch code is written."""
    s = TEMP * torch.clamp(score, -2.0, 2.0) + torch.nn.functional.relu(score) * 0.1
    s = torch.where(q_idx >= kv_idx, s, torch.maximum(s - 1.0, s * 0.5))
    return s + torch.sin(score) * torch.sqrt(torch.abs(score) + 1.0)


CATALOGUE = {
    "alibi": (alibi, None), "softcap": (softcap, None), "sliding_window": (None, sliding_window),
    "document": (None, document), "prefix_lm": (None, prefix_lm), "dilated": (None, dilated),
    "neighbourhood_2d": (None, neighbourhood_2d), "softcap_causal_window": (softcap, sliding_window),
    "torch_calls": (torch_calls, prefix_lm), "relative_bias": (relative_bias, None),
    "t5_bias": (t5_bias, None), "key_gate": (key_gate, sliding_window),
}


def _qkv(hkv=HQ, requires_grad=False):
    return [torch.randn(B, h, S, D, generator=GEN).requires_grad_(requires_grad)
            for h in (HQ, hkv, hkv)]


def _torch(q, k, v, score_mod, mask_mod, **kw):
    bm = torch_flex.create_block_mask(mask_mod, B, None, S, S, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # return_lse's deprecation note
        return torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, **kw)


def _engine(q, k, v, score_mod, mask_mod, **kw):
    bm = engine.create_block_mask(mask_mod, B, None, S, S, device="cpu") if mask_mod else None
    return engine.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, **kw)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_catalogue_matches_torch_flex(name):
    score_mod, mask_mod = CATALOGUE[name]
    q, k, v = _qkv()
    torch.testing.assert_close(_engine(q, k, v, score_mod, mask_mod),
                               _torch(q, k, v, score_mod, mask_mod), rtol=2e-5, atol=2e-5)


def test_gqa_scale_and_lse_match_torch_flex():
    q, k, v = _qkv(hkv=2)
    got, lse = _engine(q, k, v, softcap, dilated, enable_gqa=True, scale=0.3, return_lse=True)
    want, want_lse = _torch(q, k, v, softcap, dilated, enable_gqa=True, scale=0.3,
                            return_lse=True)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert lse.shape == (B, HQ, S) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_gradients_reach_a_captured_tensor():
    """FlexAttention has no CPU backward: the gradients are checked against autograd through the
    same attention written in plain torch."""
    slopes = SLOPES.clone().requires_grad_()

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    leaves = _qkv(requires_grad=True)
    out = engine.flex_attention(*leaves, score_mod=learned_alibi)
    do = torch.randn(out.shape, generator=GEN)
    got = torch.autograd.grad(out, [*leaves, slopes], do)
    ref = [t.detach().double().requires_grad_() for t in (*leaves, SLOPES)]
    q, k, v, ref_slopes = ref
    pos = torch.arange(S, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s + ref_slopes.view(1, HQ, 1, 1) * (pos.view(1, -1) - pos.view(-1, 1))
    want = torch.autograd.grad(torch.softmax(s, -1) @ v, ref, do.double())
    for name, a, w in zip(("dq", "dk", "dv", "dslopes"), got, want, strict=True):
        torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-5, msg=name)


def test_one_module_per_function_and_shape_with_the_current_tensor_values():
    _MODULES.clear()
    q, k, v = _qkv()
    bias = torch.randn(HQ, generator=GEN)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    first = engine.flex_attention(q, k, v, score_mod=head_bias)
    assert len(_MODULES) == 1
    bias = torch.randn(HQ, generator=GEN)  # a new tensor object, as a training step makes
    second = engine.flex_attention(q, k, v, score_mod=head_bias)
    assert len(_MODULES) == 1, "same functions and shapes: the same module"
    torch.testing.assert_close(second, _torch(q, k, v, head_bias, None), rtol=2e-5, atol=2e-5)
    assert not torch.allclose(first, second)
    engine.flex_attention(q[:, :, :40], k, v, score_mod=head_bias)
    assert len(_MODULES) == 2, "another length: another module"


def test_torch_block_masks_are_accepted():
    q, k, v = _qkv()
    bm = torch_flex.create_block_mask(prefix_lm, B, None, S, S, device="cpu")
    torch.testing.assert_close(engine.flex_attention(q, k, v, block_mask=bm),
                               _torch(q, k, v, None, prefix_lm), rtol=2e-5, atol=2e-5)


def test_engine_block_mask_classifies_with_captured_data():
    bm = engine.create_block_mask(document, B, None, S, S, BLOCK_SIZE=8)
    dense = (DOC[:, :, None] == DOC[:, None, :])
    for b in range(B):
        for qb in range(S // 8):
            for kb in range(S // 8):
                tile = dense[b, qb * 8:(qb + 1) * 8, kb * 8:(kb + 1) * 8]
                c = int(bm.classes[b if bm.classes.shape[0] > 1 else 0, 0, qb, kb])
                assert not (c == 0 and tile.any()) and not (c == 2 and not tile.all())
    assert bm.counts()["empty"] > 0


def test_gradients_reach_a_learnable_table():
    """A relative-position bias table read at h, q_idx - kv_idx + S - 1: its gradient (a
    scatter-add over the score tile) against autograd through plain torch."""
    rel = REL.clone().requires_grad_()

    def learned_bias(score, b, h, q_idx, kv_idx):
        return score + rel[h, q_idx - kv_idx + S - 1]

    leaves = _qkv(requires_grad=True)
    out = engine.flex_attention(*leaves, score_mod=learned_bias, block_mask=engine.create_block_mask(
        sliding_window, B, None, S, S, device="cpu"))
    do = torch.randn(out.shape, generator=GEN)
    got = torch.autograd.grad(out, [*leaves, rel], do)
    ref = [t.detach().double().requires_grad_() for t in (*leaves, REL)]
    q, k, v, ref_rel = ref
    qi, ki = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + ref_rel[:, qi - ki + S - 1]
    s = s.masked_fill(~sliding_window(0, 0, qi, ki), float("-inf"))
    want = torch.autograd.grad(torch.softmax(s, -1) @ v, ref, do.double())
    for name, a, w in zip(("dq", "dk", "dv", "drel"), got, want, strict=True):
        torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-5, msg=name)


def test_a_table_index_outside_the_table_is_an_index_error():
    short = torch.randn(HQ, S, generator=GEN)  # too short for q_idx - kv_idx + S - 1

    def bias(score, b, h, q_idx, kv_idx):
        return score + short[h, q_idx - kv_idx + S - 1]

    with pytest.raises(IndexError, match=r"custom input 'captured0': index .* takes values "
                                         rf"0\.\.{2 * S - 2}, outside dim 1 of size {S}"):
        engine.flex_attention(*_qkv(), score_mod=bias)


@pytest.mark.parametrize("fn, match", [
    (lambda s, b, h, q, kv: s if q > kv else -s, r"no truth value.*\(at test_flex_front_door"),
    (lambda s, b, h, q, kv: torch.softmax(s, -1), r"torch function torch.softmax has no DSL"),
    (lambda s, b, h, q, kv: s + SLOPES, r"shape \(4,\) is used whole"),
])
def test_what_cannot_be_expressed_is_named(fn, match):
    q, k, v = _qkv()
    with pytest.raises(TraceError, match=match):
        engine.flex_attention(q, k, v, score_mod=fn)


def test_bad_tensors_are_argument_errors():
    q, k, v = _qkv(hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        engine.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="4-D tensor"):
        engine.flex_attention(q[0], k, v)
    bm = engine.create_block_mask(dilated, B, None, S, 32)
    with pytest.raises(ValueError, match=r"lengths \(48, 32\)"):
        engine.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert math.isfinite(float(engine.flex_attention(q, k, v, enable_gqa=True).sum()))


def test_under_torch_compile_one_graph_with_the_captured_tensors_as_inputs():
    """fullgraph: the functions are traced once while compiling; the captured tensors (a
    closure's learnable slopes, a module global's document ids) are read where the functions
    read them, so gradients reach them and a new value of the global is seen."""
    global DOC
    import torch._dynamo

    slopes = SLOPES.clone().requires_grad_()

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    bm = engine.create_block_mask(document, B, None, S, S)

    def step(q, k, v):
        return engine.flex_attention(q, k, v, score_mod=learned_alibi, block_mask=bm,
                                     return_lse=True)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*_qkv())
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = _qkv(requires_grad=True)
    (out, lse), (want, want_lse) = compiled(*leaves), step(*leaves)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    got_g = torch.autograd.grad(out.square().sum(), [*leaves, slopes])
    want_g = torch.autograd.grad(want.square().sum(), [*leaves, slopes])
    for a, w in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, w)
    saved = DOC
    try:
        DOC = torch.zeros_like(saved)  # one document: the global is read again at each call
        q, k, v = _qkv()
        torch.testing.assert_close(compiled(q, k, v)[0], step(q, k, v)[0])
    finally:
        DOC = saved


def test_under_torch_compile_a_tensor_out_of_reach_is_named():
    import torch._dynamo

    class Holder:
        bias = torch.randn(HQ, generator=GEN)

    def attr_bias(score, b, h, q_idx, kv_idx):
        return score + Holder.bias[h]

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: engine.flex_attention(q, k, v, score_mod=attr_bias),
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="closures or module globals"):
        compiled(*_qkv())


def test_a_captured_tables_gradient_row_is_summed_per_thread_block():
    """T5's table captured by the front door has integer dims (heads, 32), read at [h, bucket]:
    its gradient is summed in a shared row per thread block (one global atomic per entry)
    as for a CustomIO table with a "heads" dim, not one global atomic per score element."""
    table = T5_TABLE.clone().requires_grad_()

    def learned_t5(score, b, h, q_idx, kv_idx):
        return score + table[h, T5_BUCKETS[q_idx, kv_idx]]

    _MODULES.clear()
    engine.flex_attention(*(t.bfloat16().requires_grad_() for t in _qkv()), score_mod=learned_t5)
    (mod,) = _MODULES.values()
    (name,) = [n for n, dims in mod.spec.customs if tuple(dims) == (HQ, 32)]
    main = mod.backward_kernels(custom_grads=(name,)).main.source
    assert '= T.alloc_shared((32,), "float32")' in main
    assert main.count(f"T.atomic_add(dC_{name}[") == 1 and f"dC_{name}[T.max(T.min(by" in main
