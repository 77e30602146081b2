"""Generated backward kernels against the reference executor's backward, on the GPU
(pytest -m gpu). Fresh random inputs and output gradients per case; dq, dk, dv must have a
relative error < 2e-2 for fp16/bf16 and no NaN; so must the gradients of learnable CustomIO
tensors. The forward (o and its final row scales) is the
reference executor's, in float32, so only the backward kernels are under test."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.attention_bwd.plan import (
    backward_config_problems,
    default_backward_config,
    ws_schedule_fits,
)
from engine.plan.config import KernelConfig
from engine.reference import executor
from engine.reference.executor import rel_err
from engine.runtime.tilelang_backend import backward_kernel_call
from engine.variants import VARIANTS

from .cases import (
    BF16,
    FOLD_CASES,
    FP16,
    case_id,
    check_gradients,
    cross_product,
    fold_case_id,
    fold_module,
    precompile_reported,
    random_seed,
    selected_params,
)

pytestmark = pytest.mark.gpu

HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (128, 256)]
# The grid of every variant x dtype x head dims x GQA ratio (tests/gpu/cases.py), then special
# shapes as (variant, dtype, B, Hq, Hkv, Sq, Skv, D, Dv). D = 256 runs the head-split schedule
# (engine/kernels/attention_bwd/plan.py: head_split).
CASES = cross_product([*HEAD_DIMS, (256, 256)])
CASES += [
    ("softmax", BF16, 1, 4, 4, 777, 777, 128, 128),  # MHA, lengths not multiples of blocks
    ("softmax_causal", FP16, 2, 4, 2, 300, 1000, 128, 128),  # Sq < Skv
    ("softmax", BF16, 2, 4, 2, 1000, 300, 128, 128),  # Sq > Skv
    ("softmax_causal", BF16, 2, 8, 2, 64, 64, 128, 128),  # one query block per kv block
]
# Lengths that are multiples of every block: partial blocks hold no rows past the sequences,
# so a softmax's dS takes P's zeros instead of evaluating the mask again (tiles._ds_mask).
NO_TAIL_VARIANTS = ["softmax_causal", "document", "document_prefix", "neighbourhood_2d",
                    "dilated", "sliding_window", "prefix_lm", "gemma2", "mistral_window",
                    "alibi", "softcap", "rel_bias", "t5_bias", "key_gate"]
CASES += [(name, dt, 2, 8, hkv, 1024, 1024, 128, 128)
          for name in NO_TAIL_VARIANTS for dt in (BF16, FP16) for hkv in (8, 2)]
# D 64's 128-row steps at whole query blocks (finals and Delta by TMA into the ring, read
# there; engine/kernels/attention_bwd/plan.py: ROWS_IN_RING_M), and the 64-row cap of custom
# gradients (ALiBi's slopes, the T5 table's).
CASES += [(name, dt, 2, 8, hkv, 1024, 1024, 64, 64)
          for name in ("softmax", "softmax_causal", "gemma2", "softcap", "sliding_window",
                       "document_prefix", "alibi", "t5_bias")
          for dt in (BF16, FP16) for hkv in (8, 2)]
# The head split at whole query blocks (its producer copies the per-query vectors by TMA)
CASES += [(name, dt, 2, 8, hkv, 1024, 1024, D, Dv)
          for name, dt, hkv, D, Dv in [
              ("softmax", FP16, 8, 256, 256), ("softmax_causal", BF16, 2, 256, 256),
              ("gemma2", BF16, 2, 256, 256), ("alibi", FP16, 2, 256, 256),
              ("document_prefix", BF16, 2, 256, 256), ("softmax_causal", BF16, 2, 192, 128)]]


# test_deterministic_backward: (variant, kv heads of 8 query heads): GQA 4 sums per-head dK/dV
# afterwards; MHA stores them once in the input dtype.
# At 1000 rows, and at 1024 where the head split (D 256) copies its vectors by TMA.
DETERMINISTIC = [("softmax_causal", 2, 128), ("alibi", 2, 128), ("sigmoid", 2, 128),
                 ("softmax_causal", 8, 128), ("softmax_causal", 2, 256), ("gemma2", 8, 256),
                 ("alibi", 2, 256), ("dilated", 2, 128), ("key_gate", 2, 128),
                 ("softmax_causal", 2, 64)]
DETERMINISTIC = [(*entry, 1000) for entry in DETERMINISTIC] + [("softmax_causal", 2, 256, 1024),
                                                                ("alibi", 8, 256, 1024)]


def _build(case, backward_config=None):
    name, dt, B, Hq, Hkv, Sq, Skv, D, Dv = case
    sizes = dict(batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Sq, seqlen_kv=Skv, head_dim=D, head_dim_v=Dv)
    mod = VARIANTS[name].build(**sizes, dtype=dt, backend="tilelang", backward_config=backward_config)
    return mod, sizes


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Compile every selected case's kernels in parallel workers first (nvcc is the slow
    part)."""
    srcs = []
    chosen = selected_params(request, "case")
    for case in (c for c in CASES if c in chosen):
        learn = tuple(VARIANTS[case[0]].learnable)
        srcs += _build(case)[0].backward_kernels(custom_grads=learn).sources()
    with pytest.MonkeyPatch.context() as mp:
        _force_persistent(mp)
        srcs += [src for case in PERSISTENT if case in chosen
                 for src in _build(case)[0].backward_kernels().sources()]
    chosen = selected_params(request, "name")
    for name, hkv, d, S in (entry for entry in DETERMINISTIC if entry[0] in chosen):
        mod = _build((name, BF16, 2, 8, hkv, S, S, d, d))[0]
        learn = tuple(VARIANTS[name].learnable)
        srcs += mod.backward_kernels(custom_grads=learn, deterministic=True).sources()
    srcs += [src for c in FOLD_CASES if c in selected_params(request, "fold_case")
             for src in fold_module(c).backward_kernels().sources()]
    precompile_reported(request, srcs)


def _inputs(case, seed: int, backward_config=None) -> dict:
    """Fresh inputs of `case`, the reference forward's o (in the case's dtype) and final row
    scales, an output gradient, and the names of the learnable CustomIO tensors."""
    name, dt = case[0], case[1]
    mod, sizes = _build(case, backward_config)
    inp = VARIANTS[name].make_inputs(**sizes, dtype=dt, device="cuda", seed=seed)
    names = list(mod.custom_io.names())
    customs = {n: inp[n] for n in names}
    o32, fin = executor.forward(mod.spec, inp["q"], inp["k"], inp["v"], customs,
                                dtype=torch.float32)
    o = o32.to(dt)
    return dict(mod=mod, q=inp["q"], k=inp["k"], v=inp["v"], customs=customs, o=o,
                do=torch.randn_like(o), finals=[fin[n].float().contiguous()
                                                for n in mod.spec.final_names],
                learn=tuple(VARIANTS[name].learnable))


def _kernel(x: dict) -> list[torch.Tensor]:
    """dq, dk, dv and the learnable tensors' gradients from the backward kernels."""
    mod = x["mod"]
    dq, dk, dv, dc = backward_kernel_call(
        mod.kernel_cache, mod.kernel_request(), x["q"], x["k"], x["v"], x["o"], x["finals"], x["do"],
        [x["customs"][n] for n in mod.custom_io.names()], custom_grads=x["learn"],
    )
    return [dq, dk, dv, *(dc[n] for n in x["learn"])]


def _reference(x: dict) -> list[torch.Tensor]:
    mod = x["mod"]
    rq, rk, rv, rc = executor.backward(
        mod.spec, x["q"], x["k"], x["v"], x["customs"], x["o"],
        dict(zip(mod.spec.final_names, x["finals"], strict=True)), x["do"],
        dtype=torch.float32, custom_grads=x["learn"],
    )
    return [rq, rk, rv, *(rc[n] for n in x["learn"])]


# Points of the tuner's space, besides the default, that take the warp-specialised schedule:
# one consumer warpgroup over 64 keys with a one-deep Q/dO ring, rasterised in panels.
WS_CONFIGS = [KernelConfig(64, 64, 1, 128, "FullRow", 8), KernelConfig(64, 128, 1, 256, "FullRow", 8)]


@pytest.mark.parametrize("cfg", WS_CONFIGS, ids=lambda c: c.key())
@pytest.mark.parametrize("name", ["softmax_causal", "alibi", "document", "t5_bias"])
def test_warp_specialised_configs_match_reference(name, cfg):
    assert ws_schedule_fits(cfg, 128, 128) and not backward_config_problems(cfg, 128, 128)
    _check_against_reference((name, BF16, 2, 8, 2, 777, 777, 128, 128), cfg)


# The head-split schedule (D = 256's default) at D = 128, where the tuner may pick it too.
HEAD_SPLIT_CONFIGS = [KernelConfig(64, 64, 2, 256, "FullCol"), KernelConfig(64, 64, 1, 256, "FullCol")]


@pytest.mark.parametrize("cfg", HEAD_SPLIT_CONFIGS, ids=lambda c: c.key())
@pytest.mark.parametrize("name", ["softmax_causal", "softcap", "document"])
def test_head_split_configs_match_reference(name, cfg):
    assert not backward_config_problems(cfg, 128, 128)
    _check_against_reference((name, BF16, 2, 8, 2, 777, 777, 128, 128), cfg,
                             check=lambda bk: bk.plan.head_split)


# One thread block per kv head walking its GQA group's query heads: the default from 264
# thread blocks (LLaMA-3 8B heads from 2 x 4k); forced here at smaller shapes, and with
# ALiBi's slope gradient (flushed per query head), which by default keeps a block per head
# (and 32-row steps: the heads walk is warp-specialised, so the usual tile is forced).
HEADS_LOOP = [
    ("softmax_causal", BF16, 2, 8, 2, 777, 777, 128, 128),
    ("alibi", FP16, 2, 8, 4, 1000, 1000, 64, 64),
    ("document", BF16, 2, 8, 2, 1000, 1000, 128, 128),
    ("sliding_window", FP16, 1, 12, 4, 1500, 1500, 128, 128),  # GQA 3
    ("softcap", BF16, 2, 8, 2, 1000, 300, 128, 128),  # fused loop, Sq > Skv
    ("softmax", BF16, 2, 16, 2, 640, 640, 128, 128),  # GQA 8
    ("dilated", BF16, 2, 8, 2, 1000, 1000, 128, 128),  # folded rows: head hq's residue
    # The warp-specialised head split (its next step's products issued ahead, across heads)
    ("gemma2", BF16, 1, 8, 4, 1000, 1000, 256, 256),
    ("softmax_causal", FP16, 2, 8, 2, 777, 777, 192, 128),
    # whole query blocks: the per-query vectors by TMA, across heads
    ("softmax_causal", BF16, 2, 8, 2, 1024, 1024, 128, 128),
    ("gemma2", FP16, 1, 8, 4, 1024, 1024, 256, 256),
]


@pytest.mark.parametrize("case", HEADS_LOOP, ids=case_id)
def test_heads_loop_matches_reference(case, monkeypatch):
    from engine.kernels.attention_bwd import plan

    monkeypatch.setattr(plan, "heads_loop_default",
                        lambda shape, cfg, ws, grads=(): ws and shape.heads_q > shape.heads_kv)
    cfg = default_backward_config(case[7], case[8])
    _check_against_reference(case, cfg, check=lambda bk: bk.heads_loop)


# The persistent walk (a thread block per SM walking the kv blocks, plan.persistent): the
# default at ViT-like lengths, forced elsewhere: masks (kv blocks of unequal steps), key and
# query tails, fp16, D 128, Sq != Skv, GQA (dK/dV atomics), fewer kv blocks than SMs.
PERSISTENT = [
    ("softmax", BF16, 64, 6, 6, 197, 197, 64, 64),  # the default (ViT-S/16's rows)
    ("softmax", FP16, 8, 4, 4, 300, 300, 128, 128),  # 24 kv blocks: one each
    ("softmax_causal", BF16, 4, 8, 8, 777, 777, 64, 64),
    ("document", BF16, 2, 8, 8, 1000, 1000, 128, 128),
    ("softcap", FP16, 2, 8, 8, 1000, 300, 64, 64),  # Sq > Skv
    ("sliding_window", BF16, 2, 8, 2, 1500, 1500, 128, 128),  # GQA 4, no heads walk
]


def _force_persistent(monkeypatch) -> None:
    from engine.kernels.attention_bwd import plan

    monkeypatch.setattr(plan, "persistent_default",
                        lambda spec, *rest: plan.persistent_possible(*rest))


@pytest.mark.parametrize("case", PERSISTENT, ids=case_id)
def test_persistent_walk_matches_reference(case, monkeypatch):
    _force_persistent(monkeypatch)
    _check_against_reference(case, check=lambda bk: bk.plan.persistent)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_matches_reference(case):
    _check_against_reference(case)


def _check_against_reference(case, backward_config=None, check=None) -> None:
    """`check(kernels)`, if given, must hold for the kernels under test."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = _inputs(case, int(torch.randint(0, 2**31 - 1, (1,)).item()), backward_config)
    bk = x["mod"].backward_kernels(custom_grads=x["learn"])
    if backward_config is not None:
        assert bk.config == backward_config
    if check is not None:
        assert check(bk), "not the kernels this test is for"
    # Learnable CustomIO tensors (ALiBi slopes, sigmoid bias, RetNet decay) get gradients too.
    whats = ["dq", "dk", "dv", *x["learn"]]
    for what, got, ref in zip(whats, _kernel(x), _reference(x), strict=True):
        assert got.shape == ref.shape, what
        want_dt = case[1] if what in ("dq", "dk", "dv") else x["customs"][what].dtype
        assert got.dtype == want_dt, what
        assert not torch.isnan(got).any(), f"{what} has NaN"
        err = rel_err(got, ref)
        assert not math.isnan(err) and err < 2e-2, f"{what}: relative error {err:.3e}"


@pytest.mark.parametrize("name", ["softmax_causal", "alibi", "sigmoid", "key_gate"])
def test_engine_autograd_runs_the_kernels(name, monkeypatch):
    """AttentionEngine's autograd with the kernel backward on: gradients (learnable CustomIO
    tensors included) match the reference backend's, the reference rules are never called, a
    non-contiguous output gradient works, and retain_graph gives the same gradients twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from engine.runtime import tilelang_backend

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)

    def _no_reference(*a, **k):
        raise AssertionError("the reference backward ran instead of the kernels")

    monkeypatch.setattr(tilelang_backend, "reference_grads", _no_reference)
    case = (name, BF16, 2, 8, 2, 1024, 1024, 128, 128)
    mod, sizes = _build(case)
    ref_mod = VARIANTS[name].build(**sizes, dtype=BF16, backend="reference")
    inp = VARIANTS[name].make_inputs(**sizes, dtype=BF16, device="cuda", seed=11)
    learn = VARIANTS[name].learnable
    customs = {n: inp[n].detach().clone().requires_grad_(n in learn)
               for n in mod.custom_io.names()}
    leaves = [inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")]
    leaves += [customs[n] for n in learn]
    o = mod(*leaves[:3], **customs)
    do = torch.randn(o.shape[::-1], device="cuda", dtype=BF16).permute(3, 2, 1, 0)
    assert not do.is_contiguous()
    g1 = torch.autograd.grad(o, leaves, do, retain_graph=True)
    g2 = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    ref_customs = dict(customs, **dict(zip(learn, ref_leaves[3:], strict=True)))
    ro = ref_mod(*ref_leaves[:3], **ref_customs)
    want = torch.autograd.grad(ro, ref_leaves, do)
    whats = ("dq", "dk", "dv", *(f"d{n}" for n in learn))
    for what, a, b, w in zip(whats, g1, g2, want, strict=True):
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"
        assert rel_err(b, a) < 1e-2, f"{what}: retain_graph run differs"


@pytest.mark.parametrize("name, heads_kv, d, seqlen", DETERMINISTIC)
def test_deterministic_backward(name, heads_kv, d, seqlen):
    """deterministic=True: the atomic-free kernels (per-head dK/dV, per-row custom gradients,
    a separate dQ kernel) match the reference and give bitwise identical gradients twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = _inputs((name, BF16, 2, 8, heads_kv, seqlen, seqlen, d, d), seed=21)
    x["mod"].deterministic = True
    first, again, want = _kernel(x), _kernel(x), _reference(x)
    for what, a, b, w in zip(["dq", "dk", "dv", *x["learn"]], first, again, want, strict=True):
        assert torch.equal(a, b), f"{what}: two deterministic runs differ"
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"


@pytest.mark.parametrize("fold_case", FOLD_CASES, ids=fold_case_id)
def test_folded_dilated_backward_matches_reference(fold_case, monkeypatch):
    """A dilated mask's backward on folded rows (engine.plan.fold), through the engine's
    autograd, against the reference backend's gradients."""
    stride, _, Sq, Skv, D, Hkv, dt, _ = fold_case
    mod, ref_mod = fold_module(fold_case), fold_module(fold_case, backend="reference")
    bk = mod.backward_kernels()
    assert bk.plan.fold is not None and bk.plan.fold.stride == stride  # the case folds
    g = torch.Generator(device="cuda").manual_seed(random_seed())
    leaves = [torch.randn(2, Sq, 8, D, device="cuda", dtype=dt, generator=g)]
    leaves += [torch.randn(2, Skv, Hkv, D, device="cuda", dtype=dt, generator=g) for _ in "kv"]
    leaves = [t.requires_grad_(True) for t in leaves]
    check_gradients(monkeypatch, mod, ref_mod, leaves, 3, ("dq", "dk", "dv"))
