"""The chunked linear-attention kinds' plan (forward here, backward in linear_bwd): shapes,
the config and its validity model.

The sequence is cut into chunks of `chunk` positions. A state pass walks each (sequence,
head)'s chunks in order, one thread block per (value tile, key tile) of the [D, Dv] state,
and stores the state entering every chunk; the output (and the backward's gradient) kernels
then run one thread block per (chunk, head), all chunks at once. Chunks are numbered by slot:
the launcher's tables (launch.chunk_tables) give each slot its batch row, first position and
length, so equal-length batches and packed sequences (cu_seqlens) run the same kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from engine.dtypes import elem_bytes
from engine.plan.config import (
    SMEM_LIMIT_BYTES,
    ConfigError,
    config_from_dict,
    consumer_register_cap,
)
from engine.problem import LinearProblem

CHUNKS = (64, 128)
TILES = (32, 64, 128, 256)


@dataclass(frozen=True)
class LinearConfig:
    """chunk: positions per chunk; block_K, block_V: the state tile a state-pass block owns
    ([block_K, block_V] of [D, Dv]); block_V is also the output kernels' value tile (they loop
    over Dv in block_V steps); num_stages: the load pipeline depth of the state passes' chunk
    loops and of the dQ/dK kernel's value-tile loop (linear_bwd.plan.dqk_value_stages);
    threads: threads per block. single_pass: the forward is one kernel that keeps each
    block's [D, block_V] state slice in registers (else the state pass stores every chunk's
    state for the output kernel), and the backward's reverse state pass and dV kernel are one
    kernel in the same way (linear_bwd.reverse); the backward still recomputes the states
    with the state pass for its dQ/dK kernel unless the forward kept them."""

    chunk: int = 64
    block_K: int = 64
    block_V: int = 64
    num_stages: int = 2
    threads: int = 128
    single_pass: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LinearConfig:
        return config_from_dict(cls, data)

    def key(self) -> str:
        return (f"C{self.chunk}_K{self.block_K}_V{self.block_V}_s{self.num_stages}_"
                f"t{self.threads}" + ("_1p" if self.single_pass else ""))

    @classmethod
    def from_key(cls, key: str) -> LinearConfig:
        """The config whose key() is `key` (as kernel headers and results name them)."""
        m = _KEY.fullmatch(key)
        if m is None:
            raise ConfigError(f"LinearConfig key {key!r}: expected the form "
                              "C64_K128_V64_s2_t256, with _1p for the single pass")
        c, k, v, s, t, one = m.groups()
        return cls(int(c), int(k), int(v), int(s), int(t), one is not None)


_KEY = re.compile(r"C(\d+)_K(\d+)_V(\d+)_s(\d+)_t(\d+)(_1p)?")


@dataclass(frozen=True)
class Folds:
    """Mods the forward kernels apply themselves, so that no pass over q or v runs first:
    q_scale, a q mod that is a constant (o is linear in q: the output is scaled); v_weight, a
    v mod that is v times a per-position factor w[b, h, t] (Mamba2's dt), which multiplies
    each key position's decay factor in the chunk's scores and in the state update."""

    q_scale: float = 1.0
    v_weight: bool = False

    def note(self) -> str:
        """The kernel header's mention of the folds (none: the sources are unchanged)."""
        return ((f" q_scale={self.q_scale!r}" if self.q_scale != 1.0 else "")
                + (" v_weight" if self.v_weight else ""))


NO_FOLDS = Folds()


@dataclass(frozen=True)
class LinearShape(LinearProblem):
    """A call's sizes (q [B, heads_q, T, D], k [B, heads_k, T, D], v [B, heads, T, Dv]) in
    `dtype`; `sequences` the number of packed sequences (cu_seqlens given, batch 1) or 0
    (batch rows of length T)."""

    dtype: str
    sequences: int = 0

    @property
    def num_seqs(self) -> int:
        return self.sequences or self.batch

    @property
    def shares_heads(self) -> bool:
        """Whether several output heads read one q or k head (Mamba2's one B and C)."""
        return self.heads_q != self.heads or self.heads_k != self.heads

    def slots(self, chunk: int) -> int:
        """Chunk slots: every chunk of every sequence fits (a packed sequence adds at most one
        partial chunk)."""
        per_row = -(-self.seqlen // chunk)
        return per_row + self.sequences if self.sequences else self.batch * per_row

    def key(self) -> str:
        return (f"B{self.batch}_H{self.heads_q}x{self.heads_k}x{self.heads}_T{self.seqlen}_"
                f"D{self.head_dim}x{self.head_dim_v}_{self.dtype}_n{self.sequences}")


def state_pass_smem_bytes(cfg: LinearConfig, elem: int) -> int:
    """The state pass's shared memory: each pipeline stage's k and v tiles and decay sums, the
    decayed v tile and the state tile it stores from."""
    C, K, V = cfg.chunk, cfg.block_K, cfg.block_V
    return cfg.num_stages * (C * (K + V) * elem + 4 * C) + (C * V + K * V) * elem


def single_pass_smem_bytes(cfg: LinearConfig, head_dim: int, elem: int) -> int:
    """The forward's single pass: each stage's q, k and v tiles beside the chunk's tiles."""
    C, D, V = cfg.chunk, head_dim, cfg.block_V
    return ((2 * C * D + C * V) * cfg.num_stages + 3 * C * V + D * V + C * C) * elem + 12 * C


def reverse_pass_smem_bytes(cfg: LinearConfig, head_dim: int, elem: int) -> int:
    """The backward's reverse single pass: it pipelines dO and (with value weights) v beside
    q and k."""
    C, D, V = cfg.chunk, head_dim, cfg.block_V
    return ((2 * C * D + 2 * C * V) * cfg.num_stages + 2 * C * V + D * V + C * C) * elem + 8 * C


# Whether the kernels mask and decay a chunk's scores (A, At, dA) in their float32 registers
# and then copy them whole to shared memory (stmatrix), rather than storing each element's
# bf16 value as they compute it: those 2-byte stores interleave with the decay sums' shared
# loads, which the compiler then reissues for every element (the output kernel's L1 at 64%
# at Mamba2-2.7B B 1 x T 8k, its DRAM at 20%: results/NOTES.md 214). In registers, H200
# probe (NOTES 216), us: the output kernel 197 against 255 and the dQ/dK kernel 573
# against 677 at Mamba2-2.7B B 1 x T 8k; the single pass 352 against 426, the reverse single
# pass 477 against 508, dQ/dK 1054 against 1156 at B 8 x T 2k; at simple GLA B 8 x T 4k
# 272 against 306, 284 against 331, 524 against 570. The dV kernel keeps the per-element
# stores: its At in registers took 141 against 102 registers, one block an SM, and 373
# against 267 us.
SCORES_IN_FRAGMENT = True
# The dV kernel's At in registers with its blocks held to two an SM (a 128-register cap on
# 256 threads: ptxas, CPU, no spills at Mamba2-2.7B's and simple GLA's shapes). Off until
# measured (NOTES 218).
DV_SCORES_IN_FRAGMENT = False


def scores_in_fragment(kernel: str) -> bool:
    """Whether `kernel` ("output", "single", "dv", "reverse" or "dqk") masks its scores in
    registers (SCORES_IN_FRAGMENT; the dV kernel only with DV_SCORES_IN_FRAGMENT)."""
    return SCORES_IN_FRAGMENT and (kernel != "dv" or DV_SCORES_IN_FRAGMENT)


# Thread blocks per SM that the serial chunk-loop kernels ask ptxas to make room for
# (__launch_bounds__'s second argument, T.annotate_min_blocks_per_sm): the state pass, the
# forward's single pass and the backward's reverse single pass, each where that many blocks'
# shared memory fits. At 1 their 384 threads (TileLang's producer warpgroup beside the 256)
# take 168 registers, so one block holds an SM through its chunk loop; at 2, 80 (consumers
# 104 after the reallocation: consumer_registers) and no spills. On the H200 the state pass
# rerun by the backward took 176 against 232 us at Mamba2-2.7B B 8 x T 2k and 595 against
# 892 at YOCO-13B's D 256 (results/NOTES.md 205).
CHUNK_LOOP_BLOCKS_PER_SM = 2


def blocks_per_sm(kernel: str, shape: LinearShape, cfg: LinearConfig) -> int:
    """CHUNK_LOOP_BLOCKS_PER_SM for `kernel` ("states", "single" or "reverse"), at most as
    many blocks as the SM's shared memory holds (each also keeps 1 KB the hardware
    reserves)."""
    e, D = elem_bytes(shape.dtype), shape.head_dim
    smem = {"states": state_pass_smem_bytes(cfg, e), "single": single_pass_smem_bytes(cfg, D, e),
            "reverse": reverse_pass_smem_bytes(cfg, D, e)}[kernel]
    return max(1, min(CHUNK_LOOP_BLOCKS_PER_SM, SMEM_LIMIT_BYTES // (smem + 1024)))


def consumer_registers(kernel: str, cfg: LinearConfig, blocks: int) -> int:
    """The registers a chunk-loop kernel's consumer threads take after TileLang's reallocation,
    at `blocks` blocks (blocks_per_sm): their share of the SM beside the producer warpgroups
    (TileLang's 240 would hang two resident blocks)."""
    threads = REVERSE_THREADS if kernel == "reverse" else cfg.threads
    return consumer_register_cap(threads, blocks)


def _smem_bytes(cfg: LinearConfig, head_dim: int, elem: int) -> int:
    """The largest of the kernels' shared tiles (the output and gradient kernels hold whole
    [chunk, D] q and k tiles beside [chunk, block_V] and [D, block_V] ones)."""
    C, D, V = cfg.chunk, head_dim, cfg.block_V
    output = (2 * C * D + 2 * C * V + D * V + C * C) * elem + 4 * C
    grads = (2 * C * D + 2 * C * V + 2 * D * V + C * C) * elem + 4 * C
    passes = (single_pass_smem_bytes(cfg, D, elem), reverse_pass_smem_bytes(cfg, D, elem))
    return max(state_pass_smem_bytes(cfg, elem), output, grads,
               max(passes) if cfg.single_pass else 0)


# The single pass's state slice: at most this many fp32 registers per thread.
STATE_REGS = 64


def config_problems(cfg: LinearConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                    spec=None, state_threads: int | None = None) -> list[str]:
    """Every reason `cfg` cannot run at these head dims (empty: valid); `state_threads`: the
    threads that hold a single pass's state slice, where not the config's (the backward's
    reverse single pass, backward_config_problems)."""
    out = []
    if cfg.chunk not in CHUNKS:
        out.append(f"chunk={cfg.chunk}: expected one of {CHUNKS}")
    for name, tile, dim in (("block_K", cfg.block_K, head_dim), ("block_V", cfg.block_V,
                                                                  head_dim_v)):
        if tile not in TILES or dim % tile:
            out.append(f"{name}={tile}: expected one of {TILES} dividing {dim}")
    if cfg.threads not in (128, 256):
        out.append(f"threads={cfg.threads}: expected 128 or 256")
    if cfg.num_stages not in (1, 2, 3):
        out.append(f"num_stages={cfg.num_stages}: expected 1, 2 or 3")
    holders = state_threads or cfg.threads
    if cfg.single_pass and head_dim * cfg.block_V > STATE_REGS * holders:
        out.append(f"single_pass: a [{head_dim}, {cfg.block_V}] fp32 state over {holders} "
                   f"threads is over {STATE_REGS} registers each")
    smem = _smem_bytes(cfg, head_dim, elem_bytes)
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {smem} B > {SMEM_LIMIT_BYTES} B")
    return out


# The reverse single pass runs two consumer warpgroups whatever its config's threads (the
# config's threads are the dQ/dK kernel's): its serial chunk loop is the bound, as in the
# forward's single pass; on one warpgroup (240 registers) it took 564 against 436 us at simple
# GLA B 8 x T 4k (results/NOTES.md 158).
REVERSE_THREADS = 256


def backward_config_problems(cfg: LinearConfig, head_dim: int, head_dim_v: int,
                             elem_bytes: int = 2) -> list[str]:
    """Every reason `cfg` cannot run as a training call's backward config: the forward's
    rules, with a single pass's state slice held by the reverse single pass's REVERSE_THREADS
    (the config's threads are the dQ/dK kernel's), so a 128-thread dQ/dK kernel can sit
    beside the reverse pass at D 256."""
    return config_problems(cfg, head_dim, head_dim_v, elem_bytes,
                           state_threads=REVERSE_THREADS)


def check_config(cfg: LinearConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                 problems_of=config_problems) -> None:
    problems = problems_of(cfg, head_dim, head_dim_v, elem_bytes)
    if problems:
        raise ConfigError(f"LinearConfig {cfg.key()} at D={head_dim}, Dv={head_dim_v}: "
                          + "; ".join(problems))


def default_linear_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2, spec=None
                          ) -> LinearConfig:
    """64-position chunks; state tiles of 128 x 64 where the head dims allow (the state pass
    then reads each value tile once per 128 key columns)."""
    bk = next((t for t in (128, 64, 32) if head_dim % t == 0), None)
    if bk is None or head_dim_v % 32:
        raise ConfigError(f"head_dim={head_dim}, head_dim_v={head_dim_v}: the linear kernels "
                          "take head dims that are multiples of 32")
    bv = 64 if head_dim_v % 64 == 0 else 32
    cfg = LinearConfig(block_K=bk, block_V=bv)
    check_config(cfg, head_dim, head_dim_v, elem_bytes)
    return cfg


def runs_single_pass(shape: LinearShape, cfg: LinearConfig) -> bool:
    """Whether a pass with `cfg` runs as one kernel walking the chunks (the forward's single
    pass, the backward's reverse one): its config says so and its rows are longer than one
    chunk, or packed (their lengths are known on the device only). A single pass whose chunk
    loop ran once gave wrong outputs at T = 1 on the H200 (results/NOTES.md); the two
    kernels have no such loop to pipeline."""
    return cfg.single_pass and (shape.sequences > 0 or shape.seqlen > cfg.chunk)


def one_wave_block_k(shape: LinearShape, cfg: LinearConfig, sm_count: int) -> int:
    """The state pass's key tile: cfg's, halved (down to 64) while its blocks (sequences x
    heads x state tiles, each walking a whole sequence) still fit one wave, counting the
    blocks an SM holds at the halved tile (blocks_per_sm). At B 2 x T 16k, 16 heads, D 128
    (64 blocks at 128 rows) the pass ran 212 us at 64 rows against 270; at 80 heads, where 64
    rows make 160 blocks, 206 against 131 at one block an SM (H100, results/NOTES.md 130), and
    124 against 141 at two (Mamba2-2.7B B 1 x T 8k, H200, NOTES 213)."""
    bk = cfg.block_K
    blocks = shape.num_seqs * shape.heads * (shape.head_dim_v // cfg.block_V)
    while bk > 64:
        half = dataclasses.replace(cfg, block_K=bk // 2)
        per_sm = blocks_per_sm("states", shape, half)
        if blocks * (shape.head_dim // half.block_K) > sm_count * per_sm:
            break
        bk //= 2
    return bk


def config_for_shape(shape: LinearShape, sm_count: int = 132) -> LinearConfig:
    """The forward's default: _chunk_config's, its single pass at one pipeline stage where
    that lets two blocks share an SM (CHUNK_LOOP_BLOCKS_PER_SM): 416 against 526 us at
    Mamba2-2.7B B 8 x T 2k on the H200 (results/NOTES.md 205)."""
    return _forward_config(shape, sm_count, CHUNK_LOOP_BLOCKS_PER_SM)


@functools.lru_cache(maxsize=256)  # asked on every call; `blocks` keys a patched constant
def _forward_config(shape: LinearShape, sm_count: int, blocks: int) -> LinearConfig:
    cfg = _chunk_config(shape, sm_count)
    return more_blocks_at_one_stage("single", shape, cfg) if cfg.single_pass else cfg


def more_blocks_at_one_stage(kernel: str, shape: LinearShape, cfg: LinearConfig
                             ) -> LinearConfig:
    """`cfg` at one load pipeline stage where that lets more of `kernel`'s blocks share an SM
    (blocks_per_sm), else `cfg`: a chunk-loop kernel's serial steps gain more from a second
    block than from a second stage."""
    one = dataclasses.replace(cfg, num_stages=1)
    return one if blocks_per_sm(kernel, shape, one) > blocks_per_sm(kernel, shape, cfg) else cfg


def _chunk_config(shape: LinearShape, sm_count: int = 132, whole_key_tile: bool = False
                  ) -> LinearConfig:
    """The default at this shape (results/NOTES.md 132): with at least one single-pass block
    per SM (sequences x heads x value tiles), the single pass (256 threads: its serial chunk
    loop is the bound, and two warpgroups shorten each step; at D 256 too, where it keeps no
    chunk states in memory: 1.22-1.54x faster than the two kernels on the H100); with fewer,
    the two kernels with 128-position chunks (half the serial steps) and the key tile that
    keeps the state pass in one wave (one_wave_block_k; the whole tile with `whole_key_tile`)
    where they fit; else default_linear_config's."""
    elem = elem_bytes(shape.dtype)
    cfg = default_linear_config(shape.head_dim, shape.head_dim_v, elem)
    two = dataclasses.replace(cfg, chunk=128, threads=256)
    block_k = cfg.block_K if whole_key_tile else one_wave_block_k(shape, two, sm_count)
    tries = [dataclasses.replace(two, block_K=block_k)]
    if shape.num_seqs * shape.heads * (shape.head_dim_v // cfg.block_V) >= sm_count:
        tries.insert(0, dataclasses.replace(cfg, single_pass=True, threads=256))
    for c in tries:
        if not config_problems(c, shape.head_dim, shape.head_dim_v, elem):
            return c
    return cfg


def backward_config_for_shape(shape: LinearShape, sm_count: int = 132) -> LinearConfig:
    """The training call's default backward config: _chunk_config's (its pipeline stages)
    without the halved key tile of one_wave_block_k, which made the forward 1.12x faster at
    B 2 x T 16k but its forward+backward 0.97x (the backward's kernels at 64 key rows; results/NOTES.md 130).
    Beside a single-pass forward, the reverse single pass (linear_bwd.reverse: 436 against the
    two kernels' 549 us at simple GLA B 8 x T 4k, 593 against 664 at Mamba2-2.7B B 8 x T 2k,
    NOTES 158; at D 256 5450 against 6239 us forward+backward at YOCO-13B B 8 x T 2k, NOTES
    197) beside the dQ/dK kernel at 64-row key tiles on 128 threads where no q or k head is
    shared (two or three blocks per SM against one: 681 against 939 us at simple GLA B 8 x
    T 4k), and at the forward's 128 rows on 256 threads where they are (Mamba2: 1507 against
    1664 us at B 8 x T 2k, 3023 against 3335 at T 4k). The backward's rerun of the state
    pass takes the forward's config."""
    cfg = _chunk_config(shape, sm_count, whole_key_tile=True)
    if not cfg.single_pass or shape.shares_heads:
        return cfg
    narrow = dataclasses.replace(cfg, block_K=min(64, cfg.block_K), threads=128)
    if backward_config_problems(narrow, shape.head_dim, shape.head_dim_v,
                                elem_bytes(shape.dtype)):
        return cfg
    return narrow


def training_configs(shape: LinearShape, cfg: LinearConfig, sm_count: int = 132
                     ) -> tuple[LinearConfig, LinearConfig]:
    """The (forward, backward) configs a training call runs for a linear_bwd config `cfg`:
    `cfg` for both passes, except config_for_shape's own, which stands for the untuned
    default pair (its backward backward_config_for_shape's), so that a tuner measures as the
    baseline, and a tune file's "baseline" entry runs, what an untuned call runs."""
    if cfg == config_for_shape(shape, sm_count):
        return cfg, backward_config_for_shape(shape, sm_count)
    return cfg, cfg
