"""Mask analysis against brute force from materialised masks at small sizes, exact unmasked
counts, loop bounds, the cost at 128k, and create_block_mask."""

from __future__ import annotations

import math
import resource
import time

import pytest
import torch

from engine import CustomIO, TraceError, create_block_mask, where
from engine.dsl.expr import index_leaf
from engine.ir.trace import check_result
from engine.mask.analysis import EMPTY, FULL, PARTIAL, classify, count_unmasked

B, H = 2, 3
DOCS = torch.tensor([[0] * 13 + [1] * 40 + [2] * 47, [0] * 61 + [1] * 39])  # Sq = Skv = 100
WIN = torch.tensor([5, 17, 40])  # per-head windows


def _trace(mask_mod, io: CustomIO | None = None):
    b, h, q, kv = (index_leaf(n) for n in ("b", "h", "q", "kv"))
    return check_result(
        "mask_mod",
        "the result",
        mask_mod(b, h, q, kv),
        {"m", "n"},
        io or CustomIO({}),
        dtype="bool",
    )


_IO_DOC = CustomIO({"doc": ("batch", "seq_len")})
_IO_WIN = CustomIO({"win": ("heads",)})


def _doc_mask(b, h, q, kv):
    d = _IO_DOC["doc"]
    return (q >= kv) & (d[b, q] == d[b, kv])


def _doc_torch(b, h, q, kv):
    same = (DOCS[:, :, None] == DOCS[:, None, :]).unsqueeze(1)
    return (q >= kv) & same


_G = torch.Generator().manual_seed(0)
KVALID = torch.rand(B, 100, generator=_G) > 0.3  # key padding per batch
QFLAG = torch.randint(0, 3, (100, B), generator=_G)  # declared ("seq_len", "batch"): reversed order
HLIM = torch.randint(0, 90, (H, 100), generator=_G)  # per (head, query) key limit
_IO_DATA = CustomIO(
    {
        "kvalid": ("batch", "seq_len_kv"),
        "qflag": ("seq_len", "batch"),
        "w": (1,),
        "hlim": ("heads", "seq_len"),
    }
)
_DATA = {
    "kvalid": KVALID.float(),
    "qflag": QFLAG.float(),
    "w": torch.tensor([7.0]),
    "hlim": HLIM.float(),
}


def _data_mask(b, h, q, kv):
    c = _IO_DATA
    return ((c["kvalid"][b, kv] > 0.5) & (c["qflag"][q, b] >= 1) & (q - kv < c["w"][0])) | (
        kv <= c["hlim"][h, q]
    )


def _data_torch(b, h, q, kv):
    kvalid = KVALID[:, None, None, :]
    qflag = (QFLAG.t() >= 1)[:, None, :, None]
    return (kvalid & qflag & (q - kv < 7)) | (kv <= HLIM[None, :, :, None])


# name: (mask_mod, torch mask on broadcast index tensors, io, customs, Sq, Skv, exact)
# exact: interval arithmetic is exact for this mask (each index appears once per comparison).
CASES = {
    "causal": (
        lambda b, h, q, kv: q >= kv,
        lambda b, h, q, kv: q >= kv,
        None,
        None,
        100,
        100,
        True,
    ),
    "causal_sq_ne_skv": (
        lambda b, h, q, kv: q >= kv,
        lambda b, h, q, kv: q >= kv,
        None,
        None,
        70,
        100,
        True,
    ),
    "bottom_right_causal": (
        lambda b, h, q, kv: q + 30 >= kv,
        lambda b, h, q, kv: q + 30 >= kv,
        None,
        None,
        70,
        100,
        True,
    ),
    "sliding_window": (
        lambda b, h, q, kv: (q >= kv) & (q - kv < 20),
        lambda b, h, q, kv: (q >= kv) & (q - kv < 20),
        None,
        None,
        100,
        90,
        True,
    ),
    "prefix_lm": (
        lambda b, h, q, kv: (kv < 24) | (q >= kv),
        lambda b, h, q, kv: (kv < 24) | (q >= kv),
        None,
        None,
        100,
        100,
        True,
    ),
    "not_lower": (
        lambda b, h, q, kv: ~(q < kv),
        lambda b, h, q, kv: ~(q < kv),
        None,
        None,
        100,
        100,
        True,
    ),
    "band_abs": (
        lambda b, h, q, kv: abs(q - kv) <= 10,
        lambda b, h, q, kv: (q - kv).abs() <= 10,
        None,
        None,
        100,
        100,
        True,
    ),
    "head_dependent": (
        lambda b, h, q, kv: (q >= kv) | (h == 1),
        lambda b, h, q, kv: (q >= kv) | (h == 1),
        None,
        None,
        100,
        100,
        True,
    ),
    "batch_dependent": (
        lambda b, h, q, kv: (q >= kv) & (kv >= b * 30),
        lambda b, h, q, kv: (q >= kv) & (kv >= b * 30),
        None,
        None,
        100,
        100,
        True,
    ),
    "document_ids": (_doc_mask, _doc_torch, _IO_DOC, {"doc": DOCS}, 100, 100, False),
    "per_head_window": (
        lambda b, h, q, kv: (q >= kv) & (q - kv < _IO_WIN["win"]),
        lambda b, h, q, kv: (q >= kv) & (q - kv < WIN.view(1, -1, 1, 1)),
        _IO_WIN,
        {"win": WIN},
        100,
        100,
        True,
    ),
    # Not exact (conservative): an index used twice, pow, where, data unknown to the analysis.
    "dependent_index": (
        lambda b, h, q, kv: q * 2 - q >= kv,
        lambda b, h, q, kv: q >= kv,
        None,
        None,
        100,
        100,
        False,
    ),
    "pow": (
        lambda b, h, q, kv: (q - kv).pow(2) < 150.0,
        lambda b, h, q, kv: (q - kv) ** 2 < 150,
        None,
        None,
        100,
        100,
        False,
    ),
    "where": (
        lambda b, h, q, kv: where(q >= 50, q >= kv, kv >= 40),
        lambda b, h, q, kv: torch.where(q >= 50, q >= kv, kv >= 40),
        None,
        None,
        100,
        100,
        False,
    ),
    "data_masks": (_data_mask, _data_torch, _IO_DATA, _DATA, 100, 100, False),
    "document_ids_without_data": (_doc_mask, _doc_torch, _IO_DOC, None, 100, 100, False),
}


def _materialise(torch_mask, Sq, Skv):
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    q, kv = torch.arange(Sq).view(1, 1, -1, 1), torch.arange(Skv).view(1, 1, 1, -1)
    return torch.broadcast_to(torch_mask(b, h, q, kv), (B, H, Sq, Skv))


def _brute(allowed, bM, bN):
    """Classes from the materialised mask; keys past Skv count as masked (a tail kv block that
    runs past Skv is never FULL), query rows past Sq do not exist."""
    _, _, Sq, Skv = allowed.shape
    nqb, nkb = math.ceil(Sq / bM), math.ceil(Skv / bN)
    out = torch.empty(B, H, nqb, nkb, dtype=torch.int8)
    for i in range(nqb):
        for j in range(nkb):
            blk = allowed[:, :, i * bM : (i + 1) * bM, j * bN : (j + 1) * bN]
            inside = (j + 1) * bN <= Skv
            full = blk.flatten(2).all(-1) & inside
            any_ = blk.flatten(2).any(-1)
            out[:, :, i, j] = torch.where(full, FULL, torch.where(any_, PARTIAL, EMPTY)).to(
                torch.int8
            )
    return out


BLOCKS = [(16, 16), (32, 16), (16, 24), (64, 128)]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{m}x{n}" for m, n in BLOCKS])
@pytest.mark.parametrize("case", CASES)
def test_classify_against_brute_force(case, block):
    mask_mod, torch_mask, io, customs, Sq, Skv, exact = CASES[case]
    bM, bN = block
    bc = classify(_trace(mask_mod, io), B, H, Sq, Skv, bM, bN, customs)
    got = bc.classes.expand(B, H, -1, -1)
    want = _brute(_materialise(torch_mask, Sq, Skv), bM, bN)
    assert got.shape == want.shape
    # Conservative: never FULL unless full, never EMPTY unless empty.
    assert not ((got == FULL) & (want != FULL)).any(), "a block that is not full was called FULL"
    assert not ((got == EMPTY) & (want != EMPTY)).any(), (
        "a block with unmasked keys was called EMPTY"
    )
    if exact:
        assert torch.equal(got, want), "affine mask: classification must be exact"
    if case in ("causal", "document_ids", "prefix_lm") and block == (16, 16):  # the test can fail
        assert (want == EMPTY).any() and (want == FULL).any() and (want == PARTIAL).any()


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("case", CASES)
def test_count_unmasked_is_exact(case, block):
    mask_mod, torch_mask, io, customs, Sq, Skv, _ = CASES[case]
    if customs is None and io is not None:
        pytest.skip("counting needs the data")
    got = count_unmasked(_trace(mask_mod, io), B, H, Sq, Skv, customs, block=block)
    assert got == int(_materialise(torch_mask, Sq, Skv).sum())


def test_count_unmasked_without_mask():
    assert count_unmasked(None, 2, 3, 10, 7) == 2 * 3 * 10 * 7


def test_no_mask_is_full_except_the_kv_tail():
    bc = classify(None, B, H, 100, 90, 32, 32)
    assert bc.classes.shape == (1, 1, 4, 3)
    assert (bc.classes[..., :2] == FULL).all() and (bc.classes[..., 2] == PARTIAL).all()
    bc = classify(None, B, H, 100, 96, 32, 32)
    assert (bc.classes == FULL).all()


@pytest.mark.parametrize(
    "case",
    ["causal", "sliding_window", "prefix_lm", "document_ids", "per_head_window", "batch_dependent"],
)
def test_loop_bounds_against_brute_force(case):
    mask_mod, torch_mask, io, customs, Sq, Skv, _ = CASES[case]
    bc = classify(_trace(mask_mod, io), B, H, Sq, Skv, 16, 16, customs)
    lo, hi = (t.expand(B, H, -1) for t in bc.loop_bounds())
    want = _brute(_materialise(torch_mask, Sq, Skv), 16, 16) != EMPTY
    for b in range(B):
        for h in range(H):
            for i in range(want.shape[2]):
                nz = want[b, h, i].nonzero().flatten()
                if len(nz) == 0:
                    assert lo[b, h, i] == hi[b, h, i]
                else:
                    assert (lo[b, h, i].item(), hi[b, h, i].item()) == (
                        nz[0].item(),
                        nz[-1].item() + 1,
                    )
    assert lo.dtype == torch.int32 and hi.dtype == torch.int32


def test_loop_bounds_of_a_fully_masked_row_block():
    bc = classify(_trace(lambda b, h, q, kv: (q >= kv) & (q >= 40)), 1, 1, 64, 64, 16, 16)
    lo, hi = bc.loop_bounds()
    assert torch.equal(lo[0, 0, :2], hi[0, 0, :2])
    assert (lo[0, 0, 2:] == 0).all() and torch.equal(
        hi[0, 0, 2:], torch.tensor([3, 4], dtype=torch.int32)
    )
    assert 0 < bc.density() < 1


@pytest.mark.parametrize("case", ["causal", "sliding_window", "prefix_lm"])
def test_classify_at_128k_is_cheap(case):
    mask_mod = CASES[case][0]
    expr = _trace(mask_mod)
    S = 131072
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    bc = classify(expr, 1, 1, S, S, 128, 128)
    dt = time.perf_counter() - t0
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) / 1024
    assert bc.classes.shape == (1, 1, 1024, 1024)
    assert dt < 2.0, f"classify took {dt:.2f}s at S=128k"
    # An S x S bool tensor would be 16 GiB; block-level tensors are a few MiB each.
    assert grew_mib < 512, f"peak RSS grew {grew_mib:.0f} MiB"
    if case == "causal":
        c = bc.classes[0, 0]
        assert int((c == PARTIAL).sum()) == 1024 and int((c == FULL).sum()) == 1024 * 1023 // 2


def test_count_unmasked_at_64k_without_materialising():
    S = 65536
    t0 = time.perf_counter()
    n = count_unmasked(_trace(CASES["causal"][0]), 1, 1, S, S)
    assert n == S * (S + 1) // 2
    assert time.perf_counter() - t0 < 5.0


# ----------------------------------------------------------------------------- create_block_mask
def test_create_block_mask_counts():
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 1024, 1024)
    assert bm.counts() == {"empty": 28, "partial": 8, "full": 28}
    assert bm.sparsity() == pytest.approx(28 / 64)
    assert "full" in repr(bm) and bm.classes.shape == (1, 1, 8, 8)
    bm2 = create_block_mask(
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 2, 4, 200, 300, BLOCK_SIZE=(64, 32)
    )
    c = bm2.counts()
    assert sum(c.values()) == math.ceil(200 / 64) * math.ceil(300 / 32)
    want = _brute(_materialise(lambda b, h, q, kv: q >= kv, 200, 300), 64, 32)[0, 0]
    assert c == {
        "empty": int((want == EMPTY).sum()),
        "partial": int((want == PARTIAL).sum()),
        "full": int((want == FULL).sum()),
    }


def test_create_block_mask_with_document_ids():
    bm = create_block_mask(
        _doc_mask,
        B,
        H,
        100,
        100,
        BLOCK_SIZE=16,
        custom_fwd_inputs=_IO_DOC,
        custom_tensors={"doc": DOCS},
    )
    want = _brute(_materialise(_doc_torch, 100, 100), 16, 16)
    got = bm.classes.expand(B, H, -1, -1)
    assert (
        not ((got == FULL) & (want != FULL)).any() and not ((got == EMPTY) & (want != EMPTY)).any()
    )
    assert (
        bm.counts()["empty"]
        > create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 100, 100, BLOCK_SIZE=16).counts()[
            "empty"
        ]
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(B=0), r"create_block_mask: B=0: expected a positive int"),
        (dict(Q_LEN=-1), r"create_block_mask: Q_LEN=-1"),
        (dict(KV_LEN=2.5), r"create_block_mask: KV_LEN=2.5"),
    ],
)
def test_create_block_mask_rejects_bad_sizes(kwargs, match):
    args = dict(B=1, H=1, Q_LEN=64, KV_LEN=64) | kwargs
    with pytest.raises(ValueError, match=match):
        create_block_mask(lambda b, h, q, kv: q >= kv, **args)


@pytest.mark.parametrize(
    "mask_mod,match",
    [
        (lambda b, h, q, kv: True, r"mask_mod: returned a Python bool"),
        (lambda b, h, q, kv: q - kv, r"mask_mod: must return a boolean expression"),
        (
            lambda b, h, q, kv: (q >= kv) and (q < 5),
            r"mask_mod: a symbolic expression has no truth value",
        ),
    ],
)
def test_create_block_mask_rejects_bad_mask_mods(mask_mod, match):
    with pytest.raises(TraceError, match=match):
        create_block_mask(mask_mod, 1, 1, 64, 64)
