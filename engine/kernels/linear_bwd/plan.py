"""The chunked backward's choices beyond its LinearConfig (the forward's plan holds that)."""

from __future__ import annotations

from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.plan import LinearConfig, LinearShape, value_stages


def shared_heads_by_atomics(shape: LinearShape, deterministic: bool) -> bool:
    """Whether the dQ/dK kernel adds the gradients of a q or k head shared by several output
    heads (Mamba2's one B and C for 80 heads) with float32 atomics into that head, instead of
    writing one float32 gradient per output head for a torch sum after it: that write and
    sum moved 2 x 335 MB per tensor at Mamba2-2.7B B 1 x T 8k (238 of the backward's 2010 us,
    results/NOTES.md 142), while the atomics' target is the shared head's (4 MB, in L2). Not
    in the deterministic mode: the atomics' order, and so the sum's rounding, varies."""
    return shape.shares_heads and not deterministic


def heads_first(shape: LinearShape) -> bool:
    """Whether the dV and dQ/dK kernels' grids run the heads fastest (the blocks in flight then
    cover one chunk's heads) rather than the chunks: where q or k heads are shared (Mamba2's
    one B and C for 80 heads), so that the shared tiles each block loads are the few chunks'
    that L2 holds, and the atomics of shared_heads_by_atomics add into a few chunks of their
    target; chunks first, each head's blocks sweep the whole [B, T, D] of q and k and of the
    float32 target (2 x 34 MB each at Mamba2-2.7B B 8 x T 8k) through the 50 MB L2. The
    atomics gained 12% of forward+backward at B 8 x T 2k and nothing at T 4k and 8k
    (results/NOTES.md 147, 149)."""
    return shape.shares_heads


# The reverse single pass runs two consumer warpgroups whatever its config's threads (the
# config's threads are the dQ/dK kernel's): its serial chunk loop is the bound, as in the
# forward's single pass; on one warpgroup (240 registers) it took 564 against 436 us at simple
# GLA B 8 x T 4k (results/NOTES.md 158).
REVERSE_THREADS = 256


def dqk_value_stages(shape: LinearShape, cfg: LinearConfig) -> int:
    """The dQ/dK kernel's: q and k's key tiles, dA and the decay gradient's vectors fixed;
    v, dO, and the states' and their gradients' [block_K, block_V] tiles per value tile."""
    C, BK, V, e = cfg.chunk, cfg.block_K, cfg.block_V, elem_bytes(shape.dtype)
    return value_stages(cfg, shape.head_dim_v, (2 * C * BK + C * C) * e + 4 * (6 * C + cfg.threads),
                        (2 * C + 2 * BK) * V * e)
