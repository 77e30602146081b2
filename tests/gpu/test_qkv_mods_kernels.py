"""q/k/v mods (issue 19, seed 001) in front of the generated kernels, on the GPU (pytest -m
gpu): the TileLang backend's forward and kernel backward against the reference backend, with
the gradients of q, k, v, of the CustomIO tensors only the mods read (a per-head query scale
and key gate) and of one read by both score_mod and a mod (ALiBi slopes); fp16/bf16, GQA 1
and 4, D 64 and 128, a length that leaves a partial block."""

from __future__ import annotations

import pytest
import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor
from engine.reference.executor import rel_err

from .cases import BF16, FP16

pytestmark = pytest.mark.gpu

CASES = [(dt, hkv, d) for dt in (FP16, BF16) for hkv in (8, 2) for d in (64, 128)]
B, HQ, S = 2, 8, 1000
IO = CustomIO({"q_scale": ("heads",), "gate": ("heads",), "slopes": ("heads",)})
CUSTOM_GRADS = ("slopes",)  # what the backward kernels produce: the mods' inputs go detached


def _id(case) -> str:
    dt, hkv, d = case
    return f"{'fp16' if dt == FP16 else 'bf16'}-gqa{HQ // hkv}-d{d}"


def _module(dt, hkv, d, backend="auto") -> AttentionEngine:
    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * d**-0.5 + custom_fwd_inputs["slopes"] * (kv_idx - q_idx)

    def query_mod(x, custom_fwd_inputs, b, h, pos):
        return x * custom_fwd_inputs["q_scale"] * (1 + custom_fwd_inputs["slopes"])

    def key_mod(x, custom_fwd_inputs, b, h, pos):
        return x * custom_fwd_inputs["gate"].sigmoid()  # h: the kv head

    meta = (meta_tensor(B, HQ, S, d, dtype=dt), meta_tensor(B, hkv, S, d, dtype=dt),
            meta_tensor(B, hkv, S, d, dtype=dt))
    return AttentionEngine(meta, IO, score_mod=score_mod, mask_mod=lambda b, h, q, kv: q >= kv,
                           online_func=OnlineSoftmax(), backend=backend, query_mod=query_mod,
                           key_mod=key_mod, value_mod=lambda v: v.tanh() * 2)


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Compile the selected cases' kernels in parallel workers first (nvcc is the slow part)."""
    from engine.runtime.precompile import precompile

    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    srcs = []
    for dt, hkv, d in (c for c in CASES if c in selected):
        mod = _module(dt, hkv, d)
        srcs += mod.kernel_sources() + mod.backward_kernels(custom_grads=CUSTOM_GRADS).sources()
    for err in precompile(srcs).values():
        print("precompile failed:", err[:300])


def _inputs(dt, hkv, d, seed) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g) for h in (HQ, hkv, hkv)]
    customs = [torch.rand(HQ, device="cuda", generator=g) + 0.5,
               torch.randn(HQ, device="cuda", generator=g),
               torch.rand(HQ, device="cuda", generator=g) * 0.1]
    return [t.requires_grad_() for t in (*qkv, *customs)]


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    leaves = _inputs(dt, hkv, d, _seed())
    with torch.no_grad():
        out = _module(dt, hkv, d)(*leaves)
        ref = _module(dt, hkv, d, backend="reference")(*leaves)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2, f"rel err {rel_err(out, ref):.3e}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_backward_matches_reference(case, monkeypatch):
    from engine.runtime import tilelang_backend

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    dt, hkv, d = case
    mod, ref_mod = _module(dt, hkv, d), _module(dt, hkv, d, backend="reference")
    assert mod.backward_problem(CUSTOM_GRADS) is None, "the kernels, not the reference rules"
    leaves = _inputs(dt, hkv, d, _seed())
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    o = mod(*leaves)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, leaves, do)
    want = torch.autograd.grad(ref_mod(*ref_leaves), ref_leaves, do)
    names = ("dq", "dk", "dv", "d q_scale", "d gate", "d slopes")
    for what, a, w in zip(names, got, want, strict=True):
        assert not torch.isnan(a).any(), f"{what} has NaN"
        assert rel_err(a, w) < 2e-2, f"{what}: relative error {rel_err(a, w):.3e}"
