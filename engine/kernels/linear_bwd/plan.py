"""The chunked backward's choices beyond its LinearConfig (the forward's plan holds that)."""

from __future__ import annotations

from math import gcd

from engine.dtypes import elem_bytes
from engine.kernels.linear_fwd.plan import LinearConfig, LinearShape, value_stages
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


# The reverse single pass runs two consumer warpgroups whatever its config's threads (the
# config's threads are the dQ/dK kernel's): its serial chunk loop is the bound, as in the
# forward's single pass; on one warpgroup (240 registers) it took 564 against 436 us at simple
# GLA B 8 x T 4k (results/NOTES.md 158).
REVERSE_THREADS = 256


# The most output heads one dQ/dK block walks (dqk_head_group).
HEAD_GROUP_MAX = 8


def dv_value_stages(shape: LinearShape, cfg: LinearConfig) -> int:
    """The dV kernel's (plan.value_stages): q and k of the chunk, its scores, the dV tile;
    dO, v and dS's tile per value tile."""
    C, D, V, e = cfg.chunk, shape.head_dim, cfg.block_V, elem_bytes(shape.dtype)
    return value_stages(cfg, shape.head_dim_v, (2 * C * D + C * C + C * V) * e + 16 * C,
                        (2 * C * V + D * V) * e)


def _dqk_fixed_bytes(cfg: LinearConfig, elem: int, group: int) -> int:
    """The dQ/dK kernel's shared memory outside its value tiles: q and k's key tiles, dA, the
    decay gradient's vectors and, walking a group of heads, their float32 dQ and dK sums."""
    C, BK = cfg.chunk, cfg.block_K
    sums = 2 * C * BK * 4 if group > 1 else 0
    return (2 * C * BK + C * C) * elem + 4 * (6 * C + cfg.threads) + sums


def _dqk_stage_bytes(cfg: LinearConfig, elem: int) -> int:
    """Its tiles per value tile: v, dO, and the states' and their gradients' [block_K,
    block_V]."""
    return (2 * cfg.chunk + 2 * cfg.block_K) * cfg.block_V * elem


def dqk_value_stages(shape: LinearShape, cfg: LinearConfig, group: int) -> int:
    """The dQ/dK kernel's (plan.value_stages), its blocks walking `group` heads."""
    e = elem_bytes(shape.dtype)
    return value_stages(cfg, shape.head_dim_v, _dqk_fixed_bytes(cfg, e, group),
                        _dqk_stage_bytes(cfg, e))


def dqk_head_group(shape: LinearShape, cfg: LinearConfig, sm_count: int = 132) -> int:
    """How many consecutive output heads each dQ/dK block walks, adding their dQ and dK in
    shared memory before one write (or atomic add) into the q and k heads they share: 1
    where none are shared, else the largest divisor of the heads sharing both (at most
    HEAD_GROUP_MAX) whose sums fit in shared memory beside one stage of value tiles and
    whose grid still fills two waves. Mamba2's 80 heads sharing one B and C otherwise add
    80 float32 dQ and dK tiles into each chunk's by atomics."""
    share = gcd(shape.heads // shape.heads_q, shape.heads // shape.heads_k)
    e = elem_bytes(shape.dtype)
    if share == 1 or _dqk_fixed_bytes(cfg, e, 2) + _dqk_stage_bytes(cfg, e) > SMEM_LIMIT_BYTES:
        return 1
    blocks = shape.head_dim // cfg.block_K * shape.slots(cfg.chunk) * shape.heads
    return max((g for g in range(1, HEAD_GROUP_MAX + 1)
                if share % g == 0 and blocks // g >= 2 * sm_count), default=1)
