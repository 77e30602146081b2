"""Table lookups (issue 19) in the generated kernels, on the GPU (pytest -m gpu): a learnable
relative-position table and T5-style buckets in score_mod, a per-position table read at
q_idx // 2 in mask_mod (tests/table_spec.py). The forward against the reference executor; the
kernel backward (q, k, v and both tables' gradients, added by fp32 atomics) against the
reference backend; fp16/bf16, GQA 1 and 4, D 64 and 128, a length that leaves a partial block."""

from __future__ import annotations

import pytest
import torch

from engine.reference.executor import rel_err
from tests import table_spec

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
        mod = table_spec.module(dt, B, HQ, hkv, S, d)
        srcs += mod.forward_kernel().sources()
        srcs += mod.backward_kernels(custom_grads=("rel", "t5")).sources()
    for err in precompile(srcs).values():
        print("precompile failed:", err[:300])


def _leaves(dt, hkv, d):
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    qkv = [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g).requires_grad_()
           for h in (HQ, hkv, hkv)]
    data = table_spec.inputs(B, HQ, S, "cuda", g)
    return [*qkv, data["rel"].requires_grad_(), data["t5"].requires_grad_(), data["seg"]]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    leaves = _leaves(dt, hkv, d)
    with torch.no_grad():
        out = table_spec.module(dt, B, HQ, hkv, S, d)(*leaves)
        ref = table_spec.module(dt, B, HQ, hkv, S, d, backend="reference")(*leaves)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_backward_matches_reference(case, monkeypatch):
    from engine.runtime import tilelang_backend

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    dt, hkv, d = case
    mod = table_spec.module(dt, B, HQ, hkv, S, d)
    assert mod.backward_problem(("rel", "t5")) is None
    leaves = _leaves(dt, hkv, d)
    ref_leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    o = mod(*leaves)
    do = torch.randn_like(o)
    wrt = leaves[:5]
    got = torch.autograd.grad(o, wrt, do)
    ref_mod = table_spec.module(dt, B, HQ, hkv, S, d, backend="reference")
    want = torch.autograd.grad(ref_mod(*ref_leaves), ref_leaves[:5], do)
    for what, a, w in zip(("dq", "dk", "dv", "drel", "dt5"), got, want, strict=True):
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"
