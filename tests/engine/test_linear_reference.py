"""The linear-attention references (engine.reference.linear) in float64: the chunked
algorithm against the step-by-step recurrence for outputs, final states and gradients, with
head broadcast, tails shorter than a chunk, initial states and packed sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.reference.linear import chunked, naive_recurrence

F64 = torch.float64


def _inputs(B=2, HQ=2, HK=1, H=4, T=100, D=8, Dv=6, N=None, seed=0, state=True,
            grad=False, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    out = {
        "q": torch.randn(B, HQ, T, D, generator=gen, dtype=dtype),
        "k": torch.randn(B, HK, T, D, generator=gen, dtype=dtype),
        "v": torch.randn(B, H, T, Dv, generator=gen, dtype=dtype),
        "g": F.logsigmoid(torch.randn(B, H, T, generator=gen, dtype=dtype) + 2),
        "initial_state": (torch.randn(B if N is None else N, H, D, Dv, generator=gen,
                                      dtype=dtype) if state else None),
    }
    if grad:
        for t in out.values():
            if t is not None:
                t.requires_grad_(True)
    return out


def _grads(fn, inp, seed=1):
    o, h = fn(**inp)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + \
        (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    names = [n for n, t in inp.items() if t is not None and t.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [inp[n] for n in names]), strict=True))


HEADS = [(1, 1, 4), (2, 1, 4), (4, 4, 4), (2, 4, 4)]  # (HQ, HK, H): Mamba2, GQA-like, MHA


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("state", [False, True])
def test_chunked_matches_naive(heads, state):
    HQ, HK, H = heads
    inp = _inputs(HQ=HQ, HK=HK, H=H, T=100, state=state)
    o1, h1 = naive_recurrence(**inp)
    o2, h2 = chunked(**inp, chunk_size=32)  # 100 = 3 chunks and a tail of 4
    assert o2.dtype == h2.dtype == F64 and o2.shape == (2, H, 100, 6)
    assert h2.shape == (2, H, 8, 6)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h2, h1, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads", [(1, 1, 4), (2, 4, 4)])
def test_chunked_gradients_match_naive(heads):
    HQ, HK, H = heads
    inp = _inputs(HQ=HQ, HK=HK, H=H, T=70, grad=True)
    want = _grads(naive_recurrence, inp)
    got = _grads(lambda **a: chunked(**a, chunk_size=16), inp)
    assert sorted(got) == ["g", "initial_state", "k", "q", "v"]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-9, msg=n)


def test_chunked_gradcheck():
    inp = _inputs(B=1, HQ=1, HK=1, H=2, T=7, D=3, Dv=2, grad=True)
    names = list(inp)

    def f(*xs):
        return chunked(**dict(zip(names, xs, strict=True)), chunk_size=3)

    assert torch.autograd.gradcheck(f, tuple(inp.values()))


def test_gradcheck_packed():
    inp = _inputs(B=1, HQ=1, HK=1, H=2, T=9, D=3, Dv=2, N=3, grad=True)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    names = list(inp)

    def f(*xs):
        return chunked(**dict(zip(names, xs, strict=True)), cu_seqlens=cu, chunk_size=2)

    assert torch.autograd.gradcheck(f, tuple(inp.values()))


def test_final_state_is_the_closed_form():
    inp = _inputs(B=1, HQ=1, HK=1, H=2, T=40)
    _, h = chunked(**inp, chunk_size=16)
    q, k, v, g, h0 = inp.values()
    G = g.cumsum(-1)
    want = G[..., -1, None, None].exp() * h0 + torch.einsum(
        "bht,bhtd,bhte->bhde", (G[..., -1:] - G).exp(), k.expand(-1, 2, -1, -1), v)
    torch.testing.assert_close(h, want)


@pytest.mark.parametrize("reference", [naive_recurrence, chunked])
def test_packed_sequences_are_separate_calls(reference):
    lens = [30, 0, 45, 25]  # an empty sequence passes its state through
    cu = torch.tensor([0, 30, 30, 75, 100], dtype=torch.int32)
    inp = _inputs(B=1, T=100, N=4)
    o, h = reference(**inp, cu_seqlens=cu)
    lo = 0
    for n, L in enumerate(lens):
        part = {key: t[:, :, lo:lo + L] for key, t in inp.items() if key != "initial_state"}
        o_n, h_n = reference(**part, initial_state=inp["initial_state"][n:n + 1])
        torch.testing.assert_close(o[:, :, lo:lo + L], o_n)
        torch.testing.assert_close(h[n:n + 1], h_n)
        lo += L


def test_strong_decays_stay_finite():
    # g = -60 per step: exp(G_t - G_s) above the diagonal would be exp(+60 * 63)
    inp = _inputs(B=1, HQ=1, HK=1, H=2, T=128, grad=True)
    with torch.no_grad():
        inp["g"].fill_(-60.0)
    grads = _grads(lambda **a: chunked(**a, chunk_size=64), inp)
    o, h = chunked(**inp)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert all(torch.isfinite(t).all() for t in grads.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_compute_in_float32(dtype):
    inp = _inputs(T=50, dtype=dtype)
    inp["g"] = inp["g"].float()
    inp["initial_state"] = inp["initial_state"].float()
    o, h = chunked(**inp, chunk_size=16)
    assert o.dtype == dtype and h.dtype == torch.float32
    want, _ = naive_recurrence(**{n: t.double() for n, t in inp.items()})
    err = (o.double() - want).norm() / want.norm()
    assert err < 1e-2


def test_head_counts_must_divide():
    inp = _inputs(HQ=3, HK=1, H=4, state=False)
    with pytest.raises(ValueError, match=r"q: 3 heads do not divide v's 4 heads"):
        chunked(**inp)
