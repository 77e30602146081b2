import pytest

from attnbench.cases import Case
from attnbench.impls import IMPL_NAMES, DeviceInfo, get_impl, registry

CPU = DeviceInfo("cpu")
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))


def case(**over):
    c = dict(suite="t", name="c", variant="softmax", shape="s", batch=1, heads_q=4, heads_kv=4,
             seqlen_q=128, seqlen_kv=128, head_dim=64, head_dim_v=64, dtype="float32",
             kind="attention", modes=("fwd",), impls=("reference",), baseline="reference")
    c.update(over)
    return Case(**c)


def test_registry_names():
    assert tuple(registry()) == IMPL_NAMES
    for name in ("engine", "flash-attention-3", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient",
                 "sdpa-math", "flex", "reference", "fla"):
        assert get_impl(name).name == name
    with pytest.raises(ValueError, match="unknown implementation 'fa9'; known .*sdpa-math"):
        get_impl("fa9")


def test_cpu_only_runs_reference_and_sdpa_math():
    runnable = {n for n, i in registry().items() if i.caps.check(case(), CPU) is None}
    assert runnable == {"reference", "sdpa-math"}
    assert get_impl("engine").caps.check(case(), CPU) == "needs a Hopper GPU"
    assert get_impl("sdpa-flash").caps.check(case(), CPU) == "needs a CUDA GPU"


@pytest.mark.parametrize("impl, c, dev, msg", [
    ("sdpa-flash", case(dtype="float32"), H100, "dtype float32 not supported"),
    ("sdpa-math", case(variant="sigmoid"), CPU, "variant sigmoid not supported"),
    ("sdpa-cudnn", case(head_dim=512, head_dim_v=512, dtype="float16"), H100, "head dim 512"),
    ("engine", case(dtype="float16"), A100, "compute capability >= 9.0"),
    ("engine-dynamic", case(kind="decode", dtype="float16"), H100,
     "decode cases not supported"),
    ("fla", case(kind="linear", variant="linear_elu", heads=4, dtype="bfloat16"), H100,
     "variant linear_elu not supported"),
    ("fla", case(variant="simple_gla", dtype="bfloat16"), H100, "attention cases not supported"),
    ("reference", case(batch=8, heads_q=64, seqlen_q=16384, seqlen_kv=16384), CPU,
     "materialises"),
])
def test_capability_reasons(impl, c, dev, msg):
    reason = get_impl(impl).caps.check(c, dev)
    assert reason is not None and msg in reason


def test_supported_cases_pass():
    assert get_impl("sdpa-cudnn").caps.check(case(dtype="bfloat16", heads_kv=2), H100) is None
    assert get_impl("engine").caps.check(case(dtype="bfloat16", variant="alibi"), H100) is None
    c = case(kind="linear", variant="simple_gla", heads=4, dtype="bfloat16")
    assert get_impl("fla").caps.check(c, H100) is None


def test_engine_deterministic_times_only_the_backward():
    det = get_impl("engine-deterministic")
    assert "mode fwd not supported" in det.caps.check_mode("fwd")
    assert det.caps.check_mode("bwd") is None and det.caps.check_mode("fwd+bwd") is None
    assert det.caps.check(case(dtype="bfloat16"), H100) is None


def test_engine_impls_build_their_modules_settings():
    from engine.variants import get_variant

    c, softmax = case(dtype="bfloat16"), get_variant("softmax")
    assert get_impl("engine").build(c, softmax).deterministic is False
    assert get_impl("engine-deterministic").build(c, softmax).deterministic is True
    assert get_impl("engine-dynamic").build(c, softmax).dynamic_shapes is True


def test_fa3_capabilities_follow_installed_package(monkeypatch):
    from attnbench.impls import fa3

    monkeypatch.setattr(fa3, "_installed", lambda m: m == fa3.FWD_ONLY)
    caps = get_impl("flash-attention-3").caps
    assert caps.dtypes == {"bfloat16"} and caps.modes == {"fwd"}
    assert "mode bwd not supported" in caps.check_mode("bwd")
    monkeypatch.setattr(fa3, "_installed", lambda m: m == fa3.FULL)
    caps = get_impl("flash-attention-3").caps
    assert caps.dtypes == {"float16", "bfloat16"} and caps.check_mode("bwd") is None
    monkeypatch.setattr(fa3, "_installed", lambda m: False)
    impl = get_impl("flash-attention-3")
    assert "is installed" in impl.check(case(dtype="bfloat16"), None, H100)


def test_sdpa_math_prepare_matches_reference(variants):
    import torch

    from attnbench.impls.base import Unsupported

    v = variants["softmax_causal"]
    c = case(variant="softmax_causal", heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64,
             head_dim=32, head_dim_v=32)
    inputs = v.make_inputs(batch=1, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64,
                           head_dim=32, head_dim_v=32, dtype=torch.float32, device="cpu", seed=3)
    p = get_impl("sdpa-math").prepare(c, v, inputs, needs_grad=True)
    with p.context():
        out = p.to_common(p.forward())
    ref = v.torch_reference(inputs)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
    assert p.leaves[0].requires_grad and p.leaves[0].shape == (1, 4, 64, 32)
    with pytest.raises(Unsupported, match="no SDPA form"):
        get_impl("sdpa-math").prepare(case(variant="sigmoid"), variants["sigmoid"], inputs, False)


@pytest.mark.gpu
def test_every_impl_on_gpu_is_ok_or_skipped(variants, tmp_path):
    """On the H100: each implementation either measures accurately or skips with a reason."""
    from attnbench.runner import Runner, RunOptions
    from attnbench.suites import parse_suite

    suite = parse_suite(
        {"impls": list(IMPL_NAMES), "baseline": "sdpa-cudnn", "modes": ["fwd", "bwd"],
         "dtypes": ["bfloat16"], "repeats": 5, "warmup": 1,
         "cases": [{"variants": ["softmax_causal", "alibi"], "shapes": ["llama3-8b"],
                    "seqlens": [1024]}]},
        name="gpu-check", variant_names=list(variants))
    rows = Runner(suite, RunOptions(device="cuda", out_dir=tmp_path),
                  get_variant=variants.__getitem__).run().rows
    bad = [(r["case"], r["impl"], r["mode"], r["status"], r["reason"]) for r in rows
           if r["status"] not in ("ok", "skipped")]
    assert not bad, bad
    assert {r["impl"] for r in rows if r["status"] == "ok"} >= {"sdpa-cudnn", "flex", "reference"}


FLEX_FORMS = ["softmax", "softmax_causal", "alibi", "softcap", "sliding_window", "document",
              "prefix_lm"]


@pytest.mark.parametrize("name", FLEX_FORMS)
def test_engine_flex_runs_the_flex_functions_like_the_engine(variants, name):
    """engine-flex: the variant's FlexAttention functions through engine.flex_attention give
    the variant's output and gradients (here on the reference executor; on a Hopper GPU the same
    call runs the kernels)."""
    import torch

    v = variants[name]
    sz = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim=32,
              head_dim_v=32)
    c = case(variant=name, **sz)
    inputs = v.make_inputs(**sz, dtype=torch.float32, device="cpu", seed=5)
    impl = type(get_impl("engine-flex"))()
    impl.backend = "reference"  # fp32 on the CPU: no backward-kernel check
    p = impl.prepare(c, v, inputs, needs_grad=True)
    out = p.to_common(p.forward())
    assert out.shape == (2, 64, 4, 32)
    wrt = ["q", "k", "v", *v.learnable]  # a learnable input's gradient is computed (and timed)
    ref_inputs = {n: t.detach().clone().requires_grad_(n in wrt) for n, t in inputs.items()}
    ref = v.torch_reference(ref_inputs, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    got = torch.autograd.grad(out, p.leaves, do)
    want = torch.autograd.grad(ref, [ref_inputs[n] for n in wrt], do.double())
    for n, a, w in zip(wrt, got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"d{n}: {m}")


def test_engine_flex_needs_a_flex_form(variants):
    from attnbench.impls.base import Unsupported

    with pytest.raises(Unsupported, match="no FlexAttention form"):
        get_impl("engine-flex").prepare(case(variant="sigmoid"), variants["sigmoid"], {}, False)


def test_engine_compiled_has_no_bwd_mode():
    """engine-compiled replays a CUDA graph: a backward replayed on a kept graph (the bwd
    mode) is not offered."""
    impl = get_impl("engine-compiled")
    assert "bwd" not in impl.caps.modes and "fwd" in impl.caps.modes
