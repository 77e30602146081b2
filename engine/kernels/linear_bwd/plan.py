"""The chunked backward's choices beyond its LinearConfig (the forward's plan holds that)."""

from __future__ import annotations

from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.plan import (
    LinearConfig,
    LinearShape,
    more_blocks_at_one_stage,
    scores_in_fragment,
)
from engine.plan.config import SMEM_LIMIT_BYTES


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


def reverse_config(shape: LinearShape, cfg: LinearConfig) -> LinearConfig:
    """The config the reverse single pass runs: the backward config at one load pipeline
    stage where that lets two of its blocks share an SM (its stages are otherwise the dQ/dK
    kernel's too, which gains nothing from one). At one stage it took 483 against 616 us at
    Mamba2-2.7B B 8 x T 2k and 332 against 436 at simple GLA B 8 x T 4k (H200, results/NOTES.md
    209); at D 256 (YOCO-13B) two blocks do not fit either way."""
    return more_blocks_at_one_stage("reverse", shape, cfg)


def dv_min_blocks_per_sm() -> int:
    """The blocks per SM the dV kernel asks ptxas to make room for: two where its At stays
    in registers through the value loop (scores_in_fragment; 141 registers uncapped at
    Mamba2-2.7B's shape, one block an SM), else 1, nothing asked."""
    return 2 if scores_in_fragment("dv") else 1


def dqk_value_stages(shape: LinearShape, cfg: LinearConfig) -> int:
    """The load pipeline depth of the dQ/dK kernel's loop over value tiles (the next tile's
    v, dO and state tiles load while this one's multiply): the config's num_stages, at most
    the number of tiles, at 64-position chunks where the stages fit in shared memory; else
    1, a plain loop. Measured in one run each (H200, results/NOTES.md 160): 603 against 656
    us at simple GLA B 8 x T 4k, 1169 against 1461 at RetNet-6.7B (Dv 512); no change at
    128-position chunks (B 2 x T 16k). The dV and output kernels' loops stay plain: pipelined,
    the dV kernel took 1957 against 1658 us at YOCO-13B, and at 128-position chunks dV 380
    against 309 and the output 396 against 318."""
    stages = min(cfg.num_stages, shape.head_dim_v // cfg.block_V)
    if cfg.chunk != 64 or stages < 2 or dqk_shared_bytes(shape, cfg, stages) > SMEM_LIMIT_BYTES:
        return 1
    return stages


def dqk_shared_bytes(shape: LinearShape, cfg: LinearConfig, stages: int) -> int:
    """The dQ/dK kernel's shared memory: q, k, dA and the decay vectors once, and `stages`
    copies of the v, dO and state tiles S and dS."""
    C, BK, V, e = cfg.chunk, cfg.block_K, cfg.block_V, elem_bytes(shape.dtype)
    return (2 * C * BK + C * C) * e + 4 * (6 * C + cfg.threads) + stages * (2 * C + 2 * BK) * V * e


# Output heads one dQ/dK block walks where they share q and k (dqk_heads_per_block): at
# Mamba2-2.7B B 8 the kernel took 1374 / 1393 us at 4 / 8 heads against 1515 at one (T 2k),
# 5374 / 5365 against 6023 (T 8k; H200, results/NOTES.md 162).
DQK_HEAD_GROUP = 4


def dqk_heads_per_block(shape: LinearShape, cfg: LinearConfig) -> int:
    """How many output heads one dQ/dK block walks, the next head's v, dO, states and decays
    loading (cp.async) while this one's multiply: where every output head reads one q and one
    k head (Mamba2's one B and C, loaded once per block), at one value tile (a loop over value
    tiles inside the heads' loop keeps TileLang from pipelining it) and 64-position chunks (at
    128 the stages pass the shared memory limit and the kernel spills). The largest divisor
    of the heads up to DQK_HEAD_GROUP; else 1, a block per head."""
    if not (shape.heads_q == shape.heads_k == 1 and cfg.block_V == shape.head_dim_v
            and cfg.chunk == 64):
        return 1
    return max(g for g in range(1, DQK_HEAD_GROUP + 1) if shape.heads % g == 0)
