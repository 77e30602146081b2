"""Decode on the CPU (issue 23): the reference against a per-row loop, paged caches, custom
reads at decode positions, the merge rules (predefined, a user's combine, a user's copy of
softmax) reproducing unsplit attention, the key bounds read off masks, the plan's choices,
the generated sources, and the module's call with its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from engine import AttentionEngine, CustomIO, meta_tensor
from engine.dsl.online import OnlineFunc, OnlineSoftmax, SymbolScalar, Var
from engine.ir.merge import FINAL, ONLINE, trace_merge
from engine.ir.trace import TraceError, trace_mask, trace_spec
from engine.kernels.attention_decode.plan import (
    DecodeConfig,
    DecodeShape,
    auto_splits,
    paged_config,
    plan_decode,
)
from engine.mask.key_range import KeyRange, key_range
from engine.plan.config import ConfigError
from engine.reference.decode import decode_forward, split_decode_forward, to_pages
from engine.reference.executor import rel_err
from engine.variants import VARIANTS

B, SQ, HQ, HKV, D, CAP = 3, 2, 4, 2, 16, 96
LENS = [2, 50, 96]


def _inputs(seed=0, Sq=SQ, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, HQ, D, generator=g).to(dtype)
    k = torch.randn(B, CAP, HKV, D, generator=g).to(dtype)
    v = torch.randn(B, CAP, HKV, D, generator=g).to(dtype)
    return q, k, v, torch.tensor(LENS, dtype=torch.int32)


def test_reference_matches_a_row_by_row_loop():
    spec = trace_spec(lambda s, c, b, h, qi, ki: s * 0.25, lambda b, h, qi, ki: qi >= ki,
                      OnlineSoftmax())
    q, k, v, lens = _inputs()
    o = decode_forward(spec, q, k, v, {}, lens)
    for b in range(B):
        n = LENS[b]
        for t in range(SQ):
            pos = n - SQ + t
            for h in range(HQ):
                s = (k[b, :n, h // 2] @ q[b, t, h]) * 0.25
                s[torch.arange(n) > pos] = -math.inf
                want = torch.softmax(s, 0) @ v[b, :n, h // 2]
                assert torch.allclose(o[b, t, h], want, atol=1e-4, rtol=1e-4), (b, t, h)


def test_paged_cache_reads_through_its_block_table():
    spec = trace_spec(None, lambda b, h, qi, ki: qi >= ki, OnlineSoftmax())
    q, k, v, lens = _inputs(1)
    perm = torch.randperm(B * CAP // 16, generator=torch.Generator().manual_seed(0))
    table = perm.view(B, CAP // 16).int()
    paged = decode_forward(spec, q, to_pages(k, table), to_pages(v, table), {}, lens, table)
    assert torch.equal(paged, decode_forward(spec, q, k, v, {}, lens))


def test_custom_reads_take_the_new_token_and_the_key_position():
    io = CustomIO({"tok": ("batch", "heads", "seq_len"), "key": ("batch", "seq_len_kv")})
    spec = trace_spec(lambda s, c, b, h, qi, ki: s + c["tok"] * c["key"] + qi * 0.01, None,
                      OnlineSoftmax(), io)
    q, k, v, lens = _inputs(2)
    tok, key = torch.randn(B, HQ, SQ), torch.randn(B, CAP)
    o = decode_forward(spec, q, k, v, {"tok": tok, "key": key}, lens)
    b, t, h, n = 1, 1, 3, LENS[1]
    s = k[b, :n, h // 2] @ q[b, t, h] + tok[b, h, t] * key[b, :n] + (n - SQ + t) * 0.01
    assert torch.allclose(o[b, t, h], torch.softmax(s, 0) @ v[b, :n, h // 2], atol=1e-5)


@pytest.mark.parametrize("name", ["softmax_causal", "alibi", "sliding_window", "retnet",
                                  "sigmoid", "relu", "t5_bias"])
@pytest.mark.parametrize("splits", [2, 5])
def test_predefined_merges_reproduce_unsplit_attention(name, splits):
    v = VARIANTS[name]
    sz = dict(batch=B, heads_q=HQ, heads_kv=HKV, seqlen_q=SQ, seqlen_kv=CAP, head_dim=D,
              head_dim_v=D)
    mod = v.build(**sz, dtype=torch.float32, backend="reference")
    inp = v.make_inputs(**sz, dtype=torch.float32, seed=4)
    cu = {n: inp[n] for n in mod.custom_io.names()}
    lens = torch.tensor(LENS, dtype=torch.int32)
    assert mod.merge is not None and mod.merge.form == ONLINE
    want = decode_forward(mod.spec, inp["q"], inp["k"], inp["v"], cu, lens)
    got = split_decode_forward(mod.spec, mod.merge, inp["q"], inp["k"], inp["v"], cu, lens,
                               splits=splits)
    assert rel_err(got, want) < 1e-5


class _UserSoftmax(OnlineFunc):
    """A seed-style copy of softmax, with no merge of its own."""

    def __init__(self):
        super().__init__({"m": SymbolScalar("m", Var("-inf")), "r": SymbolScalar("r", Var(0.0))},
                         {"lse": SymbolScalar("lse", Var(0.0))})

    online_fwd = staticmethod(OnlineSoftmax.online_fwd)
    online_fwd_epilogue = staticmethod(OnlineSoftmax.online_fwd_epilogue)
    forward = staticmethod(OnlineSoftmax.forward)
    backward = staticmethod(OnlineSoftmax.backward)


class _FinalCombine(_UserSoftmax):
    """AttentionEngine's form: weights from the splits' final row scales."""

    @staticmethod
    def combine(final_rowscales):
        lse = final_rowscales["lse"]
        top = lse.get_reduce("max")
        return (lse - ((lse - top).exp().get_reduce("sum").log() + top)).exp()


def test_a_user_copy_of_softmax_takes_its_merge_and_a_user_combine_merges_finals():
    spec = trace_spec(None, None, _UserSoftmax())
    assert trace_merge(_UserSoftmax()) is None
    assert trace_merge(_UserSoftmax(), spec) == trace_merge(OnlineSoftmax())
    merge = trace_merge(_FinalCombine())
    assert merge.form == FINAL
    q, k, v, lens = _inputs(5)
    want = decode_forward(spec, q, k, v, {}, lens)
    assert rel_err(split_decode_forward(spec, merge, q, k, v, {}, lens, splits=4), want) < 1e-5


def test_a_normaliser_unlike_any_predefined_has_no_merge():
    class Doubled(_UserSoftmax):
        @staticmethod
        def online_fwd_epilogue(o, rs, b, h, q_idx):
            return o / rs["r"] * 2.0, {"lse": rs["r"].log() + rs["m"]}

    assert trace_merge(Doubled(), trace_spec(None, None, Doubled())) is None


@pytest.mark.parametrize("combine,match", [
    (lambda rs: rs["m"], "must return 2 values"),
    (lambda rs: (1.0, {"m": rs["m"], "r": rs["r"].get_reduce("sum")}), "row scale 'm' varies"),
    (lambda rs: (1.0, {"m": 0.0}), "expected"),
])
def test_malformed_merges_are_named(combine, match):
    class Bad(_UserSoftmax):
        pass

    Bad.combine_online = staticmethod(combine)
    with pytest.raises(TraceError, match=match):
        trace_merge(Bad())


@pytest.mark.parametrize("mask,want", [
    (lambda b, h, q, kv: q >= kv, KeyRange(rel_hi=0, exact=True)),
    (lambda b, h, q, kv: (q >= kv) & (q - kv < 4096), KeyRange(-4095, 0, exact=True)),
    (lambda b, h, q, kv: (kv > q - 10) & (kv < 50) & ((kv % 2) == 0),
     KeyRange(rel_lo=-9, abs_hi=49, exact=False)),
    (lambda b, h, q, kv: (kv >= 3) & (2 * kv <= q), KeyRange(abs_lo=3, exact=False)),
    (lambda b, h, q, kv: (kv <= q - 10) | (kv < 4), KeyRange(exact=False)),
])
def test_key_bounds_are_read_off_the_masks_conjunction(mask, want):
    assert key_range(trace_mask(mask)) == want


def _shape(**kw):
    base = dict(batch=1, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=131072, head_dim=128,
                head_dim_v=128, dtype="bfloat16")
    return DecodeShape(**{**base, **kw})


def test_splits_fill_the_gpu_and_windows_bound_them():
    cfg = DecodeConfig()
    assert auto_splits(_shape(), cfg, KeyRange(), 1, 132) == 32  # 8 blocks: 17 -> 32
    assert auto_splits(_shape(batch=8, seqlen_kv=32768), cfg, KeyRange(), 1, 132) == 4
    assert auto_splits(_shape(batch=64, seqlen_kv=4096), cfg, KeyRange(), 1, 132) == 1
    window = KeyRange(-4095, 0, exact=True)  # 4097 keys: 34 blocks, splits of 8 at least
    assert auto_splits(_shape(), cfg, window, 1, 132) == 4
    spec = trace_spec(None, lambda b, h, q, kv: q >= kv, OnlineSoftmax())
    assert plan_decode(spec, _shape(), cfg, None).splits == 1  # no merge rule: one split
    plan = plan_decode(spec, _shape(), DecodeConfig(128, 2, 3), trace_merge(OnlineSoftmax()))
    assert (plan.splits, plan.chunk) == (3, 342)  # 1024 blocks in runs of 342


def test_pages_shorter_than_a_key_block():
    cfg = DecodeConfig(128, 2)
    assert paged_config(cfg, 256) == cfg
    assert paged_config(cfg, 64) == DecodeConfig(64, 2)
    assert paged_config(cfg, 16) == DecodeConfig(128, 1)
    spec = trace_spec(None, None, OnlineSoftmax())
    with pytest.raises(ConfigError, match="page_size=24"):
        plan_decode(spec, _shape(page_size=24, num_pages=10), cfg, None)


def _module(name="softmax_causal", backend="reference", **kw):
    return VARIANTS[name].build(batch=B, heads_q=HQ, heads_kv=HKV, seqlen_q=SQ, seqlen_kv=CAP,
                                head_dim=D, head_dim_v=D, dtype=torch.float16, backend=backend,
                                **kw)


def test_generated_sources_follow_the_plan():
    mod = VARIANTS["mistral_window"].build(batch=1, heads_q=32, heads_kv=8, seqlen_q=1,
                                           seqlen_kv=131072, head_dim=128, head_dim_v=128,
                                           dtype=torch.bfloat16, backend="tilelang")
    dk = mod.decode_kernels()
    split, merge = dk.sources()
    assert dk.plan.splits > 1 and "T.Pipelined(count" in split
    assert "key_lo: T.int32 = T.max(0, (seqlen - 1) + -4095)" in split  # the window's bound
    assert "Wo[bx, bz, hk, i, d]" in split and "O[bz, " in merge
    mod.decode_config = DecodeConfig(128, 2, 1)
    (one,) = mod.decode_kernels().sources()
    assert "O[bz, " in one and "Wo" not in one
    paged = mod.decode_kernels(16, 100000).sources()[0]
    assert "T.Parallel(128, 128)" in paged and "BT[bz, " in paged


def test_module_decode_runs_the_reference_on_the_cpu():
    mod = _module()
    q, k, v, lens = _inputs(6, dtype=torch.float16)
    o = mod(q, k, v, cache_seqlens=lens)
    assert o.dtype == torch.float16 and o.shape == (B, SQ, HQ, D)
    assert rel_err(o, decode_forward(mod.spec, q, k, v, {}, lens)) < 1e-3


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(B, 1, HQ, D, dtype=torch.float16)), r"q: shape \(3, 1, 4, 16\)"),
    (dict(k=torch.zeros(B, CAP, HKV, D)), "k_cache: dtype torch.float32"),
    (dict(lens=torch.tensor(LENS)), "cache_seqlens: torch.int64"),
    (dict(lens=torch.tensor([2, 50, 97], dtype=torch.int32)), r"cache_seqlens: values 2..97"),
    (dict(lens=torch.tensor([1, 50, 96], dtype=torch.int32)), "expected 2..96"),
])
def test_bad_decode_arguments_are_named(change, match):
    mod = _module()
    q, k, v, lens = _inputs(dtype=torch.float16)
    q, k, lens = change.get("q", q), change.get("k", k), change.get("lens", lens)
    with pytest.raises(ValueError, match=match):
        mod(q, k, v, cache_seqlens=lens)


def test_bad_block_tables_are_named():
    mod = _module()
    q, k, v, lens = _inputs(dtype=torch.float16)
    table = torch.randperm(B * CAP // 16).view(B, CAP // 16).int()
    kp, vp = to_pages(k, table), to_pages(v, table)
    with pytest.raises(ValueError, match=r"block_table: torch.int32 \(3, 5\)"):
        mod(q, kp, vp, cache_seqlens=lens, block_table=table[:, :5])
    bad = table.clone()
    bad[2, 5] = 10**6
    with pytest.raises(ValueError, match=r"block_table\[2, 5\] = 1000000"):
        mod(q, kp, vp, cache_seqlens=lens, block_table=bad)
    bad[0, 5] = -1  # beyond sequence 0's two keys: padding, not read
    bad[2, 5] = table[2, 5]
    assert torch.equal(mod(q, kp, vp, cache_seqlens=lens, block_table=bad),
                       mod(q, k, v, cache_seqlens=lens))


def test_decode_refuses_gradients_lse_and_qkv_mods():
    q, k, v, lens = _inputs(dtype=torch.float16)
    mod = _module()
    with pytest.raises(ValueError, match="no gradients"):
        mod(q.requires_grad_(), k, v, cache_seqlens=lens)
    with pytest.raises(ValueError, match="return_lse"):
        mod(q.detach(), k, v, cache_seqlens=lens, return_lse=True)
    meta = (meta_tensor(B, HQ, SQ, D), meta_tensor(B, HKV, CAP, D), meta_tensor(B, HKV, CAP, D))
    modded = AttentionEngine(meta, query_mod=lambda x: x * 2.0, backend="reference")
    with pytest.raises(NotImplementedError, match="query_mod"):
        modded(q.detach(), k, v, cache_seqlens=lens)


def test_decode_kernels_are_rebuilt_after_the_cache_is_cleared():
    mod = _module(backend="tilelang")
    first = mod.decode_kernels()
    assert mod.decode_kernels() is first  # the call path's lookup
    mod.kernel_cache.clear()
    assert mod.decode_kernels() is not first
    mod.decode_config = DecodeConfig(64, 2, 2)
    assert mod.decode_kernels().config == DecodeConfig(64, 2, 2)
