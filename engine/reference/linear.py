"""Reference executors of the linear-attention core (as fla keeps naive.py beside each op):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = q_t^T S_t,   S_0 = h0 (or 0)

equivalently o_t = sum_{s <= t} (q_t . k_s) exp(G_t - G_s) v_s + q_t exp(G_t) h0 with G the
running sum of g. Layout q [B, HQ, T, D], k [B, HK, T, D], v [B, H, T, Dv], g [B, H, T] (log
decays), h0 [N, H, D, Dv]; output head h reads q head h // (H // HQ), k head h // (H // HK).
With cu_seqlens (int32 [N + 1], B == 1) the T axis packs N sequences, each from its own state.

`naive_recurrence` is the definition step by step; `chunked` is the algorithm the kernels
run (per-chunk states, masked intra-chunk decays), differentiable by autograd, and the
reference backend's core. Plain torch: any device, any float dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in `dtype` with q and k repeated to v's H heads (autograd sums them back)."""
    H = v.shape[1]
    for name, t in (("q", q), ("k", k)):
        if H % t.shape[1]:
            raise ValueError(f"{name}: {t.shape[1]} heads do not divide v's {H} heads")
    q = q.to(dtype).repeat_interleave(H // q.shape[1], dim=1)
    k = k.to(dtype).repeat_interleave(H // k.shape[1], dim=1)
    return q, k, v.to(dtype)


def _per_sequence(core: Core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  g: torch.Tensor, h0: torch.Tensor | None, cu_seqlens: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`core` on each packed sequence of cu_seqlens (or on the whole batch without it): the
    state never crosses a boundary. core(q, k, v, g, h0) -> (o, final state), per-head layout
    [B, H, T, ...] already broadcast and in the compute dtype."""
    dt = compute_dtype(q.dtype)
    q, k, v = _heads(q, k, v, dt)
    g = g.to(dt)
    h0 = None if h0 is None else h0.to(dt)
    if cu_seqlens is None:
        return core(q, k, v, g, h0)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch 1, got {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        o, h = core(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi],
                    None if h0 is None else h0[n:n + 1])
        outs.append(o)
        finals.append(h)
    return torch.cat(outs, dim=2), torch.cat(finals, dim=0)


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    B, H, _, D = q.shape
    return q.new_zeros(B, H, D, v.shape[-1])


def _recurrence(q, k, v, g, h0):
    S = _zero_state(q, v) if h0 is None else h0
    outs = []
    for t in range(q.shape[2]):
        S = g[:, :, t, None, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def naive_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     initial_state: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, T, Dv] in q's dtype, final state [N, H, D, Dv]) by the step-by-step
    recurrence, computed in float32 (float64 for float64 inputs; the state in that dtype)."""
    o, state = _per_sequence(_recurrence, q, k, v, g, initial_state, cu_seqlens)
    return o.to(q.dtype), state


def _masked_decay(G: torch.Tensor) -> torch.Tensor:
    """exp(G_t - G_s) for s <= t, 0 above the diagonal, of chunk-local sums G [..., C]. The
    masked differences are replaced before exp: G_t - G_s > 0 there and may overflow, and
    inf * 0 (or its gradient) would be NaN."""
    C = G.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    diff = G[..., :, None] - G[..., None, :]
    return torch.where(causal, torch.where(causal, diff, 0.0).exp(), 0.0)


def _chunks(chunk_size: int) -> Core:
    def core(q, k, v, g, h0):
        B, H, T, D = q.shape
        if T == 0:  # an empty packed sequence: its state passes through
            return v.new_zeros(v.shape), (_zero_state(q, v) if h0 is None else h0)
        C = chunk_size
        NC = -(-T // C)
        pad = NC * C - T
        # zero k and v add nothing to the state, zero g decays nothing: the padded tail
        # changes neither the outputs nor the final state
        if pad:
            q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
            g = torch.nn.functional.pad(g, (0, pad))
        q, k, v = (x.reshape(B, H, NC, C, x.shape[-1]) for x in (q, k, v))
        G = g.reshape(B, H, NC, C).cumsum(-1)  # chunk-local running sums
        scores = torch.einsum("bhncd,bhnsd->bhncs", q, k) * _masked_decay(G)
        o = torch.einsum("bhncs,bhnse->bhnce", scores, v)
        # the state pass: chunk c reads the state entering it, then adds its own keys
        q_in = q * G[..., None].exp()                     # decay from the chunk start
        k_out = k * (G[..., -1:] - G)[..., None].exp()    # decay to the chunk end (<= 0)
        S = _zero_state(q[:, :, 0], v[:, :, 0]) if h0 is None else h0
        inter = []
        for c in range(NC):
            inter.append(torch.einsum("bhcd,bhde->bhce", q_in[:, :, c], S))
            S = (G[:, :, c, -1, None, None].exp() * S
                 + torch.einsum("bhcd,bhce->bhde", k_out[:, :, c], v[:, :, c]))
        o = o + torch.stack(inter, dim=2)
        return o.reshape(B, H, NC * C, -1)[:, :, :T], S

    return core


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
            chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, T, Dv] in q's dtype, final state [N, H, D, Dv] float32, float64 for float64
    inputs) by the chunked algorithm: within a chunk the masked decay matrix, across chunks
    a state carried per chunk. Differentiable in q, k, v, g and initial_state; T need not be
    a multiple of `chunk_size`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    o, state = _per_sequence(_chunks(chunk_size), q, k, v, g, initial_state, cu_seqlens)
    return o.to(q.dtype), state
