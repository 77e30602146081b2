"""Gradients of custom inputs that scale the raw score per (batch, head) come from q . dQ
(exprs.RowDotGrad): which reads qualify, the plan that leaves them out of the kernels, and
the launcher's sums against the reference backward's gradients (CPU, float64)."""

from __future__ import annotations

import pytest
import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor
from engine.kernels.attention_bwd.exprs import row_dot_grads
from engine.kernels.attention_bwd.launch import row_dot_grads as launch_row_dot_grads
from engine.kernels.attention_bwd.plan import default_backward_config, plan_backward
from engine.plan.shape import KernelShape
from engine.reference import executor
from engine.variants import VARIANTS

B, HQ, HKV, S, D = 2, 4, 2, 48, 16

# (score_mod, custom inputs) whose gradients come from q . dQ
GATES = {
    "sigmoid gate [h]": (lambda s, c, b, h, q, k: s * D**-0.5 * c["g"].sigmoid(),
                         {"g": ("heads",)}),
    "temperature [b, h], twice": (lambda s, c, b, h, q, k: s * c["t"].exp() + s * c["t"].exp(),
                                  {"t": ("batch", "heads")}),
    "gate times a constant": (lambda s, c, b, h, q, k: 0.5 * (s * c["g"].sigmoid()) / 4.0,
                              {"g": ("heads",)}),
}


def _module(score_mod, customs):
    meta = (meta_tensor(B, HQ, S, D), meta_tensor(B, HKV, S, D), meta_tensor(B, HKV, S, D))
    return AttentionEngine(meta, CustomIO(customs), score_mod=score_mod,
                           mask_mod=lambda b, h, q, kv: q >= kv, online_func=OnlineSoftmax(),
                           backend="reference")


def _tensor(dims):
    return torch.randn(*({"heads": HQ, "batch": B}[d] for d in dims), dtype=torch.float64)


@pytest.mark.parametrize("name", GATES)
def test_gate_gradients_from_q_dot_dq_match_the_reference(name, monkeypatch):
    score_mod, decl = GATES[name]
    mod = _module(score_mod, decl)
    grads = tuple(decl)
    dots = row_dot_grads(mod.spec, grads)
    assert {g.name for g in dots} == set(grads)
    plan = plan_backward(mod.spec, KernelShape.for_problem(mod.problem, torch.bfloat16,
                                                           mod.spec.mask),
                         default_backward_config(D, D), grads)
    assert plan.custom_grads == () and plan.row_dot_grads == dots  # none in the kernels
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, HQ, D, dtype=torch.float64, generator=g)
    k, v = (torch.randn(B, S, HKV, D, dtype=torch.float64, generator=g) for _ in "kv")
    customs = {n: _tensor(dims) for n, dims in decl.items()}
    o, fin = executor.forward(mod.spec, q, k, v, customs, dtype=torch.float64)
    do = torch.randn_like(o)
    dq, _, _, want = executor.backward(mod.spec, q, k, v, customs, o, fin, do,
                                       dtype=torch.float64, custom_grads=grads)
    from engine.reference import evaluate

    def no_gather(*a, **k):  # on a GPU a 0-dim index waits for the backward's kernels
        raise AssertionError("a custom read gathered instead of viewing")

    monkeypatch.setattr(evaluate, "custom_index", no_gather)
    got = launch_row_dot_grads(dots, q, dq, customs)
    for n in grads:
        assert got[n].shape == customs[n].shape and got[n].dtype == customs[n].dtype
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("score_mod, decl", [
    # a gate that may be 0 leaves dQ 0 and its own gradient not
    (lambda s, c, b, h, q, k: s * c["g"], {"g": ("heads",)}),
    # not a factor of the score
    (lambda s, c, b, h, q, k: s * 0.25 + c["g"], {"g": ("heads",)}),
    (lambda s, c, b, h, q, k: (s + 1.0) * c["g"].sigmoid(), {"g": ("heads",)}),
    # per key, not per (batch, head)
    (lambda s, c, b, h, q, k: s * c["g"].sigmoid(), {"g": ("batch", "seq_len_kv")}),
    # the score read beside the gate in d score_mod / d score
    (lambda s, c, b, h, q, k: (s * c["g"].sigmoid()).tanh(), {"g": ("heads",)}),
], ids=["may-be-zero", "bias", "gate-of-score-plus-one", "per-key", "tanh"])
def test_other_reads_stay_in_the_kernels(score_mod, decl):
    assert row_dot_grads(_module(score_mod, decl).spec, tuple(decl)) == ()


def test_the_key_gate_backward_keeps_its_wide_steps():
    """The library's key gate: its gradient no longer needs the kernels' narrow steps."""
    mod = VARIANTS["key_gate"].build(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096,
                                     seqlen_kv=4096, head_dim=128, head_dim_v=128,
                                     dtype=torch.bfloat16)
    with_grad = mod.backward_kernels(custom_grads=("key_gate",))
    assert with_grad.sources() == mod.backward_kernels().sources()
    assert [g.name for g in with_grad.plan.row_dot_grads] == ["key_gate"]
