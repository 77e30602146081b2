"""Checks of a decode call's cache arguments: shapes, dtypes and devices (always), and the
values of the lengths and the block table (a host synchronisation: on by default, skipped
while a CUDA graph is being captured, where reading values back is not allowed)."""

from __future__ import annotations

import torch

from engine.problem import Problem
from engine.runtime.persistent import capturing


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_cache(name: str, t: torch.Tensor, want: tuple, dtype: torch.dtype,
                 device: torch.device, layout: str) -> None:
    if t.shape != want:
        raise ValueError(f"{name}: shape {tuple(t.shape)}; expected {want} ({layout})")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}; expected {dtype} (from qkv_meta)")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}; expected {device} (the device of q)")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous())")


def check_decode_args(p: Problem, dtype: torch.dtype, q, k_cache, v_cache, cache_seqlens,
                      block_table) -> tuple[int, int]:
    """(page_size, num_pages) of the cache (0, 0: contiguous); ValueError/TypeError naming
    the argument that does not fit the module's problem. (Written for a decode step's host
    time: it runs on every step.)"""
    _tensor("q", q)
    _tensor("k_cache", k_cache)
    _tensor("v_cache", v_cache)
    dev = q.device
    _check_cache("q", q, (p.batch, p.seqlen_q, p.heads_q, p.head_dim), dtype, dev,
                 "[B, Sq, Hq, D] from qkv_meta")
    lens = _tensor("cache_seqlens", cache_seqlens)
    if lens.shape != (p.batch,) or lens.dtype != torch.int32 or lens.device != dev:
        raise ValueError(f"cache_seqlens: {lens.dtype} {tuple(lens.shape)} on {lens.device}; "
                         f"expected torch.int32 ({p.batch},) on {dev}")
    if block_table is None:
        _check_cache("k_cache", k_cache, (p.batch, p.seqlen_kv, p.heads_kv, p.head_dim), dtype,
                     dev, "[B, capacity, Hkv, D] from qkv_meta's k and v")
        _check_cache("v_cache", v_cache, (p.batch, p.seqlen_kv, p.heads_kv, p.head_dim_v),
                     dtype, dev, "[B, capacity, Hkv, D] from qkv_meta's k and v")
        return 0, 0
    bt = _tensor("block_table", block_table)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)}; expected a paged cache "
                         "[num_pages, page_size, Hkv, D] with block_table")
    num_pages, page_size = k_cache.shape[:2]
    if page_size < 1 or p.seqlen_kv % page_size:
        raise ValueError(f"k_cache: page_size {page_size} must divide the capacity "
                         f"{p.seqlen_kv} (qkv_meta's k length)")
    want_bt = (p.batch, p.seqlen_kv // page_size)
    if tuple(bt.shape) != want_bt or bt.dtype != torch.int32 or bt.device != dev:
        raise ValueError(f"block_table: {bt.dtype} {tuple(bt.shape)} on {bt.device}; expected "
                         f"torch.int32 {want_bt} on {dev} (capacity / page_size pages per "
                         "sequence)")
    for name, t, d in (("k_cache", k_cache, p.head_dim), ("v_cache", v_cache, p.head_dim_v)):
        _check_cache(name, t, (num_pages, page_size, p.heads_kv, d), dtype, dev,
                     "[num_pages, page_size, Hkv, D]")
    return page_size, num_pages


def check_decode_values(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                        seqlen_q: int, capacity: int, page_size: int, num_pages: int) -> None:
    """ValueError for a length outside [Sq, capacity] or a page index outside the cache
    (skipped while a CUDA graph is captured; the kernels clamp instead)."""
    if capturing(cache_seqlens.device):
        return
    lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
    if lo < seqlen_q or hi > capacity:
        raise ValueError(f"cache_seqlens: values {lo}..{hi}; expected {seqlen_q}..{capacity} "
                         f"(each sequence holds its {seqlen_q} new tokens, within the capacity)")
    if block_table is not None:
        # Only the pages that hold a sequence's keys (serving systems pad the rest).
        used = torch.arange(block_table.shape[1], device=block_table.device).view(1, -1) < \
            (cache_seqlens.view(-1, 1) + page_size - 1) // page_size
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])}: a page the "
                             f"sequence uses must be in 0..{num_pages - 1} (the cache's pages)")
