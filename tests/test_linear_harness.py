"""The linear suite in the harness: cases, capabilities, fla's and mamba_ssm's input mappings
(against torch stand-ins of their ops), the reference slices and a CPU run of the runner."""

import contextlib
import dataclasses
import os
import sys
import types

import pytest
import torch

from attnbench import linear, metrics
from attnbench.cases import Case
from attnbench.impls import DeviceInfo, get_impl, registry
from attnbench.impls.base import ALL_DTYPES, Prepared
from attnbench.impls.fla import FlaImpl, gated_backward_on_hopper
from attnbench.impls.fla_inputs import fla_call, from_fla, head_problem, to_fla
from attnbench.impls.mamba_ssm import NOT_INSTALLED, MambaSsmImpl
from attnbench.runner import Runner, RunOptions
from attnbench.shapes import ShapePreset, get_shape, parse_shapes
from attnbench.suites import SuiteError, load_suite, parse_suite
from engine.variants.linear import LINEAR_VARIANTS

CPU = DeviceInfo("cpu")
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
MAPPED = ("simple_gla", "retnet_linear", "mamba2")


def case(variant="simple_gla", **over) -> Case:
    sizes = dict(batch=2, heads_q=3, heads_kv=3, heads=3, seqlen_q=37, seqlen_kv=37,
                 head_dim=16, head_dim_v=8)
    if variant == "mamba2":
        sizes.update(heads_q=1, heads_kv=1)
    c = dict(suite="t", name="c", variant=variant, shape="s", dtype="float32", kind="linear",
             modes=("fwd", "fwd+bwd"), impls=("reference",), baseline="reference", **sizes)
    c.update(over)
    return Case(**c)


def naive_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, **_):
    """fla's chunk_simple_gla semantics in plain torch ([B, T, H, D]; float64 math)."""
    B, T, H, _ = q.shape
    if g is None:
        g = g_gamma.view(1, 1, H).expand(B, T, H)
    G = g.double().cumsum(1).transpose(1, 2)
    qq, kk, vv = (x.double().transpose(1, 2) for x in (q, k, v))
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    w = torch.where(keep, torch.exp(torch.where(keep, G[..., :, None] - G[..., None, :], 0.0)),
                    0.0)
    o = ((qq @ kk.transpose(-1, -2)) * scale * w) @ vv
    return o.transpose(1, 2).to(q.dtype), None


def naive_ssd(x, dt, A, B, C, chunk_size=256, **_):
    """mamba_ssm's mamba_chunk_scan_combined semantics (one group, no D, z or dt bias)."""
    H = x.shape[2]
    return naive_simple_gla(C.expand(-1, -1, H, -1), B.expand(-1, -1, H, -1),
                            x * dt[..., None], g=dt * A, scale=1.0)[0]


def cpu(impl):
    """`impl` allowed on a CPU in every dtype (its op replaced by a torch stand-in)."""
    class OnCpu(type(impl)):
        @property
        def caps(self):
            return dataclasses.replace(super().caps, devices=frozenset({"cpu"}),
                                       dtypes=ALL_DTYPES)

        def unavailable(self):
            return None

    impl.__class__ = OnCpu
    return impl


# ---------------------------------------------------------------- suite and shapes
def test_linear_suite_expands_against_the_linear_library():
    suite = load_suite("linear")
    assert len(suite.cases) == 20
    by_variant = {}
    for c in suite.cases:
        by_variant.setdefault(c.variant, []).append(c)
        assert c.kind == "linear" and c.dtype == "bfloat16" and c.baseline == "fla"
        assert c.modes == ("fwd", "fwd+bwd") and c.seqlen_q == c.seqlen_kv
    assert set(by_variant) == {"simple_gla", "retnet_linear", "mamba2"}
    for c in by_variant["mamba2"]:
        assert (c.heads_q, c.heads_kv, c.heads, c.head_dim, c.head_dim_v) == (1, 1, 80, 128, 64)
        assert c.impls == ("fla", "engine", "engine-saved-states", "mamba_ssm")
        assert c.batch in (1, 8)
        assert 2048 <= c.seqlen_q <= 8192
    dims = {(c.shape, c.batch, c.seqlen_q, c.heads, c.head_dim, c.head_dim_v)
            for c in by_variant["simple_gla"]}
    assert {("fla-h16-d128", 8, 4096, 16, 128, 128), ("fla-h16-d128", 2, 16384, 16, 128, 128),
            ("yoco-13b", 8, 1024, 40, 256, 256), ("retnet-6.7b", 1, 2048, 32, 256, 512)} <= dims
    assert dims == {(c.shape, c.batch, c.seqlen_q, c.heads, c.head_dim, c.head_dim_v)
                    for c in by_variant["retnet_linear"]}


def test_linear_cases_name_linear_variants():
    data = {"kind": "linear", "impls": ["fla"], "modes": ["fwd"], "dtypes": ["bf16"],
            "cases": [{"variants": ["softmax"], "shapes": ["fla-h16-d128"], "seqlens": [64]}]}
    with pytest.raises(SuiteError, match="unknown variant 'softmax'; known linear variants: .*mamba2"):
        parse_suite(data, name="t")
    attention = {**data, "kind": "attention",
                 "cases": [{"variants": ["mamba2"], "shapes": ["llama3-8b"], "seqlens": [64]}]}
    with pytest.raises(SuiteError, match="unknown variant 'mamba2'; known attention variants"):
        parse_suite(attention, name="t")


def test_shape_presets_read_as_linear_attention():
    assert get_shape("mamba2-2.7b").linear_sizes() == dict(
        heads_q=1, heads_k=1, heads=80, head_dim=128, head_dim_v=64)
    assert get_shape("retnet-6.7b").linear_sizes() == dict(
        heads_q=32, heads_k=32, heads=32, head_dim=256, head_dim_v=512)
    assert get_shape("yoco-13b").linear_sizes()["head_dim_v"] == 256
    base = {"heads_q": 4, "head_dim": 64, "source": "x"}
    with pytest.raises(ValueError, match="linear has unknown keys"):
        parse_shapes({"s": {**base, "linear": {"state": 3}}})
    with pytest.raises(ValueError, match="linear.heads .8. must be a multiple of linear.heads_q"):
        parse_shapes({"s": {**base, "linear": {"heads": 8, "heads_q": 3}}})


def test_linear_flops_count_the_chunked_matmuls():
    # per token and head: fwd 2*(32*(D + Dv) + 2*D*Dv), bwd 2*(32*(3D + 2Dv) + 5*D*Dv)
    fwd = metrics.linear_flops(2, 3, 10, 128, 64, "fwd")
    assert fwd == 2 * 2 * 3 * 10 * (32 * 192 + 2 * 128 * 64)
    bwd = metrics.linear_flops(2, 3, 10, 128, 64, "bwd")
    assert bwd == 2 * 2 * 3 * 10 * (32 * (3 * 128 + 2 * 64) + 5 * 128 * 64)
    assert metrics.linear_flops(2, 3, 10, 128, 64, "fwd+bwd") == fwd + bwd


# ---------------------------------------------------------------- capabilities
@pytest.mark.parametrize("impl, c, dev, msg", [
    ("engine", case(dtype="bfloat16"), CPU, "needs a Hopper GPU"),
    ("engine-dynamic", case(dtype="bfloat16"), H100, "linear cases not supported"),
    ("fla", case(variant="linear_elu", dtype="bfloat16"), H100, "variant linear_elu not supported"),
    ("fla", case(kind="attention", dtype="bfloat16"), H100, "attention cases not supported"),
    ("fla", case(dtype="bfloat16"), CPU, "needs a CUDA GPU"),
    ("mamba_ssm", case(dtype="bfloat16"), H100, "variant simple_gla not supported"),
])
def test_linear_capability_reasons(impl, c, dev, msg):
    reason = get_impl(impl).check_modes(c, LINEAR_VARIANTS[c.variant], dev)
    assert all(msg in r for r in reason.values()), reason


def test_linear_capabilities_that_pass():
    c = case(dtype="bfloat16")
    assert set(get_impl("reference").check_modes(c, LINEAR_VARIANTS["simple_gla"], CPU).values()
               ) == {None}
    assert get_impl("engine").check_modes(c, LINEAR_VARIANTS["simple_gla"], H100) == {
        "fwd": None, "fwd+bwd": None}
    saved = get_impl("engine-saved-states").check_modes(c, LINEAR_VARIANTS["simple_gla"], H100)
    assert saved["fwd+bwd"] is None and "mode fwd not supported" in saved["fwd"]
    assert get_impl("engine-saved-states").caps.check(case(kind="attention"), H100)
    for variant in MAPPED:
        assert get_impl("fla").caps.check(case(variant, dtype="bfloat16"), H100) is None
    grouped = case(heads_q=2, heads_kv=2, heads=4, dtype="bfloat16")
    assert "neither 1 (broadcast) nor the value heads" in head_problem(grouped)
    assert head_problem(case("mamba2", heads=4)) is None


def test_mamba_ssm_says_why_it_is_missing():
    impl = get_impl("mamba_ssm")
    c = case("mamba2", dtype="bfloat16")
    assert impl.caps.check(c, H100) is None
    if impl.unavailable() is not None:  # no wheel for the GPU host's torch/CUDA
        assert impl.unavailable() == NOT_INSTALLED
        assert "sdist" in NOT_INSTALLED and "torch 2.11" in NOT_INSTALLED


# ---------------------------------------------------------------- input mappings
def _inputs(c: Case, seed=0):
    return LINEAR_VARIANTS[c.variant].make_inputs(linear.linear_sizes(c), torch.float64, "cpu",
                                                  seed)


@pytest.mark.parametrize("variant", MAPPED)
def test_fla_mapping_matches_the_variant_reference(variant):
    c = case(variant)
    inputs = _inputs(c)
    grad_out = torch.randn(c.batch, c.heads, c.seqlen_q, c.head_dim_v, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
    ref = linear.linear_reference(c, LINEAR_VARIANTS[variant], inputs, grad_out, torch.float64,
                                  True)
    call = fla_call(c, inputs, needs_grad=True)
    out = naive_simple_gla(call.q, call.k, call.v, **call.kwargs())[0]
    grads = torch.autograd.grad(out, call.leaves, to_fla(grad_out))
    got = (from_fla(out), *call.grads_back(grads))
    # the learnable inputs' gradients too: simple GLA's decay, Mamba2's dt and A
    assert len(ref) == 4 + {"simple_gla": 1, "retnet_linear": 0, "mamba2": 2}[variant]
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape
        # the decays are float32, and the learnable inputs' chain rule runs in it
        tol = 1e-6 if i < 4 else 1e-4
        torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)


def test_fla_retention_needs_a_fixed_gamma():
    c = case("retnet_linear")
    inputs = _inputs(c)
    inputs["decay"] = inputs["decay"].clone()
    inputs["decay"][0, 0, 5] = 0.5
    with pytest.raises(ValueError, match="one fixed gamma per head"):
        fla_call(c, inputs, needs_grad=False)


def test_mamba_ssm_mapping_matches_the_variant_reference():
    c = case("mamba2")
    inputs = _inputs(c)
    grad_out = torch.randn(c.batch, c.heads, c.seqlen_q, c.head_dim_v, dtype=torch.float64)
    ref = linear.linear_reference(c, LINEAR_VARIANTS["mamba2"], inputs, grad_out,
                                  torch.float64, True)
    p = MambaSsmImpl(op=lambda: naive_ssd).prepare(c, LINEAR_VARIANTS["mamba2"], inputs, True)
    out = p.forward()
    got = (p.to_common(out), *p.grads_to_common(torch.autograd.grad(
        out, p.leaves, p.from_common(grad_out))))
    for g, r in zip(got, ref, strict=True):  # o, dC, dB, dx, ddt, dA
        torch.testing.assert_close(g.double(), r, rtol=1e-6, atol=1e-6)


def test_gated_backward_has_fla_write_its_states_in_the_input_dtype(monkeypatch):
    # chunk_simple_gla_bwd's h and dh passes get states_in_fp32=False (no conversion passes
    # after them); every other argument reaches fla as given
    seen = []
    chunk = types.ModuleType("fla.ops.simple_gla.chunk")
    chunk.chunk_fwd_h = lambda **kw: seen.append(("h", kw))
    chunk.chunk_bwd_dh = lambda **kw: seen.append(("dh", kw))
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla.chunk", chunk)
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    originals = (chunk.chunk_fwd_h, chunk.chunk_bwd_dh)
    with gated_backward_on_hopper():
        assert (chunk.chunk_fwd_h, chunk.chunk_bwd_dh) != originals
        chunk.chunk_fwd_h(k=1, states_in_fp32=True, chunk_size=64)
        chunk.chunk_bwd_dh(q=2, states_in_fp32=True)
        assert os.environ["FLA_TILELANG"] == "1"
    assert seen == [("h", {"k": 1, "states_in_fp32": False, "chunk_size": 64}),
                    ("dh", {"q": 2, "states_in_fp32": False})]
    assert (chunk.chunk_fwd_h, chunk.chunk_bwd_dh) == originals
    assert "FLA_TILELANG" not in os.environ


def test_linear_args_share_mamba2_dt_between_decay_and_custom():
    v = LINEAR_VARIANTS["mamba2"]
    inputs = _inputs(case("mamba2"))
    args, learned = linear.linear_args(v, inputs, needs_grad=True)
    decay, a, dt = args
    assert decay is dt and len(learned) == 2 and all(t.requires_grad for t in learned)
    args, learned = linear.linear_args(LINEAR_VARIANTS["retnet_linear"], _inputs(
        case("retnet_linear")), needs_grad=True)
    assert learned == () and not args[0].requires_grad


def test_reference_slices_heads_exactly(monkeypatch):
    c = case("mamba2", heads=4)
    v = LINEAR_VARIANTS["mamba2"]
    inputs = _inputs(c)
    grad_out = torch.randn(c.batch, c.heads, c.seqlen_q, c.head_dim_v, dtype=torch.float64)
    whole = linear.linear_reference(c, v, inputs, grad_out, torch.float64, True)
    monkeypatch.setattr(linear, "REF_CHUNK_ELEMS", c.seqlen_q ** 2 * 3)  # 3 heads a slice
    assert linear.head_chunk(c) == 3
    parts = linear.linear_reference(c, v, inputs, grad_out, torch.float64, True)
    for a, b in zip(whole, parts, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the runner on a CPU
TINY = {
    "tiny": ShapePreset("tiny", 2, 2, 16, 16, "x"),
    "tiny-ssd": ShapePreset("tiny-ssd", 3, 3, 8, 8, "x", None, (
        ("heads_q", 1), ("heads_k", 1), ("heads", 3), ("head_dim", 16), ("head_dim_v", 8))),
}


def test_runner_times_linear_cases_on_a_cpu(tmp_path):
    data = {"kind": "linear", "impls": ["reference", "fla", "engine"], "baseline": "fla",
            "modes": ["fwd", "fwd+bwd"], "dtypes": ["float32"], "repeats": 2, "warmup": 0,
            "cases": [{"variants": ["simple_gla", "retnet_linear"], "shapes": ["tiny"],
                       "seqlens": [40], "batch": 2},
                      {"variants": ["mamba2"], "shapes": ["tiny-ssd"], "seqlens": [40],
                       "batch": 2, "impls": ["reference", "fla", "engine", "mamba_ssm"]}]}
    suite = parse_suite(data, name="lin", shapes=TINY)
    impls = {**registry(), "mamba_ssm": cpu(MambaSsmImpl(op=lambda: naive_ssd)),
             "fla": cpu(FlaImpl(op=lambda: naive_simple_gla,
                                backward_context=contextlib.nullcontext))}
    rows = Runner(suite, RunOptions(device="cpu", out_dir=tmp_path, noise_threshold=10.0),
                  impls=impls, log=lambda s: None).run().rows
    ran = [r for r in rows if r["impl"] != "engine"]
    assert len(ran) == 2 * 2 * 2 + 3 * 2
    for r in ran:
        assert r["status"] == "ok" and r["rel_err"] < 1e-5, r
        heads, dv = (3, 8) if r["variant"] == "mamba2" else (2, 16)
        assert r["causal"] and r["flops"] == metrics.linear_flops(2, heads, 40, 16, dv, r["mode"])
        if r["impl"] == "fla":
            assert r["speedup"] == 1.0
    mamba = [r for r in ran if r["variant"] == "mamba2"]
    assert {(r["heads_q"], r["heads_kv"], r["head_dim"], r["head_dim_v"]) for r in mamba} == {
        (1, 1, 16, 8)}
    engine = [r for r in rows if r["impl"] == "engine"]
    assert {r["status"] for r in engine} == {"skipped"}
    assert {r["reason"] for r in engine} == {"needs a Hopper GPU"}


def test_a_wrong_decay_gradient_fails_the_row(tmp_path):
    # the output and q, k, v's gradients are right; only the decay's is 1.5x: the row must fail
    def wrong_dg(q, k, v, g=None, **kw):
        return naive_simple_gla(q, k, v, g=g + 0.5 * (g - g.detach()), **kw)

    data = {"kind": "linear", "impls": ["fla"], "baseline": "fla", "modes": ["fwd", "fwd+bwd"],
            "dtypes": ["float32"], "repeats": 1, "warmup": 0,
            "cases": [{"variants": ["simple_gla"], "shapes": ["tiny"], "seqlens": [40],
                       "batch": 2}]}
    impls = {"fla": cpu(FlaImpl(op=lambda: wrong_dg, backward_context=contextlib.nullcontext))}
    rows = Runner(parse_suite(data, name="lin", shapes=TINY),
                  RunOptions(device="cpu", out_dir=tmp_path, noise_threshold=10.0),
                  impls=impls, log=lambda s: None).run().rows
    status = {r["mode"]: (r["status"], r["reason"]) for r in rows}
    assert status["fwd"] == ("ok", "")
    assert status["fwd+bwd"][0] == "failed" and "rel_err" in status["fwd+bwd"][1]


# ---------------------------------------------------------------- continuations (the step)
def naive_recurrent_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                        output_final_state=False, **_):
    """fla's fused_recurrent_simple_gla semantics ([B, T, H, D]; S_t = exp(g_t) S + k_t v_t^T,
    o_t = scale * q_t S_t), step by step in float64, from `initial_state` [B, H, K, V]."""
    B, T, H, K = q.shape
    if g is None:
        g = g_gamma.view(1, 1, H).expand(B, T, H)
    S = initial_state.double().clone()
    outs = []
    for t in range(T):
        S = g[:, t].double().exp()[..., None, None] * S + torch.einsum(
            "bhk,bhv->bhkv", k[:, t].double(), v[:, t].double())
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].double() * scale, S))
    return torch.stack(outs, 1).to(q.dtype), (S.float() if output_final_state else None)


def test_linear_step_suite_expands_to_continuations():
    suite = load_suite("linear-step")
    assert len(suite.cases) == 6
    for c in suite.cases:
        assert linear.is_continuation(c) and c.modes == ("fwd",) and c.baseline == "fla"
        assert c.seqlen_kv == 256 and c.seqlen_q in (1, 4)
    issue = [c for c in suite.cases if c.shape == "linear-h32-d128"]
    assert {(c.batch, c.heads, c.head_dim, c.head_dim_v) for c in issue} == {(64, 32, 128, 128)}


@pytest.mark.parametrize("over, msg", [
    ({"seqlen_q": [8], "seqlen_kv": [4]}, r"seqlen_q \(8, the call's positions\) must be <="),
    ({"seqlen_q": [1], "seqlen_kv": [64], "modes": ["fwd", "fwd+bwd"]},
     r"continuations \(seqlen_q 1 < seqlen_kv 64\) time the forward only"),
])
def test_linear_continuations_are_checked(over, msg):
    block = {"variants": ["simple_gla"], "shapes": ["fla-h16-d128"], **over}
    data = {"kind": "linear", "impls": ["fla"], "modes": ["fwd"], "dtypes": ["bf16"],
            "cases": [block]}
    with pytest.raises(SuiteError, match=msg):
        parse_suite(data, name="t")


def test_step_bytes_count_the_state_twice_and_the_new_positions():
    c = case(seqlen_q=2, seqlen_kv=40, dtype="bfloat16")
    state = 2 * 2 * 3 * 16 * 8 * 4
    qkvo = 2 * 2 * (3 * 16 + 3 * 16 + 2 * 3 * 8) * 2
    assert metrics.linear_step_bytes(c) == state + qkvo + 2 * 2 * 3 * 4
    assert metrics.linear_flops(2, 3, 2, 16, 8, "fwd", recurrent=True) == 2 * 2 * 3 * 2 * 2 * 16 * 8


def test_runner_checks_continuations_against_the_whole_sequences(tmp_path):
    data = {"kind": "linear", "impls": ["reference", "fla", "engine"], "baseline": "fla",
            "modes": ["fwd"], "dtypes": ["float32"], "repeats": 2, "warmup": 0,
            "seqlen_q": [1, 3], "seqlen_kv": [70],
            "cases": [{"variants": ["simple_gla", "retnet_linear"], "shapes": ["tiny"],
                       "batch": 2},
                      {"variants": ["mamba2"], "shapes": ["tiny-ssd"], "batch": 2,
                       "impls": ["reference", "fla", "mamba_ssm"]}]}
    suite = parse_suite(data, name="step", shapes=TINY)
    impls = {**registry(), "mamba_ssm": cpu(MambaSsmImpl(op=lambda: naive_ssd)),
             "fla": cpu(FlaImpl(op=lambda: naive_simple_gla, recurrent_op=lambda:
                                naive_recurrent_gla, backward_context=contextlib.nullcontext))}
    rows = Runner(suite, RunOptions(device="cpu", out_dir=tmp_path, noise_threshold=10.0),
                  impls=impls, log=lambda s: None).run().rows
    ran = [r for r in rows if r["impl"] in ("reference", "fla")]
    assert len(ran) == 3 * 2 * 2
    for r in ran:
        assert r["status"] == "ok" and r["rel_err"] < 1e-5, r
        heads, dv = (3, 8) if r["variant"] == "mamba2" else (2, 16)
        c = next(c for c in suite.cases if c.name == r["case"])
        assert r["bytes"] == metrics.linear_step_bytes(c) and r["tbps"] > 0
        assert r["flops"] == metrics.linear_flops(2, heads, c.seqlen_q, 16, dv, "fwd",
                                                  recurrent=True)
    mamba = {r["status"] for r in rows if r["impl"] == "mamba_ssm"}
    assert mamba == {"skipped"}


def test_a_wrong_state_fails_the_continuation(tmp_path):
    data = {"kind": "linear", "impls": ["fla"], "modes": ["fwd"], "dtypes": ["float32"],
            "repeats": 1, "warmup": 0, "seqlen_q": [2], "seqlen_kv": [50],
            "cases": [{"variants": ["simple_gla"], "shapes": ["tiny"], "batch": 1}]}
    suite = parse_suite(data, name="step", shapes=TINY)

    def from_zero(*args, initial_state=None, **kw):  # ignores the state it is given
        return naive_recurrent_gla(*args, initial_state=torch.zeros_like(initial_state), **kw)

    fla = cpu(FlaImpl(op=lambda: naive_simple_gla, recurrent_op=lambda: from_zero))
    rows = Runner(suite, RunOptions(device="cpu", out_dir=tmp_path), impls={"fla": fla},
                  log=lambda s: None).run().rows
    assert [r["status"] for r in rows] == ["failed"] and "rel_err" in rows[0]["reason"]


# ---------------------------------------------------------------- scripts/linear_breakdown.py
def _breakdown_module():
    from tests.script_module import load_script

    return load_script("linear_breakdown")


def test_breakdown_averages_each_kernel_by_its_place_in_a_call():
    from attnbench.kernel_profile import aggregate as agg

    # two calls of three kernels (a name twice in a call: two entries), out of order
    events = [("b", 11.0, 6.0), ("a", 0.0, 2.0), ("a", 2.0, 4.0), ("a", 10.0, 4.0),
              ("b", 1.0, 10.0), ("a", 12.0, 8.0)]
    got = agg(events, 2)
    assert got["kernels"] == {"0:a": 3.0, "1:b": 8.0, "2:a": 6.0}
    assert list(got["kernels"]) == ["0:a", "1:b", "2:a"] and got["kernels_us"] == 17.0
    with pytest.raises(ValueError, match="5 kernels do not split into 2 equal calls"):
        agg(events[:5], 2)


def test_breakdown_runs_each_impl_as_its_rows_do(monkeypatch):
    # the reference impl on a CPU, the profiler replaced: each mode's call runs (a gradient
    # call returns q, k, v's and the learnable inputs' gradients)
    mod = _breakdown_module()
    seen = []
    monkeypatch.setattr(mod, "TIMES", lambda fn: seen.append(fn()) or {"kernels_us": 1.0})
    c = case("mamba2", dtype="float32")
    got = mod.breakdown(c, ["reference"], device="cpu")
    assert got == {"reference": {"fwd": {"kernels_us": 1.0}, "fwd+bwd": {"kernels_us": 1.0}}}
    fwd, grads = seen
    assert fwd.shape == (c.batch, c.heads, c.seqlen_q, c.head_dim_v) and len(grads) == 5


def test_breakdown_runs_the_engine_at_a_named_config():
    # `engine@bwd=KEY`: the engine's module with that backward config beside its defaults;
    # an implementation without a module, or a malformed spec, is refused
    from attnbench.arms import parse_arm, set_configs
    from engine.kernels.linear_fwd.plan import LinearConfig

    narrow = LinearConfig(64, 64, 64, 2, 128)
    assert parse_arm("engine").configs == ()
    assert parse_arm("engine@bwd=C64_K64_V64_s2_t128").configs == (
        ("backward_config", narrow),)
    arm = parse_arm("engine@fwd=C64_K128_V64_s2_t256_1p@bwd=C64_K64_V64_s2_t128"
                    "@engine.kernels.linear_fwd.plan:CHUNK_LOOP_BLOCKS_PER_SM=2")
    assert arm.configs == (("config", LinearConfig(64, 128, 64, 2, 256, True)),
                           ("backward_config", narrow))
    assert arm.patches == (("engine.kernels.linear_fwd.plan", "CHUNK_LOOP_BLOCKS_PER_SM", 2),)
    for bad in ("engine@bwd", "engine@back=C64_K64_V64_s2_t128", "engine@bwd=C64"):
        with pytest.raises(ValueError, match="expected"):
            parse_arm(bad)
    c = case("mamba2", dtype="float32")
    variant = LINEAR_VARIANTS["mamba2"]
    inputs, _ = linear.make_linear_inputs(c, variant, "cpu", 0)
    p = get_impl("engine").prepare(c, variant, inputs, True)
    set_configs(p, (("backward_config", narrow),))
    assert p.extra["module"].backward_config == narrow and p.extra["module"].config is None
    with pytest.raises(ValueError, match="exposes NoneType"):
        set_configs(Prepared(forward=lambda: None), (("config", narrow),))


def test_saved_states_impl_builds_the_module_that_keeps_them():
    c = case("mamba2", dtype="float32")
    variant = LINEAR_VARIANTS["mamba2"]
    inputs, _ = linear.make_linear_inputs(c, variant, "cpu", 0)
    kept = get_impl("engine-saved-states").prepare(c, variant, inputs, True)
    assert kept.extra["module"].save_states is True
    assert get_impl("engine").prepare(c, variant, inputs, True).extra["module"].save_states is False
