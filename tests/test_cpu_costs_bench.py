"""pytest-benchmark of the CPU-side costs a user feels: tracing a spec, generating the kernel
source, a compile-cache hit, loading a tune file. `tox -e bench` compares with the baseline
saved under results/benchmarks (`tox -e bench-save` records a new one)."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.ir.trace import trace_spec
from engine.plan.config import KernelConfig
from engine.tuning import tune_file
from engine.variants import get_variant

SHAPE = dict(batch=1, heads_q=8, heads_kv=2, seqlen_q=512, seqlen_kv=512, head_dim=128, head_dim_v=128)


def test_trace_spec(benchmark):
    parts = get_variant("alibi").spec_parts(**SHAPE)
    spec = benchmark(trace_spec, parts.score_mod, parts.mask_mod, parts.online_func, parts.custom_fwd_inputs)
    assert spec.hash


def test_generate_forward_source(benchmark):
    v = get_variant("softcap")

    def gen():
        mod = v.build(**SHAPE, dtype=torch.bfloat16, backend="tilelang")
        return mod.kernel_source

    src = benchmark(gen)
    assert "T.wgmma_gemm" in src  # soft-cap takes the warp-specialised schedule


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_compile_cache_hit(benchmark):
    from engine.runtime.compile import compile_source

    mod = get_variant("softmax").build(**SHAPE, dtype=torch.float16, backend="tilelang")
    src = mod.kernel_source
    compile_source(src)  # the miss, not timed
    kernel = benchmark(compile_source, src)
    assert kernel is compile_source(src)


def test_load_tune_file(benchmark, tmp_path):
    path = tmp_path / "attention_fwd.json"
    shape = {k: SHAPE[k] for k in SHAPE}
    for s in (1024, 2048, 4096, 8192):
        tune_file.store(
            path,
            dict(
                template="attention_fwd",
                spec_hash="abc",
                dtype="bf16",
                mode="fwd",
                gpu="NVIDIA H100",
                shape={**shape, "seqlen_q": s, "seqlen_kv": s},
                config=KernelConfig().to_dict(),
                latency_ms=1.0,
                tflops=500.0,
                date="2026-11-22",
            ),
        )
    hit = benchmark(
        tune_file.lookup,
        path,
        template="attention_fwd",
        spec_hash="abc",
        dtype="bf16",
        mode="fwd",
        gpu="NVIDIA H100",
        shape={**shape, "seqlen_q": 3000, "seqlen_kv": 3000},
    )
    assert hit is not None


def _stub_kernels(monkeypatch, module_class) -> None:
    """Every kernel launch a no-op and `module_class` on the TileLang path with CPU tensors."""
    from engine.runtime import kernel

    monkeypatch.setattr(kernel.Kernel, "compiled", lambda self: (lambda *args: None))
    monkeypatch.setattr(module_class, "resolved_backend", lambda self, device: "tilelang")


@pytest.fixture
def stubbed_module(monkeypatch):
    """A module that takes the TileLang path with every kernel launch a no-op (CPU tensors):
    what is timed is the engine's own host work per call (checks, kernel and table lookups,
    argument binding, output allocation, autograd), not TileLang's launch or the GPU."""
    from engine import api

    _stub_kernels(monkeypatch, api.AttentionEngine)
    shape = dict(SHAPE, batch=1, seqlen_q=128, seqlen_kv=128, head_dim=64, head_dim_v=64)
    mod = get_variant("softmax_causal").build(**shape, dtype=torch.bfloat16, backend="auto")
    qkv = [torch.randn(1, 128, h, 64, dtype=torch.bfloat16, requires_grad=True)
           for h in (shape["heads_q"], shape["heads_kv"], shape["heads_kv"])]
    return mod, qkv, torch.randn(1, 128, shape["heads_q"], 64, dtype=torch.bfloat16)


def test_module_forward_host_path(benchmark, stubbed_module):
    mod, qkv, _ = stubbed_module

    def call():
        with torch.no_grad():
            return mod(*qkv)

    assert benchmark(call).shape == (1, 128, 8, 64)


def test_module_forward_backward_host_path(benchmark, stubbed_module):
    mod, qkv, do = stubbed_module

    def step():
        mod(*qkv).backward(do)

    benchmark(step)
    assert qkv[0].grad is not None


def test_linear_module_forward_host_path(benchmark, monkeypatch):
    """LinearAttentionEngine's own host work per inference call (kernels stubbed, CPU tensors)
    for Mamba2: its decay mod (decay * A) evaluated, dt taken as the folded value weights,
    the config picked, the decay and single-pass kernels bound."""
    from engine import linear_api
    from engine.variants.linear import LINEAR_VARIANTS

    _stub_kernels(monkeypatch, linear_api.LinearAttentionEngine)
    sizes = dict(batch=1, heads_q=1, heads_k=1, heads=8, seqlen=128, head_dim=64, head_dim_v=64)
    variant = LINEAR_VARIANTS["mamba2"]
    mod = variant.build(sizes, torch.bfloat16, backend="tilelang")
    args = list(variant.make_inputs(sizes, torch.bfloat16, "cpu", seed=0).values())

    def call():
        with torch.no_grad():
            return mod(*args)

    assert benchmark(call).shape == (1, 8, 128, 64)


def test_linear_step_host_path(benchmark, monkeypatch):
    """A linear generation step's own host work (simple GLA, one new position from a state,
    kernels stubbed): checks, the step kernel's lookup (no config pick or tune-file lookup),
    the outputs, the launch."""
    from engine import linear_api
    from engine.variants.linear import LINEAR_VARIANTS

    _stub_kernels(monkeypatch, linear_api.LinearAttentionEngine)
    sizes = dict(batch=1, heads_q=8, heads_k=8, heads=8, seqlen=1, head_dim=64, head_dim_v=64)
    variant = LINEAR_VARIANTS["simple_gla"]
    mod = variant.build(sizes, torch.bfloat16, backend="tilelang")
    args = list(variant.make_inputs(sizes, torch.bfloat16, "cpu", seed=0).values())
    h0 = torch.randn(1, 8, 64, 64)

    def call():
        with torch.no_grad():
            return mod(*args, initial_state=h0, output_final_state=True)

    o, ht = benchmark(call)
    assert o.shape == (1, 8, 1, 64) and ht.shape == (1, 8, 64, 64)


def test_module_decode_host_path(benchmark, monkeypatch):
    """A decode step's own host work (kernels stubbed, CPU tensors, value check off as in a
    serving loop): argument checks, the kernel lookup, the output, the launch."""
    from engine import api

    _stub_kernels(monkeypatch, api.AttentionEngine)
    monkeypatch.setattr(api, "gpu_sm_count", lambda device: 132)
    sizes = dict(batch=1, heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=1024, head_dim=128,
                 head_dim_v=128)
    mod = get_variant("softmax").build(**sizes, dtype=torch.bfloat16, backend="auto")
    mod.check_cache_values = False
    inp = get_variant("softmax").make_inputs(**sizes, dtype=torch.bfloat16, device="cpu")
    lens = torch.full((1,), 1024, dtype=torch.int32)

    def step():
        with torch.no_grad():
            return mod(inp["q"], inp["k"], inp["v"], cache_seqlens=lens)

    assert benchmark(step).shape == (1, 1, 32, 128)
