"""q/k/v mods (issue 19, seed 001) in front of the generated kernels, on the GPU (pytest -m
gpu): the TileLang backend's forward and kernel backward against the reference backend, with
the gradients of q, k, v, of the CustomIO tensors only the mods read (a per-head query scale
and key gate) and of one read by both score_mod and a mod (ALiBi slopes); fp16/bf16, GQA 1
and 4, D 64 and 128, a length that leaves a partial block."""

from __future__ import annotations

import pytest
import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor

from .cases import SPEC_B as B
from .cases import SPEC_CASES as CASES
from .cases import SPEC_HQ as HQ
from .cases import SPEC_S as S
from .cases import check_forward, check_gradients, precompile_selected, random_seed, spec_case_id

pytestmark = pytest.mark.gpu

IO = CustomIO({"q_scale": ("heads",), "gate": ("heads",), "slopes": ("heads",)})
CUSTOM_GRADS = ("slopes",)  # what the backward kernels produce: the mods' inputs go detached


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
    precompile_selected(request, lambda c: _module(*c).kernel_sources()
                        + _module(*c).backward_kernels(custom_grads=CUSTOM_GRADS).sources())


def _inputs(dt, hkv, d, seed) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g) for h in (HQ, hkv, hkv)]
    customs = [torch.rand(HQ, device="cuda", generator=g) + 0.5,
               torch.randn(HQ, device="cuda", generator=g),
               torch.rand(HQ, device="cuda", generator=g) * 0.1]
    return [t.requires_grad_() for t in (*qkv, *customs)]


@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    leaves = _inputs(dt, hkv, d, random_seed())
    with torch.no_grad():
        out = _module(dt, hkv, d)(*leaves)
        ref = _module(dt, hkv, d, backend="reference")(*leaves)
    check_forward(out, ref)


@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_kernel_backward_matches_reference(case, monkeypatch):
    dt, hkv, d = case
    mod, ref_mod = _module(dt, hkv, d), _module(dt, hkv, d, backend="reference")
    assert mod.backward_problem(CUSTOM_GRADS) is None, "the kernels, not the reference rules"
    leaves = _inputs(dt, hkv, d, random_seed())
    check_gradients(monkeypatch, mod, ref_mod, leaves, len(leaves),
                    ("dq", "dk", "dv", "d q_scale", "d gate", "d slopes"))
