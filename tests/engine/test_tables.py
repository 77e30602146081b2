"""Table lookups and index arithmetic in AttentionEngine specs (issue 19): CustomIO tensors with
integer dims read at integer expressions of b, h, q_idx and kv_idx, in score_mod (learnable:
gradients) and in mask_mod (block classification); the reference executor against the same
attention written in torch; the kernels' clamped reads and atomic gradients as generated."""

from __future__ import annotations

import re

import pytest
import torch

from engine import CustomIO
from engine.dsl.expr import DSLError, index_leaf
from engine.mask.analysis import EMPTY, FULL, classify
from tests import table_spec

B, HQ, S, D = 2, 4, 40, 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hkv", [4, 1], ids=["gqa1", "gqa4"])
def test_tables_forward_and_gradients_match_torch(dtype, hkv):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    mod = table_spec.module(dtype, B, HQ, hkv, S, D, backend="reference")
    data = table_spec.inputs(B, HQ, S, "cpu", gen)
    q, k, v = (torch.randn(B, S, h, D, generator=gen).to(dtype).requires_grad_()
               for h in (HQ, hkv, hkv))
    rel, t5 = data["rel"].requires_grad_(), data["t5"].requires_grad_()
    out = mod(q, k, v, rel, t5, data["seg"])
    want = table_spec.torch_reference(q, k, v, rel, t5, data["seg"])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    do = torch.randn(out.shape, generator=gen).to(dtype)
    got = torch.autograd.grad(out, (q, k, v, rel, t5), do)
    ref = torch.autograd.grad(want, (q, k, v, rel, t5), do.double())
    for name, a, w in zip(("dq", "dk", "dv", "drel", "dt5"), got, ref, strict=True):
        assert a.abs().sum() > 0, f"{name} is zero"
        torch.testing.assert_close(a.double(), w.double(), rtol=tol, atol=tol * 4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_block_classes_of_a_mask_that_reads_a_table():
    """The segment mask reads seg[b, q_idx // 2]: a table lookup bounded by the table's range,
    never a wrong EMPTY or FULL block."""
    gen = torch.Generator().manual_seed(3)
    seg = table_spec.inputs(B, HQ, S, "cpu", gen)["seg"]
    mod = table_spec.module(torch.float32, B, HQ, HQ, S, D, backend="reference")
    bc = classify(mod.spec.mask, B, HQ, S, S, 8, 8, {"seg": seg})
    qi, ki = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    dense = seg[:, qi // 2] >= seg[:, ki // 2]
    cls = bc.classes
    for b in range(B):
        for qb in range(S // 8):
            for kb in range(S // 8):
                tile = dense[b, qb * 8:(qb + 1) * 8, kb * 8:(kb + 1) * 8]
                c = int(cls[min(b, cls.shape[0] - 1), 0, qb, kb])
                assert not (c == EMPTY and tile.any()) and not (c == FULL and not tile.all())


def test_an_index_outside_the_table_is_an_index_error():
    io = CustomIO({"rel": ("heads", S)})
    from engine import AttentionEngine, meta_tensor

    mod = AttentionEngine(tuple(meta_tensor(B, HQ, S, D, dtype=torch.float32) for _ in "qkv"), io,
                          score_mod=lambda s, c, b, h, q, kv: s + c["rel"][h, q - kv + S - 1],
                          backend="reference")
    q, k, v = (torch.randn(B, S, HQ, D) for _ in "qkv")
    with pytest.raises(IndexError, match=r"custom input 'rel': index .* takes values 0\.\.78, "
                                         r"outside dim 1 of size 40"):
        mod(q, k, v, torch.randn(HQ, S))


def test_float_indices_are_refused():
    io = CustomIO({"t": ("heads", 8)})
    with pytest.raises(DSLError, match=r"CustomIO 't' dim 8: index with an integer expression"):
        io["t"][index_leaf("h"), index_leaf("q").float() * 0.5]


def test_kernels_clamp_table_reads_and_add_table_gradients_atomically(monkeypatch):
    from engine.kernels.attention_bwd import plan

    mod = table_spec.module(torch.bfloat16, 2, 8, 2, 1000, 64)
    src = mod.kernel_source
    assert re.search(r"C_rel\[by, T\.max\(T\.min\(.*, 1998\), 0\)\]", src)
    assert "C_rel: T.Tensor((8, 1999,)" in src
    # Both tables read q - kv alone: their gradients are summed along dS^T's diagonals (16-byte
    # rows of 8 x 8 blocks, shuffles within a group), each owned sum added at a new entry.
    main = mod.backward_kernels(custom_grads=("rel", "t5")).main.source
    assert main.count("for b in T.vectorized(8):") == 1
    assert main.count("T.shfl_xor(dg_part[d], ") == 3
    assert main.count("T.atomic_add(dC_rel[by, dg_at0[e]], dg_acc0[e] * T.float32(8.0))") == 2
    assert main.count("T.atomic_add(dC_t5[by, dg_at1[e]], dg_acc1[e] * T.float32(8.0))") == 2
    assert "tg1" not in main and "T.atomic_add(dC_rel[by, T.max(" not in main
    # Element by element: the 1999-entry row per head by global atomics; T5's 32 buckets summed
    # in a shared row per thread block, then one global atomic per entry.
    monkeypatch.setattr(plan, "diagonal_tables", lambda ex, cfg, det: ())
    main = table_spec.module(torch.bfloat16, 2, 8, 2, 1000, 64).backward_kernels(
        custom_grads=("rel", "t5")).main.source
    assert main.count("T.atomic_add(dC_rel[by, T.max(T.min(") == 1
    assert 'tg1 = T.alloc_shared((32,), "float32")' in main
    assert main.count("T.atomic_add(tg1[") == 1
    assert main.count("T.atomic_add(dC_t5[by, t], tg1[t])") == 1
    assert "dg_part" not in main
    mod.deterministic = True
    assert "table lookup" in mod.backward_problem(("rel",))

