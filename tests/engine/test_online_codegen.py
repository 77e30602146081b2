"""What the forward's online step and the backward's tile loops emit per element: a positive
per-head factor of the score folded into the exponential's FFMA, inputs read once per thread
block into scalars, P's mask applied once in partial blocks, and a per-key custom gradient's
tile written in the dS loop (sources, no GPU)."""

from __future__ import annotations

import re

import torch

from engine import AttentionEngine, CustomIO, OnlineSoftmax, meta_tensor
from engine.codegen.emit import block_uniform
from engine.dsl.expr import custom_leaf, index_leaf, leaf
from engine.ir.rewrite import distribute_exp_scale, positive, pull_out_of_max
from engine.variants import get_variant

SIZES = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=1024, seqlen_kv=1024, head_dim=128,
             head_dim_v=128)
B, HQ, HKV, S, D = 2, 8, 2, 1024, 128


def _source(name: str) -> str:
    return get_variant(name).build(**SIZES, dtype=torch.bfloat16, backend="tilelang").kernel_source


def _custom_source(score_mod, customs) -> str:
    meta = tuple(meta_tensor(B, h, S, D, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    mod = AttentionEngine(meta, CustomIO(customs), score_mod=score_mod,
                          mask_mod=lambda b, h, q, kv: q >= kv, online_func=OnlineSoftmax(),
                          backend="tilelang")
    return mod.kernel_source


def _tile_assigns(src: str) -> list[str]:
    """The statements of every `for i, j in T.Parallel` loop."""
    lines = src.splitlines()
    return [lines[n + 1].strip() for n, ln in enumerate(lines)
            if re.search(r"for i, j in T\.Parallel", ln)]


def _gate(name: str):
    return custom_leaf(name, ("heads",))


def test_positive_is_structural():
    g = _gate("g")
    assert positive(g.sigmoid()) and positive(g.exp() * 2.0) and positive(g.sigmoid() + 1.0)
    assert not positive(g) and not positive(g.sigmoid() - 1.0) and not positive(-g.exp())


def test_max_commutes_only_with_positive_factors_constant_along_keys():
    s = leaf("rawscore", ("m", "n"))
    kv = index_leaf("kv")
    folded = pull_out_of_max(((s * 0.5) * _gate("g").sigmoid()).get_reduce("max"))
    assert folded.op == "mul" and folded.args[0].op == "mul"  # (max(s) * 0.5) * sigmoid(g)
    assert folded.args[0].args[0].op == "reduce" and folded.args[0].args[0].args[0] is s
    for kept in (s * _gate("g"), s * (kv * 1.0).sigmoid()):  # sign unknown; varies with kv
        assert pull_out_of_max(kept.get_reduce("max")).op == "reduce"


def test_exp_scale_multiplies_each_element_once():
    s = leaf("rawscore", ("m", "n"))
    g = _gate("g").sigmoid()
    out = distribute_exp_scale((s * 0.5) * g, 2.0)
    assert out.op == "mul" and out.args[0] is s  # s * (g * 1.0): one product per element
    assert out.args[1].op == "mul" and out.args[1].args[0].key == g.key
    assert float(out.args[1].args[1].attr) == 1.0


def test_key_gate_forward_has_no_score_pass_and_reads_its_gate_once():
    src = _source("key_gate")
    assigns = _tile_assigns(src)
    # No separate pass scaling the score tile; the exponential multiplies by a scalar.
    assert not any(a.startswith("acc_s[i, j] = ((acc_s[i, j] *") for a in assigns)
    assert "uni1: T.float32 = T.sigmoid(C_key_gate[by])" in src
    assert not any("C_key_gate" in a for a in assigns)
    assert any("acc_s[i, j] * (uni1 * T.float32(" in a for a in assigns)


def test_a_factor_of_unknown_sign_keeps_the_score_pass():
    src = _custom_source(lambda s, c, b, h, q, k: s * c["t"], {"t": ("heads",)})
    assert any(a.startswith("acc_s[i, j] = (acc_s[i, j] * uni1)") for a in _tile_assigns(src))


def test_alibi_reads_its_slope_once_per_block_forward_and_backward():
    for src in (_source("alibi"),
                "\n".join(get_variant("alibi").build(**SIZES, dtype=torch.bfloat16,
                                                     backend="tilelang")
                          .backward_kernels().sources())):
        assert re.search(r"uni1: T\.float32 = C_alibi_slopes\[\w+\]", src)
        assert not any("C_alibi_slopes" in a for a in _tile_assigns(src))


def test_block_uniform_takes_the_largest_input_reads_without_tile_axes():
    s = leaf("rawscore", ("m", "n"))
    g = _gate("g")
    kv = index_leaf("kv")
    found = block_uniform([s * (g.sigmoid() * 2.0) + g * (kv * 1.0)])
    assert {e.key for e in found} == {(g.sigmoid() * 2.0).key, g.key}
    assert block_uniform([s * 2.0]) == []  # constants stay inline


def test_partial_blocks_mask_p_once():
    """P (the sum's input, already 0 where masked) is not selected by the mask again."""
    for name in ("softmax_causal", "neighbourhood_2d", "document"):
        src = _source(name)
        again = [a for a in _tile_assigns(src)
                 if re.fullmatch(r"acc_s\[i, j\] = T\.if_then_else\(.*, acc_s\[i, j\], "
                                 r"T\.float32\(0\.0\)\)", a)]
        assert not again, name
        # the exponential is still masked, and the max's input still -inf where masked
        assert any("T.exp2(" in a and a.endswith("T.float32(0.0))") for a in _tile_assigns(src))
        assert any(a.endswith('(-T.infinity("float32")))') for a in _tile_assigns(src))


def _backward_main(score_mod, customs, grads) -> str:
    meta = tuple(meta_tensor(B, h, S, D, dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    mod = AttentionEngine(meta, CustomIO(customs), score_mod=score_mod,
                          mask_mod=lambda b, h, q, kv: q >= kv, online_func=OnlineSoftmax(),
                          backend="tilelang")
    return mod.backward_kernels(custom_grads=grads).main.source


def test_one_per_key_gradient_tile_is_written_in_the_ds_loop():
    src = _backward_main(lambda s, c, b, h, q, k: s * 0.125 + c["slope"] * (k - q),
                         {"slope": ("heads",)}, ("slope",))
    lines = [ln.strip() for ln in src.splitlines()]
    ds = [n for n, ln in enumerate(lines) if ln.startswith("dsT_cast[i, j] =")]
    assert len(ds) == 2  # full and partial blocks
    for n in ds:
        assert lines[n + 1].startswith("cg_tile[i, j] =")
    full = lines[ds[0] + 1]  # full blocks: no mask, dS' as the dS loop has it
    assert "T.if_then_else" not in full and "(dpT[i, j] - Dr[j]) * pT[i, j]" in full
    assert sum(ln.startswith("cg_tile[i, j] =") for ln in lines) == 2


def test_several_per_key_gradients_keep_their_own_loops():
    src = _backward_main(lambda s, c, b, h, q, k: s * 0.125 + c["a"] * (k - q) + c["g"] * q,
                         {"a": ("heads",), "g": ("heads",)}, ("a", "g"))
    lines = [ln.strip() for ln in src.splitlines()]
    loops = [n for n, ln in enumerate(lines) if ln.startswith("cg_tile[i, j] =")]
    assert len(loops) == 2 and all("T.if_then_else" in lines[n] for n in loops)
    assert all(not lines[n - 1].startswith("dsT_cast") for n in loops)


def _ds_lines(name: str, seqlen: int) -> list[str]:
    sizes = dict(SIZES, seqlen_q=seqlen, seqlen_kv=seqlen)
    src = get_variant(name).build(**sizes, dtype=torch.bfloat16,
                                  backend="tilelang").backward_kernels().main.source
    return [ln.strip() for ln in src.splitlines() if ln.strip().startswith("dsT_cast[i, j] =")]


def test_softmax_ds_takes_ps_zeros_in_partial_blocks_without_tails():
    for name in ("softmax_causal", "neighbourhood_2d", "softcap"):
        lines = _ds_lines(name, 1024)  # a multiple of every block: no rows past the sequence
        assert len(lines) == 2 and not any("T.if_then_else" in ln for ln in lines), name
    # rows past the sequence (1000 keys): their dO and Delta need not be finite
    assert any("T.if_then_else" in ln for ln in _ds_lines("softmax_causal", 1000))
    # dS not a product with P (sigmoid attention): the mask stays
    assert any("T.if_then_else" in ln for ln in _ds_lines("sigmoid", 1024))
