"""The forward's warp-specialised schedule (engine/kernels/attention_fwd/ws.py) as generated:
roles, the order of gemm issue, waits and the online step, and where the class branch sits."""

from __future__ import annotations

import re

import torch

from engine.plan.config import KernelConfig
from engine.variants import VARIANTS

SHAPE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000, head_dim=128,
             head_dim_v=128)


def _source(name: str, schedule: str = "overlap", block_N: int = 128) -> str:
    mod = VARIANTS[name].build(**SHAPE, dtype=torch.bfloat16, backend="reference",
                               config=KernelConfig(128, block_N, 2, 256, schedule=schedule))
    return mod.kernel_source


def _loop_body(src: str) -> str:
    return src[src.index("for kk in T.serial(n - 1):"):src.index("T.mbarrier_wait_parity(v_full[(n - 1)")]


def test_roles_and_rings():
    src = _source("softmax_causal")
    assert "PASS_CONFIGS = {'tl.disable_thread_storage_sync': True}" in src
    assert "threads=384" in src  # 256 consumers and a producer warpgroup
    assert "T.set_max_nreg(24, 0)" in src and "T.set_max_nreg(240, 1)" in src
    assert "k_empty = T.alloc_barrier([256, 256])" in src  # every consumer frees a stage
    assert src.count("T.tma_copy(") == 3  # Q once, K and V per step


def test_each_class_branch_holds_a_whole_step():
    """Block k's Q K^T and block k-1's P V issued in each branch, the scores waited for alone,
    then the online step, then the P V wait, the rescale and P's cast: no branch taken while a
    wgmma is in flight."""
    body = _loop_body(_source("softmax_causal"))
    full, partial = body.split("if kcls == 2:")[1].split("else:")
    for branch in (full, partial):
        order = [m.group(0) for m in re.finditer(
            r"T\.wgmma_gemm\(Q_shared|T\.wgmma_gemm\(acc_s_cast|T\.wait_wgmma\(\d\)|"
            r"T\.reduce_max|acc_o\[i, j\] \*= o_scale_f|T\.copy\(acc_s, acc_s_cast\)", branch)]
        assert order == ["T.wgmma_gemm(Q_shared", "T.wgmma_gemm(acc_s_cast", "T.wait_wgmma(1)",
                         "T.reduce_max", "T.wait_wgmma(0)", "acc_o[i, j] *= o_scale_f",
                         "T.copy(acc_s, acc_s_cast)"], order
    assert "T.wgmma_gemm" not in body[:body.index("if kcls == 2:")]


def test_mask_evaluated_once_waits_for_the_previous_p_first():
    """A data-dependent mask is written into acc_s_cast, which the P V in flight still reads:
    that branch waits for it before its online step (and casts nothing after)."""
    partial = _loop_body(_source("document")).split("else:")[1]
    assert partial.index("T.wait_wgmma(0)") < partial.index("acc_s_cast[i, j] = T.if_then_else")
    assert "T.copy(acc_s, acc_s_cast)" not in partial


def test_pingpong_takes_turns_on_named_barriers():
    src = _source("softmax", "pingpong", block_N=176)
    assert "T.named_barrier_arrive(2, 256)" in src and "T.sync_threads(3, 256)" in src
    loop = _loop_body(src)
    assert loop.index("T.sync_threads(2, 256)") < loop.index("T.wgmma_gemm(Q_shared") \
        < loop.index("T.named_barrier_arrive(3, 256)")


def test_o_staged_in_q_only_where_the_shapes_match():
    assert "O_shared" not in _source("softmax")
    mod = VARIANTS["softmax_causal"].build(
        **{**SHAPE, "head_dim_v": 256}, dtype=torch.bfloat16, backend="reference",
        config=KernelConfig(128, 64, 2, 256, schedule="overlap"))
    assert "O_shared = T.alloc_shared((128, 256)" in mod.kernel_source
