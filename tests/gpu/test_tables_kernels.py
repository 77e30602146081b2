"""Table lookups (issue 19) in the generated kernels, on the GPU (pytest -m gpu): a learnable
relative-position table and T5-style buckets in score_mod, a per-position table read at
q_idx // 2 in mask_mod (tests/table_spec.py). The forward against the reference executor; the
kernel backward (q, k, v and both tables' gradients) against the reference backend, the tables'
gradients both ways the kernels add them: summed along dS^T's diagonals (both tables read
q - kv alone), and element by element (the relative table's by global fp32 atomics, T5's in a
shared row first); fp16/bf16, GQA 1 and 4, D 64 and 128, a length that leaves a partial
block."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests import table_spec

from .cases import SPEC_B as B
from .cases import SPEC_CASES as CASES
from .cases import SPEC_HQ as HQ
from .cases import SPEC_S as S
from .cases import check_forward, check_gradients, precompile_selected, random_seed, spec_case_id

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def _per_element(on: bool):
    """The plan without diagonal sums (each table's gradient added element by element)."""
    from engine.kernels.attention_bwd import plan

    with pytest.MonkeyPatch.context() as mp:
        if on:
            mp.setattr(plan, "diagonal_tables", lambda ex, cfg, det: ())
        yield


def _sources(case) -> list[str]:
    srcs = table_spec.module(case[0], B, HQ, case[1], S, case[2]).forward_kernel().sources()
    for per_element in (False, True):
        with _per_element(per_element):
            mod = table_spec.module(case[0], B, HQ, case[1], S, case[2])
            srcs += mod.backward_kernels(custom_grads=("rel", "t5")).sources()
    return srcs


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    precompile_selected(request, _sources)


def _leaves(dt, hkv, d):
    g = torch.Generator(device="cuda").manual_seed(random_seed())
    qkv = [torch.randn(B, S, h, d, device="cuda", dtype=dt, generator=g).requires_grad_()
           for h in (HQ, hkv, hkv)]
    data = table_spec.inputs(B, HQ, S, "cuda", g)
    return [*qkv, data["rel"].requires_grad_(), data["t5"].requires_grad_(), data["seg"]]


@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_forward_matches_reference(case):
    dt, hkv, d = case
    leaves = _leaves(dt, hkv, d)
    with torch.no_grad():
        out = table_spec.module(dt, B, HQ, hkv, S, d)(*leaves)
        ref = table_spec.module(dt, B, HQ, hkv, S, d, backend="reference")(*leaves)
    check_forward(out, ref)


@pytest.mark.parametrize("per_element", [False, True], ids=["diagonals", "per-element"])
@pytest.mark.parametrize("case", CASES, ids=spec_case_id)
def test_kernel_backward_matches_reference(case, per_element, monkeypatch):
    dt, hkv, d = case
    with _per_element(per_element):
        mod = table_spec.module(dt, B, HQ, hkv, S, d)
        plan = mod.backward_kernels(custom_grads=("rel", "t5")).plan
        assert plan.diagonal_tables == (() if per_element else (0, 1))
        assert mod.backward_problem(("rel", "t5")) is None
        check_gradients(monkeypatch, mod,
                        table_spec.module(dt, B, HQ, hkv, S, d, backend="reference"),
                        _leaves(dt, hkv, d), 5, ("dq", "dk", "dv", "drel", "dt5"))
