"""The backward's plan: every decision taken once by plan_backward, from the spec, the shape and
the config, and frozen (the generator and the launcher only read it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import where
from engine.kernels.attention_bwd.plan import default_backward_config, head_split, plan_backward
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape
from engine.variants import VARIANTS

LLAMA3 = dict(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096)
SMALL = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000)


def _plan(name: str, sizes=SMALL, cfg: KernelConfig | None = None, grads=(), det=False,
          d: int = 128, **kw):
    mod = VARIANTS[name].build(**sizes, head_dim=d, head_dim_v=d, dtype=torch.bfloat16,
                               backend="tilelang")
    cfg = cfg or default_backward_config(d, d)
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


def test_head_split_past_d128_takes_dq_from_the_dq_kernel():
    """At D 256 the head-split schedule's 64-key steps would add 64 x 256 fp32 of dQ per step
    by atomics: dQ comes from the dQ kernel (its 128 x 32 two-stage config), and dK/dV stay
    atomics over the GQA group in fast mode. With no dQ to hand over, the main kernel is
    warp-specialised in both modes. At D 128 the head split keeps its atomics and TileLang's
    automatic pipeline."""
    fast = _plan("softmax_causal", d=256)
    assert fast.head_split and not fast.deterministic and fast.warp_specialized
    assert fast.products_ahead and not _plan("softmax_causal", LLAMA3).products_ahead
    assert (fast.dq_layout, fast.kv_store) == ("none", "atomic")
    assert fast.dq_config == KernelConfig(128, 32, 2, 256)
    mha = _plan("softmax", dict(SMALL, heads_kv=8), d=256)
    assert (mha.dq_layout, mha.kv_store) == ("none", "once")
    assert _plan("softmax_causal", d=256, det=True).warp_specialized
    # Past D 128 the default is the head split (DeepSeek's 192 / 128 too), not at Dv alone.
    assert head_split(default_backward_config(192, 128))
    assert not head_split(default_backward_config(128, 256))
    d128 = _plan("softmax", cfg=KernelConfig(64, 64, 2, 256, "FullCol"))
    assert d128.head_split and (d128.dq_layout, d128.dq_config) == ("rows", None)
    assert not d128.warp_specialized
    with pytest.raises(ValueError, match="head-split schedule's takes dQ from the dQ kernel"):
        _plan("softmax", cfg=KernelConfig(64, 64, 2, 256, "FullCol"), warp_specialized=True)


def test_step_and_reads_follow_the_spec():
    assert not _plan("softcap").split, "dS reads the raw score beside two row vectors: fused"
    doc = _plan("document")
    assert sorted(h.axis for h in doc.hoisted) == ["kv", "q"] and not doc.split
    alibi = _plan("alibi", LLAMA3, grads=("alibi_slopes",))
    assert alibi.custom_reads == (("alibi_slopes", ("h",)),) and not alibi.heads_loop
    auto = _plan("softmax", cfg=KernelConfig(32, 128, 2, 256))  # no whole 64-row dQ wgmma
    assert (auto.warp_specialized, auto.dq_layout, auto.dq_async, auto.kv_store) == (
        False, "rows", False, "atomic")


def test_d64_takes_128_row_steps_with_the_finals_and_delta_in_the_ring():
    """At D 64 the default step is 128 query rows where the warp-specialised schedule's ring
    holds the finals and Delta (read there where used: in registers they spill), fused; not
    in the deterministic mode (no ring: the automatic pipeline), not where a per-query read
    makes the ring exceed shared memory, not at short rows (ViT's 197: two steps a key
    block) and not at D 128 (dK and dV leave no room)."""
    def spec(name):
        return VARIANTS[name].build(**SMALL, head_dim=64, head_dim_v=64, dtype=torch.bfloat16,
                                    backend="tilelang").spec

    def rows(name="softmax", **kw):
        return default_backward_config(64, 64, spec=spec(name), **kw).block_M

    wide = default_backward_config(64, 64, spec=spec("softmax"), seqlen_q=512)
    assert (wide.block_M, wide.block_N) == (128, 128)
    assert rows(seqlen_q=197) == rows() == 64, "short or unknown (dynamic) rows"
    plan = _plan("softmax", d=64, cfg=wide)
    assert plan.warp_specialized and plan.rows_in_ring and not plan.split
    assert rows(seqlen_q=4096, deterministic=True) == 64
    assert rows("document", seqlen_q=4096) == 64
    assert rows("alibi", seqlen_q=4096) == 128
    assert rows("alibi", seqlen_q=4096, custom_grads=("alibi_slopes",)) == 64
    assert default_backward_config(128, 128, spec=spec("softmax"), seqlen_q=4096).block_M == 64
    narrow = _plan("softmax")
    assert not narrow.rows_in_ring and narrow.split
    assert not _plan("softmax", d=64, cfg=wide, det=True).rows_in_ring


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


def test_short_unmasked_rows_walk_the_kv_blocks_persistently():
    """Without a mask, at up to PERSISTENT_MAX_SQ query rows and two thread blocks per SM,
    a thread block per SM walks the kv blocks (in grid order: no panels); not at longer rows,
    under a mask, on fewer blocks, with custom gradients; forced, only where it can run."""
    vit = dict(batch=256, heads_q=6, heads_kv=6, seqlen_q=197, seqlen_kv=197)
    plan = _plan("softmax", vit, d=64)
    assert plan.persistent and plan.panel == 1 and plan.warp_specialized
    assert _plan("relu", dict(vit, seqlen_q=512, seqlen_kv=512), d=64).persistent
    assert not _plan("softmax", dict(vit, seqlen_q=1024, seqlen_kv=1024), d=64).persistent
    assert not _plan("softmax_causal", vit, d=64).persistent
    assert not _plan("softcap", vit, d=64).persistent  # (a causal mask)
    assert not _plan("softmax", dict(vit, batch=8), d=64).persistent  # 96 blocks
    assert not _plan("sigmoid", vit, grads=("bias",), d=64).persistent
    assert _plan("sigmoid", vit, d=64).persistent
    assert _plan("softmax_causal", persistent=True).persistent
    for forced in (dict(det=True), dict(d=256), dict(heads_loop=True)):
        with pytest.raises(ValueError, match="persistent"):
            _plan("softmax", persistent=True, **forced)
    with pytest.raises(ValueError, match="panel"):
        _plan("softmax", vit, d=64, panel=2)


def test_dk_dv_stored_once_go_out_through_k_and_v_tiles():
    """The warp-specialised key split storing dK and dV once stages them in K's and V's
    tiles for TMA stores; not with fp32 atomics (GQA without the heads walk), the head
    split, the automatic pipeline, or on the persistent walk (whose next K and V load into
    those tiles) unless forced; forced, only where it can."""
    assert _plan("softmax", dict(SMALL, heads_kv=8)).staged_store
    assert _plan("softmax_causal", LLAMA3).staged_store  # the heads walk stores once
    assert not _plan("softmax_causal").staged_store  # atomics over the GQA group
    assert not _plan("softmax", dict(SMALL, heads_kv=8), d=256).staged_store
    assert not _plan("softmax", det=True).staged_store
    vit = dict(batch=256, heads_q=6, heads_kv=6, seqlen_q=197, seqlen_kv=197)
    assert not _plan("softmax", vit, d=64).staged_store
    assert _plan("softmax", vit, d=64, staged_store=True).staged_store
    with pytest.raises(ValueError, match="staged_store"):
        _plan("softmax_causal", staged_store=True)


def test_custom_gradients_that_alone_read_the_score_take_32_row_steps():
    """The default backward tile per learnable variant: 32 query rows a step where only the
    custom gradient reads the raw score (RetNet's log decay), the usual 64 where dS reads it
    anyway (sigmoid), no gradient reads it (ALiBi, the bias tables) or the kernels do not
    compute it (the key gate's, from q . dQ: exprs.RowDotGrad); 64 for every variant without
    custom gradients."""
    narrow = {"retnet"}
    learnable = {n: v.learnable for n, v in VARIANTS.items() if v.learnable}
    assert narrow < set(learnable) and {"alibi", "sigmoid", "key_gate"} < set(learnable)
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
    monkeypatch.setattr(kernel_cache, "tuned_config", lambda req, kind, **kw: tuned)
    mod = VARIANTS["retnet"].build(**SMALL, head_dim=128, head_dim_v=128, dtype=torch.bfloat16,
                                   backend="tilelang")
    req = mod.kernel_request()
    assert kernel_cache.backward_config(req) == tuned
    assert kernel_cache.backward_config(req, custom_grads=("log_decay",)).block_M == 32
    mine = KernelConfig(64, 128, 1, 256)
    assert kernel_cache.backward_config(req, mine, custom_grads=("log_decay",)) == mine


def _table_grad(index):
    """The backward's analysis of a learnable (heads, 64) table read at `index(q_idx, kv_idx)`
    and added to the score (or, for index None, multiplying it at q_idx - kv_idx)."""
    from engine import AttentionEngine, CustomIO, meta_tensor
    from engine.kernels.attention_bwd.exprs import BackwardExprs

    def score_mod(s, io, b, h, q, k):
        if index is None:
            return s * io["t"][h, (q - k).abs()]
        return s * 0.125 + io["t"][h, index(q, k)]

    meta = tuple(meta_tensor(1, 4, 256, 64, dtype=torch.bfloat16) for _ in range(3))
    mod = AttentionEngine(meta, CustomIO({"t": ("heads", 64)}), score_mod=score_mod,
                          backend="tilelang")
    return mod, BackwardExprs(mod.spec, ("t",)).dc_gathers[0]


def _exprs(mod):
    from engine.kernels.attention_bwd.exprs import BackwardExprs

    return BackwardExprs(mod.spec, ("t",))


@pytest.mark.parametrize("index, diag_dim", [
    (lambda q, k: q - k + 7, 1), (lambda q, k: (k - q).abs() // 4, 1),
    (lambda q, k: where(q < k, 0, 1) + (q - k).max(0), 1),
    (lambda q, k: q // 2, None), (lambda q, k: q + k, None), (lambda q, k: q - k + q // 64, None),
])
def test_table_index_read_through_q_minus_kv_alone(index, diag_dim):
    assert _table_grad(index)[1].diag_dim == diag_dim


def test_table_gradients_are_summed_by_diagonals_where_a_constant_turns_ds_into_them():
    from engine.kernels.attention_bwd.plan import diagonal_tables

    mod, g = _table_grad(lambda q, k: q - k + 7)
    assert g.ds_factor == pytest.approx(8.0)  # dS^T holds dS' * 0.125
    shape = KernelShape.of(mod)
    cfg = default_backward_config(64, 64, spec=mod.spec, custom_grads=("t",))
    assert cfg.block_M == 64, "the table's gradient caps the step at 64 rows"
    assert plan_backward(mod.spec, shape, cfg, ("t",)).diagonal_tables == (0,)
    # 128 x 128 tiles need 16 warps of lanes; a multiplying table's d/d read is the score
    assert diagonal_tables(_exprs(mod), KernelConfig(128, 128, 2, 256), False) == ()
    mod, g = _table_grad(None)
    assert g.diag_dim == 1 and g.ds_factor is None
    assert plan_backward(mod.spec, KernelShape.of(mod), default_backward_config(64, 64), ("t",)
                         ).diagonal_tables == ()
    assert _plan("t5_bias", grads=("t5_bias",)).diagonal_tables == (0,)


@pytest.mark.parametrize("bm, bn", [(64, 128), (32, 128), (64, 64), (16, 128), (128, 64)])
def test_diagonal_lanes_hold_each_block_and_own_each_local_diagonal_once(bm, bn):
    """The lane of block (r, c) as codegen/diagonals.py computes it: group c - r + nr - 1,
    lane r - max(0, r - c) in the group; lane k owns local diagonals k - 8 + group * e."""
    from engine.kernels.attention_bwd.plan import DIAG_BLOCK, diagonal_lanes

    lanes = diagonal_lanes(bm, bn)
    nr, nc = bn // DIAG_BLOCK, bm // DIAG_BLOCK
    held = set()
    for r in range(nr):
        for c in range(nc):
            u = c - r
            group, k = u + nr - 1, r - max(0, -u)
            assert 0 <= k < lanes.group and 0 <= group < lanes.groups
            held.add((group, k))
    assert len(held) == nr * nc and lanes.groups * lanes.group <= 32 * lanes.warps
    owned = sorted(k - DIAG_BLOCK + lanes.group * e
                   for k in range(lanes.group) for e in range(lanes.owned))
    assert owned == list(range(-DIAG_BLOCK, DIAG_BLOCK))
