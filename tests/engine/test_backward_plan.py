"""The backward's plan: every decision taken once by plan_backward, from the spec, the shape and
the config, and frozen (the generator and the launcher only read it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kernels.attention_bwd.plan import default_backward_config, plan_backward
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.variants import VARIANTS

LLAMA3 = dict(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096)
SMALL = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000)


def _plan(name: str, sizes=SMALL, cfg: KernelConfig | None = None, grads=(), det=False, **kw):
    mod = VARIANTS[name].build(**sizes, head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                               backend="tilelang")
    cfg = cfg or default_backward_config(128, 128)
    return plan_backward(mod.spec, KernelShape.of(mod), cfg, grads, det, **kw)


def test_fast_plan_at_llama3_heads():
    plan = _plan("softmax_causal", LLAMA3)
    assert plan.warp_specialized and plan.heads_loop and plan.split and plan.dq_async
    assert (plan.panel, plan.kv_store, plan.dq_layout) == (4, "once", "fragment")
    assert plan.preprocess and plan.dq_config is None and plan.custom_reads == ()


def test_deterministic_plan_has_no_dq_and_stores_per_query_head():
    plan = _plan("softmax", det=True)
    assert not plan.warp_specialized and not plan.heads_loop and plan.panel == 1
    assert (plan.kv_store, plan.dq_layout, plan.dq_async) == ("per_query_head", "none", False)
    assert plan.dq_config is not None


def test_step_and_reads_follow_the_spec():
    assert not _plan("softcap").split, "dS reads the raw score beside two row vectors: fused"
    doc = _plan("document")
    assert sorted(h.axis for h in doc.hoisted) == ["kv", "q"] and not doc.split
    alibi = _plan("alibi", LLAMA3, grads=("alibi_slopes",))
    assert alibi.custom_reads == (("alibi_slopes", ("h",)),) and not alibi.heads_loop
    auto = _plan("softmax", cfg=KernelConfig(32, 128, 2, 256))  # no whole 64-row dQ wgmma
    assert (auto.warp_specialized, auto.dq_layout, auto.dq_async, auto.kv_store) == (
        False, "rows", False, "atomic")


def test_forced_decisions_are_checked_and_the_plan_is_frozen():
    with pytest.raises(ValueError, match="warp_specialized"):
        _plan("softmax", det=True, warp_specialized=True)
    with pytest.raises(ValueError, match="heads_loop"):
        _plan("softmax", warp_specialized=False, heads_loop=True)
    with pytest.raises(NotImplementedError, match="not read in score_mod"):
        _plan("softmax", grads=("nope",))
    plan = _plan("softmax")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.split = False


def test_custom_gradients_that_alone_read_the_score_take_32_row_steps():
    """The default backward tile per learnable variant: 32 query rows a step where only the
    custom gradient reads the raw score (RetNet's log decay, the key gate), the usual 64 where
    dS reads it anyway (sigmoid) or no gradient reads it (ALiBi, the bias tables); 64 for
    every variant without custom gradients."""
    narrow = {"retnet", "key_gate"}
    learnable = {n: v.learnable for n, v in VARIANTS.items() if v.learnable}
    assert narrow < set(learnable) and {"alibi", "sigmoid"} < set(learnable)
    for name, grads in learnable.items():
        mod = VARIANTS[name].build(**SMALL, head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                   backend="tilelang")
        rows = default_backward_config(128, 128, spec=mod.spec, custom_grads=tuple(grads)).block_M
        assert rows == (32 if name in narrow else 64), name
        assert default_backward_config(128, 128, spec=mod.spec).block_M == 64, name


def test_tuned_backward_entry_gives_way_to_narrow_custom_gradient_steps(monkeypatch):
    """The tuner times the backward without custom gradients: its 64-row entry serves q, k, v
    alone, but RetNet's decay gradient keeps the 32-row default; a config the user passes wins
    over both."""
    from engine.plan.config import KernelConfig
    from engine.runtime import kernel_cache

    tuned = KernelConfig(64, 128, 2, 256)
    monkeypatch.setattr(kernel_cache, "tuned_config", lambda req, kind: tuned)
    mod = VARIANTS["retnet"].build(**SMALL, head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                   backend="tilelang")
    req = mod.kernel_request()
    assert kernel_cache.backward_config(req) == tuned
    assert kernel_cache.backward_config(req, custom_grads=("log_decay",)).block_M == 32
    mine = KernelConfig(64, 128, 1, 256)
    assert kernel_cache.backward_config(req, mine, custom_grads=("log_decay",)) == mine
