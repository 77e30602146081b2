"""Dilated masks fold into shorter rows (engine.mask.congruence, engine.plan.fold):
which conjuncts are congruences, when the forward folds, its block tables against brute force
per residue, and the folded kernel's index texts against the tensors the launcher binds."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import CustomIO
from engine.dsl.expr import index_leaf, to_text
from engine.ir.trace import check_result
from engine.kernels.attention_fwd.codegen import _Frame
from engine.mask.analysis import EMPTY, FULL, PARTIAL, classify
from engine.mask.congruence import congruence
from engine.plan import fold as fold_mod
from engine.plan.shape import KernelShape
from engine.problem import Problem
from engine.runtime import kernel as kernel_mod
from engine.runtime.tilelang_backend import forward_kernel_call
from engine.variants import VARIANTS


def _trace(mask_mod, io: CustomIO | None = None):
    b, h, q, kv = (index_leaf(n) for n in ("b", "h", "q", "kv"))
    return check_result("mask_mod", "the result", mask_mod(b, h, q, kv), {"m", "n"},
                        io or CustomIO({}), dtype="bool")


@pytest.mark.parametrize("mask_mod, stride, rest", [
    (lambda b, h, q, kv: (q >= kv) & ((q - kv) % 2 == 0), 2, "q >= kv"),
    (lambda b, h, q, kv: ((kv - q) % 3 == 0) & (q - kv < 64), 3, "q - kv < 64"),
    (lambda b, h, q, kv: 0 == (q - kv + 8) % 4, 4, None),
    (lambda b, h, q, kv: (q % 5 == kv % 5) & (kv <= q), 5, "kv <= q"),
    # the largest of two congruences folds; the other stays in the mask
    (lambda b, h, q, kv: ((q - kv) % 2 == 0) & ((q - kv) % 6 == 0), 6, "% 2"),
])
def test_congruences_fold(mask_mod, stride, rest):
    c = congruence(_trace(mask_mod))
    assert c is not None and c.stride == stride
    if rest is None:
        assert c.rest is None
    else:
        text = to_text(c.rest)
        assert "% " + str(stride) not in text and rest.split()[-1] in text


@pytest.mark.parametrize("mask_mod", [
    lambda b, h, q, kv: q >= kv,
    lambda b, h, q, kv: (q - kv) % 2 == 1,  # the other residue pairs
    lambda b, h, q, kv: (q - kv - 1) % 2 == 0,  # shifted: q = kv + 1 mod 2
    lambda b, h, q, kv: (q + kv) % 2 == 0,
    lambda b, h, q, kv: (2 * q - kv) % 3 == 0,
    lambda b, h, q, kv: q % 2 == 0,
    lambda b, h, q, kv: q % 2 == kv % 3,
    lambda b, h, q, kv: (q >= kv) | ((q - kv) % 2 == 0),  # not a conjunct
])
def test_other_masks_do_not_fold(mask_mod):
    assert congruence(_trace(mask_mod)) is None


def _shape(mask, seqlen=256, dynamic=False, **kw):
    p = Problem(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlen, seqlen_kv=seqlen, head_dim=64,
                head_dim_v=64, **kw)
    return KernelShape.for_problem(p, torch.bfloat16, mask, dynamic)


def _spec(name="dilated", seqlen=256):
    return VARIANTS[name].build(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlen,
                                seqlen_kv=seqlen, head_dim=64, head_dim_v=64,
                                dtype=torch.bfloat16).spec


def test_the_dilated_forward_folds_into_shorter_rows_and_more_heads():
    spec = _spec()
    fold = fold_mod.row_fold(spec, _shape(spec.mask))
    assert fold is not None and fold.stride == 2
    t = fold.tiled
    assert (t.batch, t.seqlen_q, t.seqlen_kv, t.heads_q, t.heads_kv) == (2, 128, 128, 8, 4)
    assert to_text(fold.spec.mask) == to_text(_trace(lambda b, h, q, kv: q >= kv))


def test_when_the_forward_does_not_fold(monkeypatch):
    spec = _spec()
    assert fold_mod.row_fold(spec, _shape(spec.mask, seqlen=255)) is None  # 255 % 2
    assert fold_mod.row_fold(spec, _shape(spec.mask, dynamic=True)) is None
    for mask_mod in (lambda b, h, q, kv: ((q - kv) % 2 == 0) & (h > 0),
                     lambda b, h, q, kv: ((q - kv) % 2 == 0) & (b > 0)):
        other = dataclasses.replace(spec, mask=_trace(mask_mod))
        assert fold_mod.row_fold(other, _shape(other.mask)) is None  # its tables per b / h
    monkeypatch.setattr(fold_mod, "FOLD_ROWS", False)
    assert fold_mod.row_fold(spec, _shape(spec.mask)) is None


def _brute_folded(rest_mod, stride, rows_q, rows_kv, bM, bN):
    """Per residue r, rows i and keys j at positions i * stride + r and j * stride + r; a
    block is FULL (EMPTY) where it is for every residue, keys past the rows never full."""
    out = torch.empty(math.ceil(rows_q / bM), math.ceil(rows_kv / bN), dtype=torch.int8)
    i, j = torch.arange(rows_q).view(-1, 1), torch.arange(rows_kv).view(1, -1)
    allowed = torch.stack([rest_mod(i * stride + r, j * stride + r) for r in range(stride)])
    for a in range(out.shape[0]):
        for c in range(out.shape[1]):
            blk = allowed[:, a * bM:(a + 1) * bM, c * bN:(c + 1) * bN]
            full = bool(blk.all()) and (c + 1) * bN <= rows_kv
            out[a, c] = FULL if full else (PARTIAL if blk.any() else EMPTY)
    return out


@pytest.mark.parametrize("stride", [2, 3])
@pytest.mark.parametrize("rest_mod", [
    lambda q, kv: q >= kv,
    lambda q, kv: (q - kv < 120) & (kv - q < 120),
    lambda q, kv: (q >= kv) & (kv >= 30),
], ids=["causal", "window", "causal-from-30"])
@pytest.mark.parametrize("block", [(16, 16), (32, 16), (16, 24)])
def test_folded_tables_against_brute_force(stride, rest_mod, block):
    rows = 90  # a key tail in every block size
    bc = classify(_trace(lambda b, h, q, kv: rest_mod(q, kv)), 1, 1, rows, rows, *block,
                  stride=stride)
    want = _brute_folded(rest_mod, stride, rows, rows, *block)
    assert torch.equal(bc.classes[0, 0], want)
    assert (want == FULL).any() and (want == PARTIAL).any()  # the test can fail


@pytest.fixture
def calls(monkeypatch):
    seen: list = []

    class Fake:
        def __init__(self, source):
            self.source = source

        def __call__(self, *args):
            seen.append((self.source, args))

    monkeypatch.setattr(kernel_mod, "compile_source", Fake)
    return seen


def test_folded_index_texts_name_the_elements_the_launcher_binds(calls):
    """Row i of folded head y in the views the kernel gets is the query (key) the kernel's
    position and head texts say: the fold's whole mapping, checked element by element."""
    sizes = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=192, seqlen_kv=192, head_dim=64,
                 head_dim_v=64)
    mod = VARIANTS["dilated"].build(**sizes, dtype=torch.bfloat16, backend="tilelang")
    inputs = VARIANTS["dilated"].make_inputs(**sizes, dtype=torch.bfloat16)
    q, k = inputs["q"], inputs["k"]  # [B, S, H, D]
    o, _ = forward_kernel_call(mod.kernel_cache, mod.kernel_request(), q, k, inputs["v"], [])
    fk = mod.forward_kernel()
    ((_, args),) = calls
    got = dict(zip([p.name for p in fk.kernel.params], args, strict=True))
    assert got["Q"].data_ptr() == q.data_ptr() and got["O"].data_ptr() == o.data_ptr()
    assert tuple(got["Q"].shape) == (2, 96, 8, 64) and tuple(o.shape) == (2, 192, 4, 64)
    assert "rows folded by 2" in fk.source.splitlines()[0]  # the source says so
    f = _Frame(mod.spec, KernelShape.of(mod), fk.config)
    G = sizes["heads_q"] // sizes["heads_kv"]
    for by in range(8):
        for bx, kb, i, j in ((0, 0, 0, 5), (0, 0, 63, 63), (1, 0, 31, 17)):
            env = {"bx": bx, "kb": kb, "i": i, "j": j, "by": by}
            qp, kp, hq = (eval(f.index_text[s], env) for s in ("q", "kv", "h"))
            row, key = bx * fk.config.block_M + i, kb * fk.config.block_N + j
            if row >= 96:
                continue
            assert torch.equal(got["Q"][1, row, by], q[1, qp, hq])
            assert torch.equal(got["K"][1, key, by // G], k[1, kp, hq // G])
            assert qp % 2 == kp % 2  # one residue per folded head


def test_the_dilated_backward_is_planned_on_the_folded_shape():
    from engine.kernels.attention_bwd.plan import default_backward_config, plan_backward

    mod = VARIANTS["dilated"].build(batch=2, heads_q=32, heads_kv=8, seqlen_q=4096,
                                    seqlen_kv=4096, head_dim=128, head_dim_v=128,
                                    dtype=torch.bfloat16)
    shape = KernelShape.of(mod)
    plan = plan_backward(mod.spec, shape, default_backward_config(128, 128))
    assert plan.fold is not None and plan.fold.tiled.heads_q == 64
    bk = mod.backward_kernels()
    assert bk.shape == plan.fold.tiled and bk.plan.heads_loop  # decided at the tiled shape
    # Custom inputs index the problem's rows: such a spec keeps its rows in the backward.
    alibi_dilated = dataclasses.replace(VARIANTS["alibi"].build(
        batch=2, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_kv=256, head_dim=64,
        head_dim_v=64, dtype=torch.bfloat16).spec, mask=mod.spec.mask)
    small = _shape(alibi_dilated.mask)
    assert fold_mod.row_fold(alibi_dilated, small) is not None
    assert plan_backward(alibi_dilated, small, default_backward_config(64, 64)).fold is None


def test_folded_backward_binds_views_and_the_row_scales_by_residue(calls):
    """The backward's kernels get the tiled views of q, k, v, dO, the forward's row scales
    permuted to the folded heads' rows, and give dq, dk, dv in the problem's layout; the
    main kernel's index texts name the elements of those views."""
    from engine.kernels.attention_bwd.codegen.frame import frame

    sizes = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=192, seqlen_kv=192, head_dim=64,
                 head_dim_v=64)
    mod = VARIANTS["dilated"].build(**sizes, dtype=torch.bfloat16, backend="tilelang")
    inputs = VARIANTS["dilated"].make_inputs(**sizes, dtype=torch.bfloat16)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    o, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(2, 4, 192)
    from engine.runtime.tilelang_backend import backward_kernel_call

    dq, dk, dv, _ = backward_kernel_call(mod.kernel_cache, mod.kernel_request(), q, k, v, o,
                                         [lse], do, [])
    bk = mod.backward_kernels()
    main = next(dict(zip([p.name for p in bk.main.params], a, strict=True))
                for s, a in calls if s == bk.main.source)
    assert main["Q"].data_ptr() == q.data_ptr() and tuple(main["Q"].shape) == (2, 96, 8, 64)
    assert main["dO"].data_ptr() == do.data_ptr()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    f = frame(bk.plan.fold.spec, bk.shape, bk.plan)
    head = "hq" if bk.plan.heads_loop else "by"
    G = sizes["heads_q"] // sizes["heads_kv"]
    for y in range(8):
        for qb, j, bx, i in ((0, 0, 0, 3), (1, 5, 0, 60), (0, 63, 1, 31)):
            env = {"qb": qb, "j": j, "bx": bx, "i": i, head: y}
            qp, kp, hq = (eval(f.index_text[s], env) for s in ("q", "kv", "h"))
            row, key = qb * f.d.bM + j, bx * f.d.bN + i
            if row >= 96 or key >= 96:
                continue
            assert torch.equal(main["Q"][1, row, y], q[1, qp, hq])
            assert torch.equal(main["K"][1, key, y // G], k[1, kp, hq // G])
            assert main["F_lse"][1, y, row] == lse[1, hq, qp]
