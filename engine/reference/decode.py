"""The reference of decode: a few new query tokens against a KV cache (contiguous or paged),
by the reference executor's forward, on any device.

Row t of batch b sits at position cache_seqlens[b] - Sq + t: `q_idx` in score_mod and mask_mod
is that absolute position, keys are the cache's first cache_seqlens[b] entries, and CustomIO
inputs with a "seq_len" dim are read at t (one entry per new token), "seq_len_kv" ones at the
key's position in the cache.
"""

from __future__ import annotations

import torch

from engine.ir.merge import ONLINE, TracedMerge
from engine.ir.spec import TracedSpec
from engine.problem import Problem
from engine.reference.evaluate import Env, evaluate
from engine.reference.executor import _bhsd, epilogue_rows, forward_rows, online_rows


def to_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A contiguous cache [B, capacity, H, D] as pages [B * pages, page_size, H, D], page
    block_table[b, j] holding positions j * page_size .. (j + 1) * page_size - 1 of sequence
    b (gather_pages' inverse when the table uses every page once)."""
    batch, capacity = cache.shape[:2]
    pages = cache.reshape(batch * block_table.shape[1], capacity // block_table.shape[1],
                          *cache.shape[2:])
    out = torch.empty_like(pages)
    out[block_table.reshape(-1).long()] = pages
    return out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache [num_pages, page_size, H, D] as the contiguous [B, pages * page_size, H, D]
    its block table [B, pages] describes."""
    B, pages = block_table.shape
    page_size = cache.shape[1]
    return cache[block_table.long()].reshape(B, pages * page_size, *cache.shape[2:])


def decode_positions(cache_seqlens: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """[B, 1, Sq, 1]: the absolute position of each new token."""
    lens = cache_seqlens.long().view(-1, 1, 1, 1)
    return lens - seqlen_q + torch.arange(seqlen_q, device=lens.device).view(1, 1, -1, 1)


def decode_forward(
    spec: TracedSpec,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    customs: dict[str, torch.Tensor] | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """o [B, Sq, Hq, Dv] in `dtype` (rows without any unmasked key output zeros)."""
    if block_table is not None:
        k_cache, v_cache = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    prob = Problem.of(q, k_cache, v_cache)
    o, _ = forward_rows(*_rows_args(spec, prob, q, k_cache, v_cache, customs, cache_seqlens,
                                    dtype), **_rows_kwargs(prob, cache_seqlens, q.device))
    return o.transpose(1, 2)


def _rows_args(spec, prob, q, k_cache, v_cache, customs, cache_seqlens, dtype) -> tuple:
    qh = _bhsd(q, 1, dtype)
    kh, vh = _bhsd(k_cache, prob.groups, dtype), _bhsd(v_cache, prob.groups, dtype)
    q_pos = decode_positions(cache_seqlens.to(q.device), prob.seqlen_q)
    return spec, prob, qh, kh, vh, customs or {}, q_pos, prob.seqlen_kv, dtype


def _rows_kwargs(prob: Problem, cache_seqlens: torch.Tensor, device: torch.device) -> dict:
    rows = torch.arange(prob.seqlen_q, device=device).view(1, 1, -1, 1)
    return {"kv_limit": cache_seqlens.to(device).long().view(-1, 1, 1, 1),
            "custom_at": {"q": rows}}


def split_decode_forward(
    spec: TracedSpec,
    merge: TracedMerge,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    customs: dict[str, torch.Tensor] | None,
    cache_seqlens: torch.Tensor,
    *,
    splits: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """decode_forward computed as the split kernels do: the cache cut into `splits` key
    ranges, each walked by the online step alone, the partial results merged by `merge`. It
    checks a merge rule (a user's too) on any device; equal to decode_forward up to rounding."""
    prob = Problem.of(q, k_cache, v_cache)
    args = _rows_args(spec, prob, q, k_cache, v_cache, customs, cache_seqlens, dtype)
    kw = _rows_kwargs(prob, cache_seqlens, q.device)
    per = -(-prob.seqlen_kv // splits)
    parts = [online_rows(*args, **kw, kv_range=(s * per, min((s + 1) * per, prob.seqlen_kv)))
             for s in range(splits)]
    epi = lambda acc, state, seen: epilogue_rows(  # noqa: E731
        spec, prob, acc, state, seen, args[5], args[6], dtype, kw["custom_at"])
    env = Env(dtype=dtype, device=q.device)
    seen = torch.stack([p[2] for p in parts]).any(0)
    if merge.form == ONLINE:
        env.rowscale = {n: torch.cat([p[1][n] for p in parts], -1) for n in spec.online_names}
        w, *merged = evaluate([merge.weight, *(e for _, e in merge.merged)], env)
        o = _weighted(w, [p[0] for p in parts])
        o, _ = epi(o, dict(zip(spec.online_names, merged, strict=True)), seen)
    else:
        done = [epi(*p) for p in parts]
        env.final = {n: torch.cat([f[n] for _, f in done], -1)
                     for n in spec.final_names}
        (w,) = evaluate([merge.weight], env)
        o = _weighted(w, [torch.nan_to_num(o_s, nan=0.0) for o_s, _ in done])
    return torch.where(seen, o, torch.zeros((), dtype=dtype, device=q.device)).transpose(1, 2)


def _weighted(w: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
    """sum over splits s of w[..., s] * outs[s] (w broadcast to [B, H, M, splits])."""
    w = torch.broadcast_to(w, (*outs[0].shape[:3], len(outs)))
    return sum(w[..., s:s + 1] * o for s, o in enumerate(outs))
