"""The chunked linear-attention kernels (issue 18) against the chunked reference in float64
(engine.reference.linear, itself tested against the step-by-step recurrence on the CPU), on
the H100: outputs, final states and every gradient (q, k, v, the log decays, the initial
state), over fp16/bf16 x head sharing (one q/k head per output head; Mamba2's single q and k
head; q and k shared differently) x head dims 64-256 (Dv up to 512) x lengths that leave a
partial chunk, with initial and final states, packed sequences (cu_seqlens), and the short
lengths (1, one chunk, one chunk plus one position). A single-pass config runs the forward's
single pass and the backward's reverse single pass (engine.kernels.linear_bwd.reverse)."""

from __future__ import annotations

import pytest
import torch

from attnbench.arms import patched
from engine.kernels.linear_fwd.launch import single_pass
from engine.kernels.linear_fwd.plan import NO_FOLDS, Folds, LinearConfig
from engine.reference.executor import rel_err
from engine.reference.linear import chunked, naive_recurrence
from engine.runtime import linear_backend
from tests.gpu.cases import BF16, FP16, precompile_reported, selected_params

pytestmark = pytest.mark.gpu

HEADS = ((4, 4, 4), (1, 1, 4), (2, 1, 4))
DIMS = ((64, 64), (128, 128), (256, 256), (128, 64), (256, 512))
PACKED = (0, 37, 150, 300)
# The decays' gradient sums, per position, the terms of the pairs of positions around it
# (engine/kernels/linear_bwd/codegen.py, emit_decay_gradient): terms of both signs, each as
# accurate as dq and dk (2-3e-3 in half precision), so it loses digits where they nearly
# cancel; measured up to 2.2e-2 here before NOTES 137's split. Everything else: 2e-2. The
# value weights' gradient sums dv' * v over a row, which cancels the same way.
LIMITS = {"dg": 3e-2, "dw": 3e-2}
C128 = LinearConfig(chunk=128, block_K=128, block_V=64, threads=256)
ONE = LinearConfig(block_K=64, single_pass=True, threads=256)  # the single-pass forward
# a training call's backward beside the single pass at D <= 128 (backward_config_for_shape)
NARROW = LinearConfig(chunk=64, block_K=64, block_V=64, threads=128)
# the single pass on 128 threads: the reverse single pass beside the narrow dQ/dK kernel
NARROW_ONE = LinearConfig(block_K=64, single_pass=True, threads=128)
# beside the single pass at D 256 (backward_config_for_shape): the reverse single pass, whose
# state slice its own 256 threads hold, with the dQ/dK kernel on 128 (linear_fwd.plan.
# backward_config_problems)
D256_PAIR = (ONE, NARROW_ONE)
# (dtype, (HQ, HK, H), (D, Dv), B, T, states, packed, config: None (the default), one config
# for both passes, or a (forward, backward) pair)
CASES = ([(dt, h, d, 2, 200, True, False, None) for dt in (BF16, FP16) for h in HEADS
          for d in DIMS]
         + [(BF16, (4, 4, 4), d, 2, 256, False, False, None) for d in ((64, 64), (128, 128))]
         + [(dt, h, (128, 128), 1, PACKED[-1], True, True, None) for dt in (BF16, FP16)
            for h in ((4, 4, 4), (1, 1, 4))]
         + [(BF16, (4, 4, 4), (64, 64), 2, t, True, False, None) for t in (1, 64, 65)]
         + [(BF16, h, d, 2, 300, True, False, C128) for h in HEADS[:2]
            for d in ((128, 128), (128, 64))]
         + [(BF16, (1, 1, 4), (128, 128), 1, PACKED[-1], True, True, C128)]
         + [(BF16, h, d, 2, 200, True, False, ONE) for h in HEADS
            for d in ((64, 64), (128, 128), (128, 64), (256, 256))]
         + [(FP16, (4, 4, 4), (128, 128), 2, 200, True, False, ONE),
            (BF16, (1, 1, 4), (128, 128), 1, PACKED[-1], True, True, ONE),
            (BF16, (4, 4, 4), (64, 64), 2, 1, True, False, ONE)]
         + [(BF16, h, d, 2, 200, True, False, NARROW) for h in HEADS
            for d in ((64, 64), (128, 128), (128, 64))]
         + [(FP16, (1, 1, 4), (128, 64), 1, PACKED[-1], True, True, NARROW)]
         + [(BF16, h, (128, 128), 2, 200, True, False, NARROW_ONE) for h in HEADS]
         + [(FP16, (1, 1, 4), (128, 64), 1, PACKED[-1], True, True, NARROW_ONE)]
         # the single pass at D 256, the default where its blocks fill the SMs
         + [(BF16, (4, 4, 4), (256, 512), 2, 200, True, False, ONE),
            (FP16, (1, 1, 4), (256, 256), 2, 200, True, False, ONE),
            (BF16, (4, 4, 4), (256, 256), 1, PACKED[-1], True, True, ONE)]
         + [(BF16, (4, 4, 4), (256, 512), 2, 200, True, False, D256_PAIR),
            (FP16, (2, 1, 4), (256, 256), 2, 200, True, False, D256_PAIR),
            (BF16, (4, 4, 4), (256, 256), 1, PACKED[-1], True, True, D256_PAIR)])

# Folds (a q scale and value weights) over both forward designs, packing, sharing, fp16, D 256
FOLD_CASES = [(BF16, (1, 1, 4), (128, 64), 2, 200, True, False, None),
              (FP16, (1, 1, 4), (64, 64), 2, 200, True, False, None),
              (BF16, (4, 4, 4), (128, 128), 2, 200, True, False, ONE),
              (BF16, (1, 1, 4), (128, 128), 1, PACKED[-1], True, True, None),
              (BF16, (2, 1, 4), (128, 64), 2, 300, True, False, C128),
              (BF16, (4, 4, 4), (256, 256), 2, 200, False, False, None),
              (BF16, (1, 1, 4), (256, 256), 2, 200, True, False, ONE),
              (BF16, (1, 1, 4), (128, 128), 2, 200, True, False, NARROW_ONE),
              (BF16, (4, 4, 4), (256, 256), 2, 200, True, False, D256_PAIR)]
FOLDS = Folds(q_scale=0.37, v_weight=True)

# The plan's switches away from their defaults (engine.kernels.linear_fwd.plan), each over
# the kernels it changes: the chunk-loop kernels at one block per SM (two by default where
# their shared memory fits); the chunk's scores stored element by element, not masked in
# registers and copied whole (SCORES_IN_FRAGMENT); the dV kernel's scores in registers too.
# Each switch's cases: (case, the forward keeps its states, the folds applied).
PLAN = "engine.kernels.linear_fwd.plan"
ONE_S1 = LinearConfig(block_K=64, num_stages=1, single_pass=True, threads=256)
SWITCHES = {
    "one-block": (((PLAN, "CHUNK_LOOP_BLOCKS_PER_SM", 1),),
                  [((BF16, (4, 4, 4), (128, 128), 2, 300, True, False, C128), False, False),
                   ((FP16, (1, 1, 4), (128, 64), 1, PACKED[-1], True, True, C128), False,
                    False),
                   ((BF16, (4, 4, 4), (256, 256), 2, 200, True, False, D256_PAIR), False,
                    False),
                   ((BF16, (4, 4, 4), (256, 256), 2, 200, True, False, D256_PAIR), True,
                    False),
                   ((BF16, (2, 1, 4), (128, 128), 2, 200, True, False, ONE_S1), False, False),
                   ((FP16, (1, 1, 4), (128, 64), 1, PACKED[-1], True, True, ONE_S1), True,
                    False)]),
    "scores-per-element": (((PLAN, "SCORES_IN_FRAGMENT", False),),
                           [((BF16, (4, 4, 4), (128, 64), 2, 300, True, False, C128), False,
                             True),
                            ((BF16, (2, 1, 4), (128, 128), 2, 200, True, False, ONE), True,
                             True)]),
    "dv-scores-in-fragment": (((PLAN, "DV_SCORES_IN_FRAGMENT", True),),
                              [((BF16, (4, 4, 4), (128, 64), 2, 300, True, False, C128), False,
                                True),
                               ((FP16, (1, 1, 4), (128, 128), 1, PACKED[-1], True, True, C128),
                                False, False)]),
}
SWITCH_RUNS = [(name, run) for name, (_, runs) in SWITCHES.items() for run in runs]


def switch_id(run: tuple) -> str:
    name, (case, save, folded) = run
    return f"{name}-{case_id(case)}" + ("-kept" if save else "") + ("-folded" if folded else "")


def case_id(c: tuple) -> str:
    dt, (hq, hk, h), (d, dv), b, t, states, packed, cfg = c
    return (f"{'bf16' if dt is BF16 else 'fp16'}-H{hq}x{hk}x{h}-D{d}x{dv}-B{b}-T{t}"
            + ("-states" if states else "") + ("-packed" if packed else "")
            + "".join(f"-{c.key()}" for c in _pair(cfg) if c))


def _pair(cfg) -> tuple:
    """(forward config, backward config) of a case's config field (None: the defaults)."""
    return cfg if isinstance(cfg, tuple) else (cfg, None)


def _inputs(case: tuple, device: str = "cuda") -> dict:
    dt, (hq, hk, h), (d, dv), b, t, states, packed, _ = case
    n = len(PACKED) - 1 if packed else b
    gen = torch.Generator(device="cpu").manual_seed(hash(case_id(case)) % 2**31)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    out = {"q": rnd(b, hq, t, d, scale=d**-0.5).to(dt), "k": rnd(b, hk, t, d).to(dt),
           "v": rnd(b, h, t, dv).to(dt),
           # log decays between about -0.02 and -2 (gated retention / Mamba2-like)
           "g": torch.nn.functional.logsigmoid(rnd(b, h, t) + 2.0),
           "h0": rnd(n, h, d, dv, scale=0.1) if states else None,
           "cu": torch.tensor(PACKED, dtype=torch.int32, device=device) if packed else None}
    return out


def _sources(case: tuple, folds: Folds = NO_FOLDS, deterministic: bool = False,
             save: bool = False) -> list[str]:
    dt, (hq, hk, h), (d, dv), b, t, states, packed, cfg = case
    q = torch.empty(b, hq, t, d, dtype=dt, device="meta")
    k = torch.empty(b, hk, t, d, dtype=dt, device="meta")
    v = torch.empty(b, h, t, dv, dtype=dt, device="meta")
    cache = linear_backend.LinearKernelCache(deterministic)
    shape = linear_backend.linear_shape(q, k, v, torch.empty(len(PACKED)) if packed else None)
    fwd, bwd = linear_backend.configs(shape, *_pair(cfg))
    fk, bk = cache.forward(shape, fwd, folds), cache.backward(shape, bwd, folds)
    # the forward's kernels, the backward's, and the state pass the backward reruns (none
    # where the forward keeps its states)
    return [*fk.sources(states, states, save), *([] if save else [fk.states(states, False).source]),
            *bk.sources(states, states)]


def _step_sources(case: tuple) -> list[str]:
    dt, (hq, hk, h), (d, dv), t, states = case
    shape = linear_backend.linear_shape(torch.empty(3, hq, t, d, dtype=dt, device="meta"),
                                        torch.empty(3, hk, t, d, dtype=dt, device="meta"),
                                        torch.empty(3, h, t, dv, dtype=dt, device="meta"), None)
    return linear_backend.LinearKernelCache().step(shape).sources(states)


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    chosen = selected_params(request, "case")
    srcs = [s for c in CASES if c in chosen for s in _sources(c)]
    srcs += [s for c in FOLD_CASES if c in chosen for s in _sources(c, FOLDS)]
    srcs += [s for c in STEP_CASES if c in selected_params(request, "case") for s in
             _step_sources(c)]
    srcs += [s for c in SHARED_CASES if c in selected_params(request, "case") for s in
             (*_sources(c), *_sources(c, deterministic=True))]
    srcs += [s for c, folds in SAVED_CASES if c in chosen for s in _sources(c, folds, save=True)]
    for name, (case, save, folded) in selected_params(request, "run"):
        with patched(SWITCHES[name][0]):
            srcs += _sources(case, FOLDS if folded else NO_FOLDS, save=save)
    precompile_reported(request, srcs)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_linear_kernels_match_reference(case):
    _compare(case)


@pytest.mark.parametrize("case", FOLD_CASES, ids=case_id)
def test_folded_kernels_match_reference(case):
    """A q scale and per-position value weights folded into the kernels (Folds: simple GLA's
    q * D^-0.5, Mamba2's v * dt) against the reference of q_scale * q and w * v, with the
    weights' gradient."""
    _compare(case, q_scale=FOLDS.q_scale, weighted=True)


@pytest.mark.parametrize("run", SWITCH_RUNS, ids=switch_id)
def test_plan_switches_match_reference(run):
    name, (case, save, folded) = run
    with patched(SWITCHES[name][0]):
        if folded:
            _compare(case, q_scale=FOLDS.q_scale, weighted=True, save=save)
        else:
            _compare(case, save=save)


def _compare(case: tuple, q_scale: float = 1.0, weighted: bool = False,
             cache: linear_backend.LinearKernelCache | None = None, save: bool = False) -> None:
    x = _inputs(case)
    states = x["h0"] is not None
    names = ["q", "k", "v", "g", *(["w"] if weighted else []), *(["h0"] if states else [])]
    if weighted:  # Mamba2's dt: positive, about 0.001 to 0.5
        x["w"] = torch.nn.functional.softplus(torch.randn_like(x["g"]) - 2.0)
    leaves = [x[n].requires_grad_(True) for n in names]
    ref = {n: t.detach().double().requires_grad_(True) for n, t in zip(names, leaves, strict=True)}
    got = dict(zip(names, leaves, strict=True))
    o, ht = linear_backend.run(cache or linear_backend.LinearKernelCache(), got["q"], got["k"],
                               got["v"], got["g"], got.get("h0"), x["cu"], states,
                               *_pair(case[-1]), q_scale=q_scale, v_weight=got.get("w"),
                               save_states=save)
    rv = ref["v"] * ref["w"].unsqueeze(-1) if weighted else ref["v"]
    ro, rht = chunked(ref["q"] * q_scale, ref["k"], rv, ref["g"], ref.get("h0"), x["cu"])
    assert o.dtype == x["q"].dtype and o.shape == ro.shape
    errs = {"o": rel_err(o, ro)}
    do = torch.randn_like(o)
    loss, ref_loss = (o.float() * do).sum(), (ro * do.double()).sum()
    if states:
        errs["final state"] = rel_err(ht, rht)
        dht = torch.randn_like(ht)
        loss, ref_loss = loss + (ht * dht).sum(), ref_loss + (rht * dht.double()).sum()
    grads = torch.autograd.grad(loss, leaves)
    want = torch.autograd.grad(ref_loss, list(ref.values()))
    for name, a, w, leaf in zip(names, grads, want, leaves, strict=True):
        assert a.shape == leaf.shape and a.dtype == leaf.dtype, name
        errs["d" + name] = rel_err(a, w)
    nan = [n for n, t in zip(("o", *names), (o, *grads), strict=True) if torch.isnan(t).any()]
    assert not nan, f"NaN in {nan}"
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e < LIMITS.get(n, 2e-2)}
    assert not bad, f"relative errors over {LIMITS}: {bad} (all: " + \
        ", ".join(f"{n} {e:.1e}" for n, e in errs.items()) + ")"


# The forward keeping its states for the backward (save_states): the single pass writing them,
# and the two kernels' state pass (which always does), with states, packing, folds, sharing
SAVED_CASES = [((BF16, (4, 4, 4), (128, 128), 2, 200, True, False, ONE), NO_FOLDS),
               ((FP16, (1, 1, 4), (128, 64), 1, PACKED[-1], True, True, ONE), FOLDS),
               ((BF16, (4, 4, 4), (256, 256), 2, 200, True, False, ONE), FOLDS),
               ((BF16, (2, 1, 4), (64, 64), 2, 65, False, False, ONE), NO_FOLDS),
               ((BF16, (4, 4, 4), (128, 128), 2, 300, True, False, C128), NO_FOLDS)]


@pytest.mark.parametrize("case,folds", SAVED_CASES, ids=lambda c: case_id(c)
                         if isinstance(c, tuple) else ("folded" if c.v_weight else "plain"))
def test_kept_states_match_reference(case, folds):
    """Outputs and gradients against the reference with the forward's states kept, and the
    backward ran no state pass of its own (its rerun takes no final state: a state pass the
    forward did not run itself)."""
    cache = linear_backend.LinearKernelCache()
    _compare(case, q_scale=folds.q_scale, weighted=folds != NO_FOLDS, cache=cache, save=True)
    fk = next(k for key, k in cache.kernels.items() if key[0] == "fwd")
    states = case[5]
    ran = set(fk._states) - (set() if single_pass(fk) else {(states, states)})
    assert (states, False) not in ran, "the backward ran the state pass again"


# Shared q/k heads: float32 atomics into the shared head by default, per-head sums in the
# deterministic mode (engine.kernels.linear_bwd.plan.shared_heads_by_atomics)
SHARED_CASES = [(BF16, (1, 1, 4), (128, 64), 2, 300, False, False, None),
                (BF16, (2, 1, 4), (64, 64), 2, 200, False, False, None)]


@pytest.mark.parametrize("case", SHARED_CASES, ids=case_id)
def test_shared_heads_atomics_and_the_deterministic_mode(case):
    """Both modes' gradients agree to rounding; the deterministic mode's are bitwise the
    same on a second call (the reference check of both modes: test_linear_kernels_match_
    reference runs the atomics, this test the per-head sums against them)."""
    x = _inputs(case)
    do = torch.randn(*x["v"].shape, device="cuda", dtype=x["v"].dtype)

    def grads(cache):
        leaves = [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g")]
        o, _ = linear_backend.run(cache, *leaves, None, None, False, config=case[-1])
        return torch.autograd.grad(o, leaves, do)

    det = linear_backend.LinearKernelCache(deterministic=True)
    first, again = grads(det), grads(det)
    fast = grads(linear_backend.LinearKernelCache())
    for name, a, b, f in zip(("dq", "dk", "dv", "dg"), first, again, fast, strict=True):
        assert torch.equal(a, b), f"{name}: the deterministic mode differs between calls"
        assert rel_err(f, a.double()) < 5e-3, (name, rel_err(f, a.double()))


# The recurrent step (engine.kernels.linear_step): a few positions per row, no gradient.
STEP_CASES = ([(BF16, h, d, t, True) for h in HEADS for d in ((64, 64), (128, 128), (256, 512))
               for t in (1, 3)]
              + [(FP16, (4, 4, 4), (128, 128), 1, True), (BF16, (4, 4, 4), (128, 128), 1, False),
                 (BF16, (1, 1, 4), (128, 64), 8, True)])


def step_id(c: tuple) -> str:
    dt, (hq, hk, h), (d, dv), t, states = c
    return (f"{'bf16' if dt is BF16 else 'fp16'}-H{hq}x{hk}x{h}-D{d}x{dv}-T{t}"
            + ("-state" if states else ""))


@pytest.mark.parametrize("case", STEP_CASES, ids=step_id)
def test_recurrent_step_matches_recurrence(case):
    dt, heads, dims, t, states = case
    x = _inputs((dt, heads, dims, 3, t, states, False, None))
    assert linear_backend.is_step(linear_backend.linear_shape(x["q"], x["k"], x["v"], None))
    with torch.no_grad():
        o, ht = linear_backend.run(linear_backend.LinearKernelCache(), x["q"], x["k"], x["v"],
                                   x["g"], x["h0"], None, True)
        ro, rht = naive_recurrence(*(x[n].double() for n in "qkv"), x["g"].double(),
                                   None if x["h0"] is None else x["h0"].double())
    assert not torch.isnan(o).any() and not torch.isnan(ht).any()
    assert rel_err(o, ro) < 2e-2 and rel_err(ht, rht) < 2e-2, (rel_err(o, ro), rel_err(ht, rht))


def test_generation_continues_a_prefill():
    """A chunked prefill's final state, then single-token steps: the same as one pass."""
    x = _inputs((BF16, (1, 1, 4), (128, 64), 2, 203, True, False, None))
    cache = linear_backend.LinearKernelCache()
    with torch.no_grad():
        o, h = linear_backend.run(cache, *(x[n][:, :, :200].contiguous()
                                           for n in ("q", "k", "v", "g")), x["h0"], None, True)
        outs = [o]
        for i in range(200, 203):
            o, h = linear_backend.run(cache, *(x[n][:, :, i:i + 1].contiguous()
                                               for n in ("q", "k", "v", "g")), h, None, True)
            outs.append(o)
        ro, rht = naive_recurrence(*(x[n].double() for n in "qkv"), x["g"].double(),
                                   x["h0"].double())
    assert rel_err(torch.cat(outs, 2), ro) < 2e-2 and rel_err(h, rht) < 2e-2
