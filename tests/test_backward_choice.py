"""Which backward a TileLang module runs: the generated kernels when they are on and the spec
allows them, otherwise the reference rules, for a reason that is stated (CPU: no launch)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime import tilelang_backend
from engine.variants import VARIANTS


def _mod(name="softmax", D=128, Dv=128, **kw):
    return VARIANTS[name].build(batch=1, heads_q=4, heads_kv=2, seqlen_q=512, seqlen_kv=512,
                                head_dim=D, head_dim_v=Dv, dtype=torch.bfloat16,
                                backend="reference", **kw)


def test_off_by_default_until_verified(monkeypatch):
    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", False)
    assert "ATTNBENCH_KERNEL_BACKWARD=0" in _mod().backward_problem()


@pytest.mark.parametrize("name", ["softmax", "softmax_causal", "alibi", "sigmoid", "retnet"])
def test_kernels_when_on(name, monkeypatch):
    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    assert _mod(name).backward_problem() is None


def test_reasons_for_the_reference_rules(monkeypatch):
    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    mod = _mod()
    mod.deterministic = True
    assert mod.backward_problem() is None  # the atomic-free kernels
    assert _mod("alibi").backward_problem(("alibi_slopes",)) is None  # slopes' grad in the kernel
    # D = 256: the head-split schedule (custom gradients included), not at Dv = 512
    assert _mod(D=256, Dv=256).backward_problem() is None
    assert _mod("alibi", D=256, Dv=256).backward_problem(("alibi_slopes",)) is None
    assert "registers" in _mod(D=256, Dv=512).backward_problem()


def test_engine_impl_declares_backward_modes_only_with_kernels(monkeypatch):
    from attnbench.impls.engine import EngineImpl

    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", False)
    assert EngineImpl().caps.modes == {"fwd"}
    monkeypatch.setattr(tilelang_backend, "KERNEL_BACKWARD", True)
    assert EngineImpl().caps.modes == {"fwd", "bwd", "fwd+bwd"}
