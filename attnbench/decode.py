"""Decode cases: Sq new query tokens of each sequence against its KV cache.

A decode case is a `Case` of kind "decode": `seqlen_q` is Sq (the new tokens), `seqlen_kv` the
cache capacity per sequence, `ragged` whether the sequences' valid lengths differ, and
`page_size` the paged cache's page size (0: one contiguous cache per sequence). Its inputs
(`make_decode_inputs`), in the layout FlashAttention-3 and vLLM use:

    q              [B, Sq, Hq, D]
    k_cache        [B, capacity, Hkv, D]        or paged [num_pages, page_size, Hkv, D]
    v_cache        [B, capacity, Hkv, Dv]       or paged [num_pages, page_size, Hkv, Dv]
    cache_seqlens  int32 [B]: valid lengths; the new tokens sit at positions len - Sq .. len - 1
                   and are already in the cache
    block_table    int32 [B, capacity // page_size] (paged; pages in a shuffled order), else None

plus the variant's custom tensors, sized for the capacity. Ragged lengths are drawn from a
seeded generator between Sq and the capacity, with both ends present when B >= 2; otherwise
every length is the capacity.

Traffic: `decode_bytes` counts what a decode kernel must move: per sequence the K and V rows it
reads (its valid length, or, under a sliding window of w keys, the w + Sq - 1 keys the new
tokens' windows cover) plus q and o. Masks other than causal and the library's windows count
every valid key. Lengths and page tables are a few hundred bytes and not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnbench.cases import Case
from engine.dtypes import elem_bytes, torch_dtype
from engine.reference.decode import decode_forward, to_pages
from engine.reference.executor import slice_customs
from engine.variants.library import (
    GEMMA2_SOFTCAP,
    GEMMA2_WINDOW,
    MISTRAL_WINDOW,
    SLIDING_WINDOW,
    SOFTCAP,
)

DECODE_TENSORS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table")
# Keys a query at position p may see under the library's windows: p - w < k <= p. Baselines that
# take a window (FA3's window_size) and the traffic count need the number, not the mask.
WINDOWS: dict[str, int] = {
    "sliding_window": SLIDING_WINDOW, "mistral_window": MISTRAL_WINDOW, "gemma2": GEMMA2_WINDOW,
}
SOFTCAPS: dict[str, float] = {"softcap": SOFTCAP, "gemma2": GEMMA2_SOFTCAP}
# Generator offsets from the run's seed: inputs use the seed itself (as attention cases do).
_LENGTHS_SEED, _PAGES_SEED = 2, 3


def cache_lengths(batch: int, capacity: int, seqlen_q: int, ragged: bool,
                  seed: int) -> list[int]:
    """Valid lengths per sequence: the capacity, or (ragged) seeded draws in [Sq, capacity]
    that include Sq and the capacity when batch >= 2 (the edge cases kernels get wrong)."""
    if not ragged or batch < 1:
        return [capacity] * batch
    gen = torch.Generator().manual_seed(seed + _LENGTHS_SEED)
    lengths = torch.randint(seqlen_q, capacity + 1, (batch,), generator=gen)
    if batch >= 2:
        first, last = torch.randperm(batch, generator=gen)[:2].tolist()
        lengths[first], lengths[last] = seqlen_q, capacity
    return lengths.tolist()


def window_of(variant) -> int | None:
    """The variant's sliding window in keys, or None."""
    return WINDOWS.get(variant.name)


def keys_read(length: int, seqlen_q: int, window: int | None) -> int:
    """Keys a decode step of one sequence must read: all valid ones, or the union of the new
    tokens' windows (positions length - Sq - w + 1 .. length - 1)."""
    return length if window is None else min(length, window + seqlen_q - 1)


def attended_pairs(length: int, seqlen_q: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs of one sequence that the mask keeps (the new token at position p sees
    p + 1 keys when causal, min(p + 1, w) under a window, else every valid key)."""
    total = 0
    for p in range(length - seqlen_q, length):
        seen = p + 1 if causal or window is not None else length
        total += seen if window is None else min(seen, window)
    return total


def decode_bytes(case: Case, lengths: list[int], window: int | None) -> float:
    """Bytes a decode step must move: K and V rows read (`keys_read`), q and o."""
    keys = sum(keys_read(n, case.seqlen_q, window) for n in lengths)
    kv = keys * case.heads_kv * (case.head_dim + case.head_dim_v)
    qo = case.batch * case.seqlen_q * case.heads_q * (case.head_dim + case.head_dim_v)
    return float((kv + qo) * elem_bytes(case.dtype))


def decode_flops(case: Case, lengths: list[int], causal: bool, window: int | None) -> float:
    """FLOPs by the ARCHITECTURE.md convention over the pairs actually attended."""
    pairs = sum(attended_pairs(n, case.seqlen_q, causal, window) for n in lengths)
    return 2.0 * case.heads_q * pairs * (case.head_dim + case.head_dim_v)


def case_traffic(case: Case, variant, seed: int) -> tuple[float, float]:
    """(bytes, flops) of a decode case run with `seed` (its lengths depend on it)."""
    lengths = cache_lengths(case.batch, case.seqlen_kv, case.seqlen_q, case.ragged, seed)
    window = window_of(variant)
    return (decode_bytes(case, lengths, window),
            decode_flops(case, lengths, bool(variant.causal), window))


def valid_mask(case: Case, variant, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, Sq, capacity]: the keys each new token may see (valid, and causal or
    windowed as the variant is), for implementations that can only take a dense mask."""
    k = torch.arange(case.seqlen_kv, device=cache_seqlens.device).view(1, 1, 1, -1)
    lens = cache_seqlens.long().view(-1, 1, 1, 1)
    p = lens - case.seqlen_q + torch.arange(case.seqlen_q, device=k.device).view(1, 1, -1, 1)
    keep = k < lens
    if variant.causal:
        keep = keep & (k <= p)
    window = window_of(variant)
    if window is not None:
        keep = keep & (p - k < window)
    return keep.expand(-1, -1, case.seqlen_q, -1)


def page_table(batch: int, capacity: int, page_size: int, seed: int,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """int32 [B, capacity // page_size]: every page of the pool once, in a shuffled order (an
    identity table would hide a kernel that ignores it)."""
    if page_size <= 0 or capacity % page_size:
        raise ValueError(f"page_size={page_size}: expected a positive divisor of the capacity "
                         f"{capacity}")
    pages = capacity // page_size
    gen = torch.Generator().manual_seed(seed + _PAGES_SEED)
    order = torch.randperm(batch * pages, generator=gen)
    return order.view(batch, pages).to(device=device, dtype=torch.int32)


def make_decode_inputs(case: Case, variant, device: str | torch.device,
                       seed: int) -> dict[str, torch.Tensor | None]:
    """The tensors of the module docstring (random normal, never zeros) and the variant's
    custom tensors. Drawn on `device` itself: a 128k-token cache is slow to draw on a CPU."""
    dtype = torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    b, cap, hkv = case.batch, case.seqlen_kv, case.heads_kv

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    out: dict[str, torch.Tensor | None] = {
        "q": randn(b, case.seqlen_q, case.heads_q, case.head_dim),
        "k_cache": randn(b, cap, hkv, case.head_dim),
        "v_cache": randn(b, cap, hkv, case.head_dim_v),
        "cache_seqlens": torch.tensor(
            cache_lengths(b, cap, case.seqlen_q, case.ragged, seed), dtype=torch.int32,
            device=device),
        "block_table": None,
    }
    if case.page_size:
        table = page_table(b, cap, case.page_size, seed, device)
        out.update(k_cache=to_pages(out["k_cache"], table),
                   v_cache=to_pages(out["v_cache"], table), block_table=table)
    sizes = variant.sizes(b, case.heads_q, hkv, case.seqlen_q, cap, case.head_dim,
                          case.head_dim_v)
    customs = variant.custom_tensors(sizes, torch.Generator().manual_seed(seed))
    out.update({n: t.to(device) for n, t in customs.items()})
    return out


def decode_customs(inputs: dict) -> dict[str, torch.Tensor]:
    """The variant's custom tensors among a decode case's inputs."""
    return {n: t for n, t in inputs.items() if n not in DECODE_TENSORS}


def build_module(case: Case, variant, backend: str):
    """The variant's AttentionEngine at an attention or decode case's sizes (decode: q of Sq
    tokens, K/V of the capacity)."""
    return variant.build(
        batch=case.batch, heads_q=case.heads_q, heads_kv=case.heads_kv,
        seqlen_q=case.seqlen_q, seqlen_kv=case.seqlen_kv, head_dim=case.head_dim,
        head_dim_v=case.head_dim_v, dtype=torch_dtype(case.dtype), backend=backend)


def decode_reference(case: Case, variant, inputs: dict,
                     sequences: Sequence[int] | None = None) -> torch.Tensor:
    """o float32 [B, Sq, Hq, Dv] from the engine's decode reference executor (the spec's
    meaning over the valid lengths), which every implementation is checked against; with
    `sequences`, only theirs ([len(sequences), Sq, Hq, Dv], in that order). One sequence at a
    time: the executor widens K and V to float32 per query head, which for a whole batch of
    128k-token caches is tens of GiB."""
    mod = build_module(case, variant, "reference")
    customs = decode_customs(inputs)
    table = inputs["block_table"]
    out = []
    with torch.no_grad():
        for b in range(case.batch) if sequences is None else sequences:
            k, v = inputs["k_cache"], inputs["v_cache"]
            if table is None:  # a paged pool is shared: its table row picks the sequence
                k, v = k[b:b + 1], v[b:b + 1]
            out.append(decode_forward(
                mod.spec, inputs["q"][b:b + 1], k, v,
                slice_customs(customs, mod.custom_io.decls, {"batch": slice(b, b + 1)}),
                inputs["cache_seqlens"][b:b + 1],
                block_table=None if table is None else table[b:b + 1]))
    return torch.cat(out)
