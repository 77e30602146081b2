"""The decode kind's plan: a few new tokens per sequence against a KV cache (contiguous or
paged), split over the keys so that small batches still fill the GPU.

A thread block owns one (batch, kv head, split): its rows are the query heads of that kv
head times the new tokens (GQA packed: every row shares each K/V load), padded to a 64- or
128-row tile for the tensor cores. The key range a batch's rows can see (the cache length,
and the mask's affine bounds, engine.mask.key_range) is cut into `splits` equal runs of key
blocks at run time; the splits' partial results merge in a second kernel by the normaliser's
merge rule (engine.ir.merge). With one split the kernel normalises and writes O itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.ir.merge import TracedMerge
from engine.ir.spec import TracedSpec
from engine.mask.key_range import KeyRange, key_range
from engine.plan.config import H100_SMS, SMEM_LIMIT_BYTES, ConfigError, config_from_dict
from engine.problem import Problem

MAX_SPLITS = 64  # the merge walks the splits serially per row
MIN_CHUNK = 8  # auto_splits' shortest split, in key blocks


@dataclass(frozen=True)
class DecodeConfig:
    """block_N: keys per step; num_stages: K/V pipeline depth; num_splits: key splits per
    (batch, kv head), 0 = chosen from the SM count and the cache (DecodePlan)."""

    block_N: int = 128
    num_stages: int = 2
    num_splits: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DecodeConfig:
        return config_from_dict(cls, data)

    def key(self) -> str:
        return f"N{self.block_N}_s{self.num_stages}_sp{self.num_splits}"


@dataclass(frozen=True, kw_only=True)
class DecodeShape(Problem):
    """The problem (seqlen_q: new tokens per sequence, seqlen_kv: the cache's capacity per
    sequence) in `dtype`, with the cache's paging (page_size 0: contiguous [B, cap, Hkv, D];
    else [num_pages, page_size, Hkv, D] with a [B, cap // page_size] block table)."""

    dtype: str
    page_size: int = 0
    num_pages: int = 0

    @property
    def rows(self) -> int:
        return self.groups * self.seqlen_q

    @property
    def dim_sizes(self) -> dict[str, int]:
        return self.named_sizes()

    @property
    def max_pages(self) -> int:
        return self.seqlen_kv // self.page_size if self.page_size else 0


def block_m(rows: int) -> int:
    return 64 if rows <= 64 else 128


def estimate_smem(cfg: DecodeConfig, rows: int, head_dim: int, head_dim_v: int,
                  elem_bytes: int = 2) -> int:
    bM = block_m(rows)
    return elem_bytes * (bM * head_dim + cfg.num_stages * cfg.block_N * (head_dim + head_dim_v)
                         + bM * head_dim_v)


def config_problems(cfg: DecodeConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                    rows: int = 64) -> list[str]:
    """Every reason `cfg` is invalid (empty: valid)."""
    out = []
    if cfg.block_N not in (32, 64, 128, 256):
        out.append(f"block_N={cfg.block_N}: expected 32, 64, 128 or 256")
    if not 1 <= cfg.num_stages <= 4:
        out.append(f"num_stages={cfg.num_stages}: expected 1..4")
    if not 0 <= cfg.num_splits <= MAX_SPLITS:
        out.append(f"num_splits={cfg.num_splits}: expected 0 (auto) to {MAX_SPLITS}")
    if head_dim % 16 or head_dim_v % 16:
        out.append(f"head dims {head_dim}/{head_dim_v}: expected multiples of 16")
    smem = estimate_smem(cfg, rows, head_dim, head_dim_v, elem_bytes)
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {smem // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB "
                   f"(block_N={cfg.block_N}, num_stages={cfg.num_stages}, D={head_dim}, "
                   f"Dv={head_dim_v})")
    # The accumulators: [bM, block_N] scores and [bM, Dv] output in fp32 over 128 threads
    # per 64 rows; beyond about 200 registers per thread ptxas spills.
    if (cfg.block_N + head_dim_v) // 2 > 200:
        out.append(f"block_N={cfg.block_N} with Dv={head_dim_v}: accumulators need "
                   f"{(cfg.block_N + head_dim_v) // 2} registers per thread (> 200)")
    return out


# Preference: 128-key blocks, two stages (the K/V loads of the next block in flight while
# this one's scores run); smaller blocks as the head dims grow (D = 256: 64 keys).
PREFERENCE = (DecodeConfig(128, 2), DecodeConfig(64, 2), DecodeConfig(64, 1), DecodeConfig(32, 1))


def default_decode_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                          spec: TracedSpec | None = None, rows: int = 64) -> DecodeConfig:
    for cfg in PREFERENCE:
        if not config_problems(cfg, head_dim, head_dim_v, elem_bytes, rows):
            return cfg
    raise ValueError(f"no valid decode config for D={head_dim}, Dv={head_dim_v}")


@dataclass(frozen=True)
class DecodePlan:
    """Everything the decode generators decide from: tile rows, splits, the key range, the
    paging, and whether the merge exists (None: one split)."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    m_tiles: int
    splits: int
    keys: KeyRange
    merge: TracedMerge | None
    page_size: int
    chunk: int  # key blocks per split (the last split of a sequence may have fewer)

    @property
    def pages_per_block(self) -> int:
        """Pages one key block spans (a block smaller than a page reads part of one: 1)."""
        return max(1, self.block_N // self.page_size) if self.page_size else 0


def key_blocks(shape: DecodeShape, block_N: int, keys: KeyRange) -> int:
    """The most key blocks one sequence's rows can need: the capacity's, or a window's (a
    window may start mid-block: one more)."""
    span = keys.span(shape.seqlen_q)
    if span is None or span >= shape.seqlen_kv:
        return -(-shape.seqlen_kv // block_N)
    return min(-(-span // block_N) + 1, -(-shape.seqlen_kv // block_N))


def auto_splits(shape: DecodeShape, cfg: DecodeConfig, keys: KeyRange, m_tiles: int,
                sm_count: int) -> int:
    """The fewest splits, a power of two, whose thread blocks fill every slot of the GPU once
    (SMs times the blocks one SM holds by shared memory), with no split shorter than
    MIN_CHUNK key blocks. On the H100 (scripts/decode_sweep.py, NOTES 57) fewer splits left
    SMs idle (B 1, 128k: 17 splits on 8 kv heads ran 2.37 TB/s, 32 splits 2.90) and more
    cost the merge and short runs (B 64, 4k: 16 splits 2.74 TB/s against one split's 3.00);
    between the two the rate was flat within 2%."""
    per_sm = max(1, SMEM_LIMIT_BYTES // estimate_smem(cfg, shape.rows, shape.head_dim,
                                                      shape.head_dim_v))
    blocks = shape.batch * shape.heads_kv * m_tiles
    want = -(-sm_count * per_sm // blocks)
    most = max(1, min(MAX_SPLITS, key_blocks(shape, cfg.block_N, keys) // MIN_CHUNK))
    return min(1 << (want - 1).bit_length(), most)


def paged_config(cfg: DecodeConfig, page_size: int) -> DecodeConfig:
    """Pages shorter than a key block: pages of 64 keys or more become the key block (one TMA
    copy each); shorter ones are gathered element-wise, which TileLang 0.1.15 only compiles
    unpipelined (two stages fail in its cp.async lowering with a runtime trip count)."""
    if not page_size or page_size >= cfg.block_N:
        return cfg
    if page_size >= 64:
        return dataclasses.replace(cfg, block_N=page_size)
    return dataclasses.replace(cfg, num_stages=1)


def plan_decode(spec: TracedSpec, shape: DecodeShape, cfg: DecodeConfig,
                merge: TracedMerge | None, sm_count: int = H100_SMS) -> DecodePlan:
    problems = config_problems(cfg, shape.head_dim, shape.head_dim_v, 2, shape.rows)
    if shape.page_size:
        if shape.page_size % 16 or (shape.page_size % cfg.block_N
                                    and cfg.block_N % shape.page_size):
            problems.append(f"page_size={shape.page_size}: expected a multiple of 16 that "
                            f"divides or is a multiple of block_N={cfg.block_N}")
    if problems:
        raise ConfigError(f"invalid DecodeConfig {cfg.key()}: " + "; ".join(problems))
    cfg = paged_config(cfg, shape.page_size)
    bM = block_m(shape.rows)
    m_tiles = -(-shape.rows // bM)
    keys = key_range(spec.mask)
    splits = cfg.num_splits or auto_splits(shape, cfg, keys, m_tiles, sm_count)
    if merge is None:
        splits = 1
    nkb = key_blocks(shape, cfg.block_N, keys)
    chunk = -(-nkb // splits)
    splits = -(-nkb // chunk)  # none empty at full length
    return DecodePlan(block_M=bM, block_N=cfg.block_N, num_stages=cfg.num_stages,
                      threads=128 if bM == 64 else 256, m_tiles=m_tiles, splits=splits,
                      keys=keys, merge=merge if splits > 1 else None,
                      page_size=shape.page_size, chunk=chunk)
