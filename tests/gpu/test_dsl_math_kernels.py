"""The DSL's math functions and integer arithmetic (issue 19) in the generated kernels, on the
GPU (pytest -m gpu): the forward against the reference executor and the kernel backward against
the reference backend's gradients, fp16/bf16, GQA 1 and 4, D 64 and 128, a length that leaves a
partial block."""

from __future__ import annotations

import pytest
import torch

from engine.reference import executor
from tests import dsl_math_spec

from .cases import SPEC_B as B
from .cases import SPEC_CASES as CASES
from .cases import SPEC_HQ as HQ
from .cases import SPEC_S as S
from .cases import check_forward, check_gradients, precompile_selected, random_seed, spec_case_id

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    precompile_selected(request, lambda c: dsl_math_spec.module(
        c[0], B, HQ, c[1], S, c[2]).kernel_sources(("fwd", "bwd")))


def _inputs(dt, hkv, d):
    g = torch.Generator(device="cuda").manual_seed(random_seed())
    return [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g).requires_grad_()
            for h in (HQ, hkv, hkv)]


@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    mod = dsl_math_spec.module(dt, B, HQ, hkv, S, d)
    q, k, v = _inputs(dt, hkv, d)
    with torch.no_grad():
        out = mod(q, k, v)
    ref, _ = executor.forward(mod.spec, q.detach(), k.detach(), v.detach(), {})
    check_forward(out, ref)


@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_kernel_backward_matches_reference(case, monkeypatch):
    dt, hkv, d = case
    check_gradients(monkeypatch, dsl_math_spec.module(dt, B, HQ, hkv, S, d),
                    dsl_math_spec.module(dt, B, HQ, hkv, S, d, backend="reference"),
                    _inputs(dt, hkv, d), 3, ("dq", "dk", "dv"))
