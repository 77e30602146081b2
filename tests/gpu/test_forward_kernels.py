"""Generated forward kernels against the reference executor, on the GPU (pytest -m gpu).

Fresh random inputs per case, outputs poisoned with NaN before each launch (every element
must be written), relative error < 1e-2 for fp16/bf16 and no NaN."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor
from engine.plan.config import KernelConfig
from engine.reference import executor
from engine.reference.executor import rel_err
from engine.variants import VARIANTS

from .cases import (
    BF16,
    FOLD_CASES,
    FP16,
    case_id,
    cross_product,
    fold_case_id,
    fold_module,
    precompile_reported,
    selected_params,
)

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128), (128, 256)]
# The grid of every variant x dtype x head dims x GQA ratio (tests/gpu/cases.py), then special
# shapes as (variant, dtype, B, Hq, Hkv, Sq, Skv, D, Dv).
CASES = cross_product(HEAD_DIMS)
CASES += [(name, BF16, 2, 8, 2, 1000, 1000, 128, 128) for name in VARIANTS]
CASES += [
    ("softmax_causal", FP16, 2, 8, 2, 1000, 1000, 128, 128),
    ("softmax", FP16, 1, 4, 4, 777, 777, 128, 128),  # MHA, lengths not multiples of blocks
    ("softmax_causal", FP16, 2, 8, 1, 512, 512, 64, 64),  # GQA 8:1, D 64
    ("softmax_causal", BF16, 1, 4, 2, 700, 700, 256, 256),
    ("softmax", BF16, 1, 4, 2, 700, 700, 192, 128),  # DeepSeek-style D/Dv
    ("softmax_causal", BF16, 1, 4, 2, 640, 640, 128, 256),  # Dv > D
    ("softmax_causal", BF16, 2, 4, 2, 300, 1000, 128, 128),  # Sq < Skv
    ("softmax", BF16, 2, 4, 2, 1000, 300, 128, 128),  # Sq > Skv
    ("softmax_causal", BF16, 2, 4, 2, 64, 64, 128, 128),  # KV loop runs exactly once
    ("softmax", FP16, 1, 4, 1, 100, 100, 128, 128),  # one partial block
    ("sigmoid", FP16, 1, 8, 2, 513, 513, 64, 64),
    ("retnet", FP16, 1, 4, 4, 600, 600, 64, 64),
]


# The warp-specialised schedules, forced, for every variant (the default takes them only for
# causal and unmasked softmax): the full run of each query block first, the other blocks by
# class after it (document: runs between partial blocks; sliding window: partial blocks before
# and after), lengths that leave tails, Sq != Skv.
WS_CONFIGS = {s: KernelConfig(128, 128, 2, 256, schedule=s) for s in ("overlap", "pingpong")}
WS_CASES = [(name, "overlap", 1000, 1000) for name in sorted(VARIANTS)]
WS_CASES += [(name, "pingpong", 1000, 1000) for name in ("softmax_causal", "document", "alibi",
                                                          "document_prefix")]
# Per-key tensors in the producer's ring and the mask tested once (whole key blocks; 1000
# above: the fill clamps the tail)
WS_CASES += [(name, s, 1024, 1024) for name in ("document", "document_prefix")
             for s in ("overlap", "pingpong")]
WS_CASES += [(name, "overlap", sq, skv) for name in ("softmax_causal", "mistral_window",
                                                     "prefix_lm") for sq, skv in ((300, 1000),
                                                                                  (1000, 300))]


def _ws_module(case):
    name, schedule, sq, skv = case
    sz = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=sq, seqlen_kv=skv, head_dim=128,
              head_dim_v=128)
    return VARIANTS[name].build(**sz, dtype=BF16, backend="tilelang",
                                config=WS_CONFIGS[schedule]), sz


# Three consumer warpgroups of 64 rows (192-row tiles, D 64), forced: the persistent walk with
# three stages and the plain grid with two, row tails (1000 = 5 x 192 + 40), Sq != Skv, GQA,
# masks heavier than the default lets through (it is about registers, not results), per-key
# rings (document). (variant, dtype, B, Hq, Hkv, Sq, Skv, persistent)
THREE_GROUP_CASES = [
    ("softmax", BF16, 2, 8, 8, 1000, 1000, True),
    ("softmax", FP16, 4, 8, 2, 777, 777, False),
    ("softmax_causal", BF16, 4, 8, 2, 1000, 1000, True),
    ("softmax_causal", FP16, 2, 8, 8, 1000, 1000, False),
    ("softmax_causal", BF16, 2, 4, 2, 300, 1000, True),
    ("softmax", BF16, 2, 4, 2, 1000, 300, True),
    ("key_gate", BF16, 2, 8, 2, 1000, 1000, True),
    ("document", BF16, 2, 8, 2, 1024, 1024, True),
    ("alibi", FP16, 2, 8, 4, 1000, 1000, False),
]
# The defaults that take them (plan.wide_tile): (variant, dtype, B, Hq, Hkv, S, config).
WIDE = KernelConfig(192, 128, 3, 384, schedule="overlap", persistent=True)
WIDE_MASKED = dataclasses.replace(WIDE, num_stages=2)
WIDE_DEFAULT_CASES = [
    ("softmax", BF16, 1, 4, 4, 4096, WIDE),
    ("softmax", FP16, 2, 4, 1, 2048, WIDE),  # a partial last tile of rows, GQA 4
    ("softmax_causal", FP16, 1, 4, 2, 8192, WIDE_MASKED),
    ("softmax_causal", BF16, 1, 2, 2, 16384, WIDE_MASKED),
]


def _three_group_module(case):
    name, dt, B, Hq, Hkv, Sq, Skv, persistent = case
    sz = _sizes(B, Hq, Hkv, Sq, Skv, 64)
    cfg = KernelConfig(192, 128, 3 if persistent else 2, 384, schedule="overlap",
                       persistent=persistent)
    return VARIANTS[name].build(**sz, dtype=dt, backend="tilelang", config=cfg), sz


def _wide_default_module(case):
    name, dt, B, Hq, Hkv, S, _ = case
    sz = _sizes(B, Hq, Hkv, S, S, 64)
    return VARIANTS[name].build(**sz, dtype=dt, backend="tilelang"), sz


# Cases whose module also gives the dynamic-shape kernel of its spec (precompiled).
DYNAMIC_PRECOMPILE = {("softmax_causal", 2, 1000), ("document", 2, 1000), ("alibi", 2, 1000)}




@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Compile every selected case's kernel in parallel workers first (nvcc is the slow part)."""
    from engine.runtime import tilelang_backend
    srcs = []
    chosen = selected_params(request, "case")
    for name, dt, B, Hq, Hkv, Sq, Skv, D, Dv in (c for c in CASES if c in chosen):
        mod = VARIANTS[name].build(
            batch=B,
            heads_q=Hq,
            heads_kv=Hkv,
            seqlen_q=Sq,
            seqlen_kv=Skv,
            head_dim=D,
            head_dim_v=Dv,
            dtype=dt,
            backend="tilelang",
        )
        srcs.append(mod.kernel_source)
        if (name, B, Sq) in DYNAMIC_PRECOMPILE:
            mod.dynamic_shapes = True  # a new request: its own kernel
            srcs.append(mod.kernel_source)
    srcs += [_ws_module(c)[0].kernel_source for c in WS_CASES
             if c in selected_params(request, "ws_case")]
    srcs += [fold_module(c).kernel_source for c in FOLD_CASES
             if c in selected_params(request, "fold_case")]
    srcs += [_three_group_module(c)[0].kernel_source for c in THREE_GROUP_CASES
             if c in selected_params(request, "three_case")]
    srcs += [_wide_default_module(c)[0].kernel_source for c in WIDE_DEFAULT_CASES
             if c in selected_params(request, "wide_case")]
    precompile_reported(request, srcs)
    tilelang_backend.POISON_OUTPUTS = True
    yield
    tilelang_backend.POISON_OUTPUTS = False


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_matches_reference(case):
    name, dt, B, Hq, Hkv, Sq, Skv, D, Dv = case
    v = VARIANTS[name]
    mod = v.build(
        batch=B,
        heads_q=Hq,
        heads_kv=Hkv,
        seqlen_q=Sq,
        seqlen_kv=Skv,
        head_dim=D,
        head_dim_v=Dv,
        dtype=dt,
        backend="tilelang",
    )
    seed = torch.randint(0, 2**31 - 1, ()).item()
    inp = v.make_inputs(
        batch=B,
        heads_q=Hq,
        heads_kv=Hkv,
        seqlen_q=Sq,
        seqlen_kv=Skv,
        head_dim=D,
        head_dim_v=Dv,
        dtype=dt,
        device="cuda",
        seed=seed,
    )
    with torch.no_grad():
        out, finals = mod(**inp, return_lse=True)
    torch.cuda.synchronize()
    customs = {n: t for n, t in inp.items() if n not in "qkv"}
    ref, ref_f = executor.forward(mod.spec, inp["q"], inp["k"], inp["v"], customs)
    assert not torch.isnan(out).any(), "NaN (or unwritten poisoned element) in the output"
    err = rel_err(out, ref)
    assert err < 1e-2, f"rel err {err:.3e} (seed {seed})"
    indep = rel_err(out, v.torch_reference(inp))
    assert indep < 1e-2, f"vs the independent torch formulation: {indep:.3e} (seed {seed})"
    for fname, f in finals.items():
        r = ref_f[fname]
        assert not torch.isnan(f).any(), f"NaN in final row scale {fname}"
        assert rel_err(f, r) < 1e-3, f"final row scale {fname}: rel err {rel_err(f, r):.3e}"


@pytest.mark.parametrize("ws_case", WS_CASES, ids=lambda c: "-".join(map(str, c)))
def test_warp_specialised_schedule_matches_reference(ws_case):
    mod, sz = _ws_module(ws_case)
    _matches_reference(mod, VARIANTS[ws_case[0]], sz, BF16)


def _matches_reference(mod, v, sz: dict, dt: torch.dtype) -> None:
    """`mod` on fresh random inputs against the reference executor: every element written,
    no NaN, relative error < 1e-2; the final row scales (lse) within 1e-3."""
    seed = torch.randint(0, 2**31 - 1, ()).item()
    inp = v.make_inputs(**sz, dtype=dt, device="cuda", seed=seed)
    with torch.no_grad():
        out, finals = mod(**inp, return_lse=True)
    customs = {n: t for n, t in inp.items() if n not in "qkv"}
    ref, ref_f = executor.forward(mod.spec, inp["q"], inp["k"], inp["v"], customs)
    assert not torch.isnan(out).any(), "NaN (or unwritten poisoned element) in the output"
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e} (seed {seed})"
    for fname, f in finals.items():
        assert rel_err(f, ref_f[fname]) < 1e-3, f"final row scale {fname} (seed {seed})"


# The persistent walk (one thread block per SM, the tiles in turn), forced: shapes with more
# tiles than an H100 has SMs, so that each block walks several, over short rows (ViT's), key
# tails, masks whose rows differ in length (the longest first), GQA and D = 256.
PERSISTENT_CASES = [
    ("softmax", "overlap", FP16, 64, 6, 6, 197, 197, 64),
    ("softmax_causal", "overlap", BF16, 4, 8, 2, 1000, 1000, 128),
    ("softmax_causal", "pingpong", BF16, 4, 8, 2, 1000, 1000, 128),
    ("document", "overlap", BF16, 4, 8, 2, 1000, 1000, 128),
    ("document_prefix", "pingpong", BF16, 4, 8, 2, 1024, 1024, 128),
    ("document_prefix", "overlap", FP16, 2, 8, 4, 2048, 2048, 128),
    ("alibi", "pingpong", FP16, 4, 8, 4, 1000, 1000, 128),
    ("mistral_window", "overlap", BF16, 8, 8, 2, 300, 1000, 128),
    ("prefix_lm", "overlap", BF16, 8, 8, 2, 1000, 300, 128),
    ("softmax_causal", "overlap", BF16, 4, 4, 2, 2000, 2000, 256),
]


def _sizes(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, D: int) -> dict:
    return dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq, seqlen_kv=Skv, head_dim=D,
                head_dim_v=D)


def persistent_config(schedule: str, head_dim: int) -> KernelConfig:
    wide = head_dim > 128  # Q, a K/V stage and O's own stage fill the shared memory
    return KernelConfig(128, 64 if wide else 128, 1 if wide else 2, 256, schedule=schedule,
                        persistent=True)


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_persistent_walk_matches_reference(case):
    name, schedule, dt, B, Hq, Hkv, Sq, Skv, D = case
    v = VARIANTS[name]
    sz = _sizes(B, Hq, Hkv, Sq, Skv, D)
    mod = v.build(**sz, dtype=dt, backend="tilelang", config=persistent_config(schedule, D))
    assert mod.forward_kernel().config.persistent
    _matches_reference(mod, v, sz, dt)


@pytest.mark.parametrize("three_case", THREE_GROUP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_three_consumer_warpgroups_match_reference(three_case):
    mod, sz = _three_group_module(three_case)
    _matches_reference(mod, VARIANTS[three_case[0]], sz, three_case[1])


@pytest.mark.parametrize("wide_case", WIDE_DEFAULT_CASES,
                         ids=lambda c: "-".join(map(str, c[:6])))
def test_long_d64_rows_take_three_warpgroups_by_default(wide_case):
    mod, sz = _wide_default_module(wide_case)
    assert mod.forward_kernel().config == wide_case[-1]
    _matches_reference(mod, VARIANTS[wide_case[0]], sz, wide_case[1])


# Keys shorter than 256 in one block by default (plan.fit_short_keys), with
# the block each case must get: ViT's rows, causal and windowed masks, ALiBi, short keys under
# long rows, GQA; at D = 128 a 208-key ring does not fit beside O's stage and 128 stays.
FITTED_CASES = [
    ("softmax", FP16, 64, 6, 6, 197, 197, 64, 208),
    ("softmax", BF16, 4, 8, 2, 1000, 197, 64, 208),
    ("softmax_causal", BF16, 8, 8, 2, 197, 197, 64, 208),
    ("alibi", FP16, 8, 8, 4, 100, 100, 64, 112),
    ("mistral_window", BF16, 8, 8, 2, 240, 240, 64, 240),
    ("prefix_lm", BF16, 8, 8, 2, 200, 200, 64, 208),
    ("softmax_causal", BF16, 8, 8, 2, 197, 197, 128, 128),
    ("softmax", BF16, 8, 8, 2, 75, 75, 64, 112),
    ("softmax", FP16, 4, 8, 2, 1000, 140, 64, 208),
    ("alibi", BF16, 8, 8, 2, 220, 220, 64, 240),
]


@pytest.mark.parametrize("case", FITTED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_short_keys_in_one_fitted_block(case):
    name, dt, B, Hq, Hkv, Sq, Skv, D, block_N = case
    v = VARIANTS[name]
    sz = _sizes(B, Hq, Hkv, Sq, Skv, D)
    mod = v.build(**sz, dtype=dt, backend="tilelang")
    assert mod.forward_kernel().config.block_N == block_N
    _matches_reference(mod, v, sz, dt)


@pytest.mark.parametrize("B, S, D, late_by, block_N", [
    (4, 600, 128, 300, 128),
    (64, 200, 64, 150, 208),  # one fitted key block: tiles of none and of one
])
def test_persistent_walk_with_empty_tiles(B, S, D, late_by, block_N):
    """Query blocks without any key (n = 0) among the tiles a block walks: zeros, lse -inf."""
    H = 8

    def late(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx + late_by

    meta = tuple(meta_tensor(B, H, S, D, dtype=BF16) for _ in range(3))
    config = persistent_config("overlap", D) if block_N == 128 else None
    mod = AttentionEngine(meta, CustomIO({}), score_mod=lambda s, c, b, h, q, k: s * D**-0.5,
                          mask_mod=late, online_func=OnlineSoftmax(), backend="tilelang",
                          config=config)
    assert mod.forward_kernel().config.persistent
    assert mod.forward_kernel().config.block_N == block_N
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=BF16) for _ in range(3))
    with torch.no_grad():
        out, fin = mod(q, k, v, return_lse=True)
    assert not torch.isnan(out).any() and out[:, :late_by].abs().max().item() == 0.0
    assert torch.isinf(fin["lse"][:, :, :late_by]).all()
    ref, _ = executor.forward(mod.spec, q, k, v, {})
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("schedule,S,persistent", [("overlap", 1024, False),
                                                   ("pingpong", 1000, False),
                                                   ("overlap", 2048, True)])
def test_per_key_reads_from_the_producer_ring(schedule, S, persistent):
    """A score that reads a tensor per key (every block, full ones too) and one per query
    beside a mask that reads another per key (partial blocks), the per-key ones from the
    producer warp's rings, against the reference executor; a tenth of the keys masked, so
    most blocks are partial."""
    B, Hq, Hkv, D = 2, 8, 2, 128
    io = CustomIO({"kvbias": ("batch", "seq_len_kv"), "keep": ("batch", "seq_len_kv"),
                   "qbias": ("batch", "heads", "seq_len")})

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (io["keep"][b, kv_idx] > 0.5)

    meta = (meta_tensor(B, Hq, S, D, dtype=BF16), meta_tensor(B, Hkv, S, D, dtype=BF16),
            meta_tensor(B, Hkv, S, D, dtype=BF16))
    mod = AttentionEngine(meta, io, mask_mod=mask, online_func=OnlineSoftmax(),
                          score_mod=lambda s, c, b, h, q, k: s * D**-0.5 + c["kvbias"]
                          + c["qbias"], backend="tilelang")
    mod.config = KernelConfig(128, 128, 2, 256, schedule=schedule, persistent=persistent)
    assert "cks0" in mod.kernel_source and "cks1" in mod.kernel_source
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=BF16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=BF16) for _ in range(2))
    keep = (torch.rand(B, S, device="cuda") > 0.1).float()
    keep[:, 0] = 1.0  # every row keeps a key
    customs = {"kvbias": torch.randn(B, S, device="cuda"), "keep": keep,
               "qbias": torch.randn(B, Hq, S, device="cuda")}
    with torch.no_grad():
        out = mod(q, k, v, **customs)
    ref, _ = executor.forward(mod.spec, q, k, v, customs)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


def test_fully_masked_rows_give_zeros():
    """A mask that leaves the first rows without any key: zeros, lse = -inf, never NaN."""
    B, H, S, D = 1, 4, 300, 128

    def shifted(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx + 5

    meta = tuple(meta_tensor(B, H, S, D, dtype=BF16) for _ in range(3))
    mod = AttentionEngine(
        meta,
        CustomIO({}),
        score_mod=lambda s, c, b, h, q, k: s * D**-0.5,
        mask_mod=shifted,
        online_func=OnlineSoftmax(),
        backend="tilelang",
    )
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=BF16) for _ in range(3))
    with torch.no_grad():
        out, fin = mod(q, k, v, return_lse=True)
    assert not torch.isnan(out).any()
    assert out[:, :5].abs().max().item() == 0.0
    assert torch.isinf(fin["lse"][:, :, :5]).all() and not torch.isnan(fin["lse"]).any()
    ref, _ = executor.forward(mod.spec, q, k, v, {})
    assert rel_err(out, ref) < 1e-2


def test_autograd_through_kernel_forward():
    """The TileLang forward with the reference backward: gradients match the torch formulation."""
    v = VARIANTS["alibi"]
    sz = dict(
        batch=1, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_kv=256, head_dim=64, head_dim_v=64
    )
    mod = v.build(**sz, dtype=BF16, backend="tilelang")
    inp = v.make_inputs(**sz, dtype=BF16, device="cuda", seed=3, requires_grad=True)
    out = mod(**inp)
    ref = v.torch_reference(inp)
    do = torch.randn_like(out)
    names = ["q", "k", "v", *v.learnable]
    g = torch.autograd.grad(out, [inp[n] for n in names], do)
    gr = torch.autograd.grad(ref, [inp[n] for n in names], do.float())
    for n, a, b in zip(names, g, gr, strict=True):
        assert rel_err(a, b) < 2e-2, n
    assert math.isfinite(rel_err(out, ref))


@pytest.mark.parametrize("name", ["softmax_causal", "document", "alibi"])
def test_dynamic_shapes_one_kernel_serves_every_length(name):
    """dynamic_shapes: modules of one spec at different batch sizes and lengths (tails
    included) share one compiled kernel, and each matches the reference."""
    from engine.runtime import compile as compile_mod

    v = VARIANTS[name]
    sources = set()
    before = None
    for B, S in ((2, 1000), (1, 2048), (3, 77), (1, 1500)):
        sz = dict(batch=B, heads_q=8, heads_kv=2, seqlen_q=S, seqlen_kv=S, head_dim=128,
                  head_dim_v=128)
        mod = v.build(**sz, dtype=BF16, backend="tilelang")
        mod.dynamic_shapes = True
        sources.add(mod.kernel_source)
        inp = v.make_inputs(**sz, dtype=BF16, device="cuda", seed=B * S)
        with torch.no_grad():
            out = mod(**inp)
        if before is None:
            before = compile_mod.cache_size()
        customs = {n: t for n, t in inp.items() if n not in "qkv"}
        ref, _ = executor.forward(mod.spec, inp["q"], inp["k"], inp["v"], customs)
        assert not torch.isnan(out).any(), f"NaN or unwritten element at B={B}, S={S}"
        assert rel_err(out, ref) < 1e-2, f"B={B}, S={S}: rel err {rel_err(out, ref):.3e}"
    assert len(sources) == 1, "one source for every length"
    assert compile_mod.cache_size() == before, "no compile after the first length"


@pytest.mark.parametrize("fold_case", FOLD_CASES, ids=fold_case_id)
def test_folded_dilated_masks_match_reference(fold_case):
    from engine.plan.fold import row_fold
    from engine.plan.shape import KernelShape

    stride, _, Sq, Skv, D, Hkv, dt, _ = fold_case
    B, Hq = 2, 8
    mod = fold_module(fold_case)
    assert row_fold(mod.spec, KernelShape.of(mod)).stride == stride  # the case folds
    seed = torch.randint(0, 2**31 - 1, ()).item()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt, generator=g)
    k, v = (torch.randn(B, Skv, Hkv, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
    with torch.no_grad():
        out, fin = mod(q, k, v, return_lse=True)
    ref, ref_f = executor.forward(mod.spec, q, k, v, {})
    assert not torch.isnan(out).any(), "NaN (or unwritten poisoned element) in the output"
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e} (seed {seed})"
    assert rel_err(fin["lse"], ref_f["lse"]) < 1e-3, f"lse (seed {seed})"
