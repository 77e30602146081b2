"""Every linear variant of the library (engine.variants.linear) through LinearAttentionEngine
on the kernels against the same module on the reference backend (its chunked torch core in
float32, after the same q/k/v/decay mods): outputs and the gradients of q, k, v and every
learnable input (Mamba2's A and dt, simple GLA's decay), fp16 and bf16, a length that leaves
a partial chunk, with Mamba2's one shared q/k head, at D 64 and 128."""

from __future__ import annotations

import pytest
import torch

from attnbench.linear import decay_needs_grad
from engine.kernels.linear_fwd.plan import LinearConfig
from engine.reference.executor import rel_err
from engine.reference.linear import chunked
from engine.runtime import linear_backend
from engine.variants.linear import LINEAR_VARIANTS
from tests.gpu.cases import BF16, FP16, precompile_reported, selected_params

pytestmark = pytest.mark.gpu


def _sizes(name: str, d: int, heads: int = 4) -> dict:
    shared = 1 if name == "mamba2" else heads
    return dict(batch=2, heads_q=shared, heads_k=shared, heads=heads, seqlen=300, head_dim=d,
                head_dim_v=d)


# 4 heads: the two-kernel forward beside a backward at its config; 80: enough blocks for the
# single-pass forward, beside the reverse single pass of backward_config_for_shape (with the
# narrow dQ/dK kernel, or Mamba2's at the forward's config: a training call's default pair at
# the suite's shapes)
CASES = ([(name, dt, d, 4) for name in sorted(LINEAR_VARIANTS) for dt in (BF16, FP16)
          for d in (64, 128)]
         + [(name, BF16, 128, 80) for name in sorted(LINEAR_VARIANTS)])


def case_id(c: tuple) -> str:
    name, dt, d, heads = c
    return f"{name}-{'bf16' if dt is BF16 else 'fp16'}-D{d}" + (f"-H{heads}" if heads != 4
                                                                   else "")


def _case_sources(case: tuple) -> list[str]:
    """A training call's kernels at the case's sizes (the module's folds included)."""
    name, dt, d, heads = case
    variant = LINEAR_VARIANTS[name]
    return variant.build(_sizes(name, d, heads), dt, backend="tilelang").kernel_sources(
        ("fwd", "bwd"), decay_grad=decay_needs_grad(variant))


def _generation_sources(name: str) -> list[str]:
    """The generation test's kernels: a 200-position prefill returning its state, then the
    one-token recurrent step with a state."""
    variant, sizes = LINEAR_VARIANTS[name], _sizes(name, 128)
    prefill = variant.build({**sizes, "seqlen": 200}, BF16, backend="tilelang")
    step = linear_backend.linear_shape(*(torch.empty(2, n, 1, sizes[dim], dtype=BF16,
                                                     device="meta")
                                         for n, dim in ((sizes["heads_q"], "head_dim"),
                                                        (sizes["heads_k"], "head_dim"),
                                                        (sizes["heads"], "head_dim_v"))), None)
    return [*prefill.kernel_sources(final_state=True),
            *linear_backend.LinearKernelCache().step(step).sources(True)]


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Every selected test's kernels compiled in parallel first (one by one in the tests,
    the module took 278 s on the H200)."""
    srcs = [s for c in CASES if c in selected_params(request, "case") for s in _case_sources(c)]
    srcs += [s for n in sorted(LINEAR_VARIANTS) if n in selected_params(request, "name")
             for s in _generation_sources(n)]
    srcs += [s for c in LONG_CONFIGS if c in selected_params(request, "cfg")
             for s in _long_module(c).kernel_sources(("fwd", "bwd"))]
    precompile_reported(request, srcs)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_variant_on_the_kernels_matches_the_reference_backend(case):
    name, dt, d, heads = case
    variant, sizes = LINEAR_VARIANTS[name], _sizes(name, d, heads)
    got_mod = variant.build(sizes, dt, backend="tilelang")
    ref_mod = variant.build(sizes, dt, backend="reference")
    x = variant.make_inputs(sizes, dt, "cuda", seed=d, requires_grad=True)
    ref_x = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in x.items()}
    # a tensor listed twice (Mamba2's dt) stays one tensor on each side
    for n, t in x.items():
        for m, u in x.items():
            if u is t and m != n:
                ref_x[m] = ref_x[n]
    o, ro = got_mod(*x.values()), ref_mod(*ref_x.values())
    assert not torch.isnan(o).any()
    assert rel_err(o, ro) < 2e-2, rel_err(o, ro)
    do = torch.randn_like(o)
    wrt = [n for n in dict.fromkeys(("q", "k", "v", *variant.learnable))]
    got = torch.autograd.grad(o, [x[n] for n in wrt], do)
    want = torch.autograd.grad(ro, [ref_x[n] for n in wrt], do)
    errs = {n: rel_err(a, w) for n, a, w in zip(wrt, got, want, strict=True)}
    assert all(not torch.isnan(a).any() for a in got), errs
    # the decays' gradient is a difference that cancels (tests/gpu/test_linear_kernels.py)
    bad = {n: e for n, e in errs.items() if not e < (3e-2 if n in ("decay", "A", "dt") else 2e-2)}
    assert not bad, errs


# Mamba2 at a model's length: A's gradient sums the decays' gradient over the whole sequence,
# where the states' rounding once reached every earlier position (9-32% off at T 2k-8k with
# 80 heads, results/NOTES.md 137). Configs: every ratio of threads to chunk (1, 2, 4) the
# kernel's <dS, S> gather meets; the 64-position ones run the dQ/dK kernel's walk over heads
# (linear_bwd.plan.dqk_heads_per_block: 4 of the 8 heads a block).
LONG_CONFIGS = [None, LinearConfig(64, 128, 64, 2, 128), LinearConfig(64, 64, 64, 2, 256),
                LinearConfig(128, 128, 64, 2, 128)]
LONG_SIZES = dict(batch=1, heads_q=1, heads_k=1, heads=8, seqlen=4000, head_dim=128,
                  head_dim_v=64)


def _long_module(cfg: LinearConfig | None):
    return LINEAR_VARIANTS["mamba2"].build(LONG_SIZES, BF16, backend="tilelang", config=cfg,
                                           backward_config=cfg)


def _mamba2_float64(q, k, v, decay, A, dt):
    return chunked(q, k, v * dt[..., None], decay * A.view(1, -1, 1))[0]


@pytest.mark.parametrize("cfg", LONG_CONFIGS, ids=lambda c: c.key() if c else "default")
def test_mamba2_gradients_at_a_long_sequence(cfg):
    variant = LINEAR_VARIANTS["mamba2"]
    x = variant.make_inputs(LONG_SIZES, BF16, "cuda", seed=3, requires_grad=True)
    moved: dict[int, torch.Tensor] = {}  # dt is the decay input and a custom input: one leaf
    x64 = {n: moved.setdefault(id(t), t.detach().double().requires_grad_(t.requires_grad))
           for n, t in x.items()}
    wrt = ["q", "k", "v", "A", "dt"]
    o = _long_module(cfg)(*x.values())
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, [x[n] for n in wrt], do)
    want = torch.autograd.grad(_mamba2_float64(*x64.values()), [x64[n] for n in wrt],
                               do.double())
    errs = {n: rel_err(a, w) for n, a, w in zip(wrt, got, want, strict=True)}
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.parametrize("name", sorted(LINEAR_VARIANTS))
def test_variant_generation_steps_match_the_reference_backend(name):
    """A prefill returning its state, then one-token calls with the state (the recurrent step
    kernel), each variant's mods applied to every token, against the reference backend."""
    variant, sizes = LINEAR_VARIANTS[name], _sizes(name, 128)
    mods = {b: variant.build(sizes, BF16, backend=b) for b in ("tilelang", "reference")}
    x = variant.make_inputs({**sizes, "seqlen": 203}, BF16, "cuda", seed=7)
    names = list(x)
    timed = {n for n in names if x[n].dim() >= 3 and x[n].shape[2] == 203}

    def part(lo: int, hi: int) -> list[torch.Tensor]:  # positions lo..hi-1 of every T axis
        return [x[n][:, :, lo:hi].contiguous() if n in timed else x[n] for n in names]

    outs = {}
    with torch.no_grad():
        for backend, mod in mods.items():
            o, state = mod(*part(0, 200), output_final_state=True)
            steps = [o]
            for t in range(200, 203):
                o, state = mod(*part(t, t + 1), initial_state=state, output_final_state=True)
                steps.append(o)
            outs[backend] = (torch.cat(steps, 2), state)
    (o, h), (ro, rh) = outs["tilelang"], outs["reference"]
    assert not torch.isnan(o).any()
    assert rel_err(o, ro) < 2e-2 and rel_err(h, rh) < 2e-2, (rel_err(o, ro), rel_err(h, rh))
