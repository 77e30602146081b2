"""The DSL's math functions and integer arithmetic (issue 19) in the generated kernels, on the
GPU (pytest -m gpu): the forward against the reference executor and the kernel backward against
the reference backend's gradients, fp16/bf16, GQA 1 and 4, D 64 and 128, a length that leaves a
partial block."""

from __future__ import annotations

import pytest
import torch

from engine.reference import executor
from engine.reference.executor import rel_err
from tests import dsl_math_spec

from .cases import BF16, FP16

pytestmark = pytest.mark.gpu

CASES = [(dt, hkv, d) for dt in (FP16, BF16) for hkv in (8, 2) for d in (64, 128)]
B, HQ, S = 2, 8, 1000


def _id(case) -> str:
    dt, hkv, d = case
    return f"{'fp16' if dt == FP16 else 'bf16'}-gqa{HQ // hkv}-d{d}"


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Compile the selected cases' kernels in parallel workers first (nvcc is the slow part)."""
    from engine.runtime.precompile import precompile

    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    srcs = []
    for dt, hkv, d in (c for c in CASES if c in selected):
        mod = dsl_math_spec.module(dt, B, HQ, hkv, S, d)
        srcs += mod.kernel_sources(("fwd", "bwd"))
    for err in precompile(srcs).values():
        print("precompile failed:", err[:300])


def _inputs(dt, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g).requires_grad_()
            for h in (HQ, hkv, hkv)]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    mod = dsl_math_spec.module(dt, B, HQ, hkv, S, d)
    q, k, v = _inputs(dt, hkv, d, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    with torch.no_grad():
        out = mod(q, k, v)
    ref, _ = executor.forward(mod.spec, q.detach(), k.detach(), v.detach(), {})
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_backward_matches_reference(case, monkeypatch):
    from engine.runtime import tilelang_backend

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    dt, hkv, d = case
    mod = dsl_math_spec.module(dt, B, HQ, hkv, S, d)
    ref_mod = dsl_math_spec.module(dt, B, HQ, hkv, S, d, backend="reference")
    leaves = _inputs(dt, hkv, d, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    o = mod(*leaves)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, leaves, do)
    want = torch.autograd.grad(ref_mod(*ref_leaves), ref_leaves, do)
    for what, a, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"
