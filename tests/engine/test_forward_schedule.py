"""The forward's warp-specialised schedule (engine/kernels/attention_fwd/ws.py) as generated:
roles, the order of gemm issue, waits and the online step, and where the class branch sits."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from engine.plan.config import KernelConfig
from engine.variants import VARIANTS

SHAPE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_kv=1000, head_dim=128,
             head_dim_v=128)


def _source(name: str, schedule: str = "overlap", block_N: int = 128) -> str:
    mod = VARIANTS[name].build(**SHAPE, dtype=torch.bfloat16, backend="reference",
                               config=KernelConfig(128, block_N, 2, 256, schedule=schedule))
    return mod.kernel_source


REST_LOOP = "for kk in T.serial(T.max(nf, 1) - 1, n - 1):"
FULL_LOOP = "for kk in T.serial(T.max(nf, 1) - 1):"


def _loop_body(src: str) -> str:
    """The loop over the blocks outside the full run (each by its class)."""
    return src[src.index(REST_LOOP):src.index("T.mbarrier_wait_parity(v_full[(n - 1)")]


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


def test_staged_data_mask_is_evaluated_once_beside_the_running_p_v():
    """A mask reading per-query and per-key ids (document with prefixes): the keys' ids come
    from the producer's ring at the step's stage, the mask is evaluated once (P's select tests
    the -inf it left in the scores), so the partial branch overlaps the previous P V as the
    full one does; K's stage, which the ring shares, is freed after the online step."""
    src = _source("document_prefix")
    assert "cks0[k % 2, t] = C_doc_ids[bz, T.min(kb * 128 + t, 999)]" in src
    partial = _loop_body(src).split("if kcls == 2:")[1].split("else:")[1]
    assert partial.count("cks0[ks, j]") == 1 and "C_doc_ids" not in partial
    assert "T.if_then_else((acc_s[i, j] != (-T.infinity(\"float32\")))" in partial
    order = [m.group(0) for m in re.finditer(
        r"T\.wait_wgmma\(\d\)|T\.reduce_max|T\.mbarrier_arrive\(k_empty|"
        r"T\.copy\(acc_s, acc_s_cast\)", partial)]
    assert order == ["T.wait_wgmma(1)", "T.reduce_max", "T.mbarrier_arrive(k_empty",
                     "T.wait_wgmma(0)", "T.copy(acc_s, acc_s_cast)"], order


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


def test_full_run_is_walked_without_the_class_branch():
    """Masked: the run of full key blocks first, one body and no class read; the other blocks
    after it by their class. The producer loads in the same order; a head's longest query
    blocks start first."""
    src = _source("softmax_causal")
    full_loop = src[src.index(FULL_LOOP):src.index(REST_LOOP)]
    assert "kcls" not in full_loop and "if_then_else((bx * 128 + i) >=" not in full_loop
    assert full_loop.count("T.wgmma_gemm") == 2 and "kb: T.int32 = fs + k" in full_loop
    assert "kcls" in _loop_body(src)
    assert "as (bxr, by, bz):" in src and "bx: T.int32 = 8 - 1 - bxr" in src
    assert "Fs: T.Tensor((1, 1, 8), \"int32\")" in src
    # no mask, no key tail: one loop, no tables of runs, the grid in order
    plain = VARIANTS["softmax"].build(**{**SHAPE, "seqlen_q": 1024, "seqlen_kv": 1024},
                                      dtype=torch.bfloat16, backend="reference",
                                      config=KernelConfig(128, 128, 2, 256, schedule="overlap")
                                      ).kernel_source
    assert "for kk in T.serial(n - 1):" in plain and "Fs" not in plain and "bxr" not in plain


def test_three_warpgroups_retire_each_step_at_the_next_steps_top():
    """On 192-row tiles an unmasked step opens by retiring the previous one (its P V waited
    for, its V freed, P cast), issues Q K^T, rescales O while it runs, then issues P V; the
    online step ends the loop body, so ptxas keeps its exponentials before the wait. Two
    warpgroups, and masked specs on three, retire each step at its end."""
    ops = (r"T\.wgmma_gemm\(Q_shared|T\.wgmma_gemm\(acc_s_cast|T\.wait_wgmma\(\d\)|"
           r"T\.mbarrier_arrive\(v_empty|T\.reduce_max|acc_o\[i, j\] \*= o_scale_f|"
           r"T\.copy\(acc_s, acc_s_cast\)")

    def loop(name: str, cfg: KernelConfig) -> list[str]:
        src = VARIANTS[name].build(**{**SHAPE, "seqlen_q": 1152, "seqlen_kv": 1152,
                                      "head_dim": 64, "head_dim_v": 64},
                                   dtype=torch.bfloat16, backend="reference",
                                   config=cfg).kernel_source
        body = src[src.index("for kk in T.serial("):src.index("T.mbarrier_wait_parity(v_full[(n - 1)")]
        return [m.group(0) for m in re.finditer(ops, body)]

    wide = KernelConfig(192, 128, 3, 384, schedule="overlap", persistent=True)
    retire = ["T.wait_wgmma(0)", "T.mbarrier_arrive(v_empty", "T.copy(acc_s, acc_s_cast)"]
    step = ["T.wgmma_gemm(Q_shared", "acc_o[i, j] *= o_scale_f", "T.wgmma_gemm(acc_s_cast",
            "T.wait_wgmma(1)", "T.reduce_max"]
    # the loop, then the last step's retirement (O rescaled there)
    assert loop("softmax", wide) == retire + step + retire[:2] + [
        "acc_o[i, j] *= o_scale_f", "T.copy(acc_s, acc_s_cast)"]
    end = ["T.wgmma_gemm(Q_shared", "T.wgmma_gemm(acc_s_cast", "T.wait_wgmma(1)",
           "T.reduce_max", "T.wait_wgmma(0)", "T.mbarrier_arrive(v_empty",
           "acc_o[i, j] *= o_scale_f", "T.copy(acc_s, acc_s_cast)"]
    assert loop("softmax", KernelConfig(128, 128, 2, 256, schedule="overlap")) == end
    causal = loop("softmax_causal", dataclasses.replace(wide, num_stages=2))
    assert "T.wait_wgmma(0)" not in causal[:causal.index("T.reduce_max")]


def _walk(text: str, lo: int, fs: int, nf: int, k: int) -> int:
    """The emitted key-block expression evaluated as the kernel would."""
    env = {"T": type("T", (), {"if_then_else": staticmethod(lambda c, a, b: a if c else b),
                               "Cast": staticmethod(lambda dt, x: int(x))}),
           "lo": lo, "fs": fs, "nf": nf, "k": k}
    return eval(text, env)


def test_key_order_visits_every_block_once():
    """Over random class rows: the full run first, then every other block of [lo, hi) once."""
    from engine.kernels.attention_fwd.ws import KeyOrder
    from engine.mask.analysis import BlockClasses

    gen = torch.Generator().manual_seed(0)
    classes = torch.randint(0, 3, (1, 1, 64, 12), generator=gen, dtype=torch.int8)
    bc = BlockClasses(classes, 128, 128, 64 * 128, 12 * 128)
    lo, hi = bc.loop_bounds()
    fs, fe = bc.full_run(lo)
    order = KeyOrder(full_run=True)
    for r in range(64):
        l, h, s, e = (int(t[0, 0, r]) for t in (lo, hi, fs, fe))
        walk = [_walk(order.kb("k"), l, s, e - s, k) for k in range(h - l)]
        assert sorted(walk) == list(range(l, h)), (r, walk)
        assert walk[:e - s] == list(range(s, e))
        assert all(classes[0, 0, r, kb] == 2 for kb in walk[:e - s])
        row = "".join(map(str, classes[0, 0, r, l:h].tolist()))
        assert e - s == max(len(run) for run in re.split("[01]", row))
        rest = [_walk(order.rest_kb("k"), l, s, e - s, k) for k in range(max(e - s, 1), h - l)]
        assert rest == walk[max(e - s, 1):]


@pytest.mark.parametrize("threads,blocks,regs", [(256, 1, 240), (384, 1, 160), (256, 2, 104),
                                                 (128, 2, 232), (384, 2, 72)])
def test_consumer_registers_fit_the_blocks_own_pool(threads, blocks, regs):
    """setmaxnreg draws on a pool per CTA: the consumers' registers after the reallocation,
    beside the producer warpgroup's 24, fit what the block launched with (its share of the
    SM's 64 Ki under its launch bounds, in multiples of 8), and at one block they are
    TileLang's own 240 and 160."""
    from engine.plan.config import consumer_register_cap

    cap = consumer_register_cap(threads, blocks)
    launch = 65536 // (blocks * (threads + 128)) // 8 * 8
    assert cap == regs and cap % 8 == 0
    assert 128 * 24 + threads * cap <= (threads + 128) * launch
