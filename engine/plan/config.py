"""KernelConfig, the config of every attention kernel kind, and the H100 facts their validity
models share (shared memory, registers, TileLang's warp partition of a gemm).

Each kind's validity model (engine/kernels/<kind>/plan.py) answers "can this config compile and
run on an H100 for this problem?" before anything is compiled, from the tile sizes alone. The
tuner uses it as Optuna's constraint and to prune; the engine uses it to reject a bad config
with a clear message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GEMM_POLICIES = ("FullRow", "FullCol", "Square")
# The forward's schedules: TileLang's automatic pipeline, or the explicit warp-specialised one
# (engine/kernels/attention_fwd/ws.py) whose warpgroups run one key block's softmax while the
# tensor cores run the next block's Q K^T and this block's P V ("overlap"), and with
# "pingpong" also take turns issuing their gemms (FlashAttention-3's two overlaps).
SCHEDULES = ("auto", "overlap", "pingpong")

# H100 SXM: 227 KiB of shared memory per block (opt-in), 64 Ki 32-bit registers per SM,
# 255 registers per thread at most.
SMEM_LIMIT_BYTES = 227 * 1024
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 64 * 1024
# Streaming multiprocessors of an H100 SXM (and H200): the thread blocks of one wave.
H100_SMS = 132
# The K and V bytes one section of a persistent walk's heads may read (walk.py): as many
# heads as fit two thirds of the H100's 50 MB L2. Against 2 MB (one head a section past 1k),
# timed as attnbench times (same process, interleaved; NOTES 118): causal D 128 at 2k and 4k
# 12% and 4% faster, at 16k within noise; an earlier sweep had 2 MB 5% ahead at 8k, within
# the spread of those power-capped rows.
L2_SECTION_BYTES = 32 * 1024 * 1024


# Warp-specialised kernels written out explicitly (the backward's and the forward's
# schedules): a producer warpgroup that keeps few registers beside the consumers.
WS_PRODUCER_THREADS = 128
WS_PRODUCER_REGS = 24
WS_CONSUMER_REGS = 240


REGISTERS_PER_SM = 64 * 1024
MAX_REGISTERS_PER_THREAD = 255


def consumer_register_cap(threads: int, blocks: int = 1) -> int:
    """Registers per consumer thread under TileLang's warp specialisation (a producer warpgroup
    of 24 registers per thread beside `threads` consumer threads, `blocks` blocks resident on
    an SM): what the warp-specialised kernels set with `set_max_nreg`. setmaxnreg draws on a
    pool per CTA (PTX ISA), filled with what the block launched with (the launch bounds' share
    of the SM's 64 Ki, in multiples of 8 a thread) and what its producers release: a consumer
    asking for more waits for ever (TileLang's 240 at two blocks: results/NOTES.md 202, 205).
    At one block this gives TileLang's own 240 (256 threads) and 160 (384)."""
    total = threads + WS_PRODUCER_THREADS
    launch = min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (blocks * total)) // 8 * 8
    share = (launch * total - WS_PRODUCER_THREADS * WS_PRODUCER_REGS) // threads
    return min(WS_CONSUMER_REGS, share // 8 * 8)  # setmaxnreg takes multiples of 8


def warp_partition(
    M: int, N: int, num_warps: int, policy: str, wgmma: bool = True
) -> tuple[int, int] | None:
    """(m_warp, n_warp) by which TileLang 0.1.15 splits an [M x N] gemm tile over `num_warps`
    warps (cuda/op/gemm.cc), or None where it refuses to lower ("No valid warp partition").

    Each warp owns a multiple of 16 rows and 8 columns; with wgmma, warps come in groups of 4
    along M (a warpgroup owns 64-row slabs). FullRow takes the most warps along M, FullCol the
    most along N, Square the split whose per-warp tile is closest to the tile's aspect ratio.
    """
    group = 4 if wgmma else 1
    if num_warps < 1 or num_warps % group or M % 16 or N % 8:
        return None

    def ok(m: int, n: int) -> bool:
        return m % group == 0 and M % (m * 16) == 0 and N % (n * 8) == 0

    splits = [(m, num_warps // m) for m in range(1, num_warps + 1) if num_warps % m == 0]
    splits = [(m, n) for m, n in splits if ok(m, n)]
    if not splits:
        return None
    if policy == "FullRow":
        return max(splits)
    if policy == "FullCol":
        return min(splits)
    if policy == "Square":
        # Ties go to the smallest m_warp, as TileLang scans m upwards with a strict '<'.
        ideal = M / N
        return min(splits, key=lambda s: (abs((M / (s[0] * 16)) / (N / (s[1] * 8)) - ideal), s[0]))
    return None


class ConfigError(ValueError):
    """A KernelConfig that cannot compile or run for the problem it was asked for."""


def config_from_dict(cls: type, data: dict):
    """A config dataclass from its fields by name (tune files, search spaces); ConfigError
    naming unknown fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(
            f"{cls.__name__}: unknown field(s) {sorted(unknown)}; known: {sorted(names)}"
        )
    return cls(**data)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and pipeline of one kernel launch.

    block_M: query rows per thread block; block_N: keys per inner-loop step; num_stages:
    depth of the K/V shared-memory pipeline; threads: consumer threads per block (a producer
    warpgroup is added by TileLang's warp specialisation); gemm_policy: how warps split the
    score tile; swizzle_panel: rasterisation panel width in blocks (0 disables rasterisation);
    schedule: the forward's pipeline (SCHEDULES; the other kinds take "auto"); persistent:
    the forward's warp-specialised schedules with one thread block per SM walking the tiles
    in turn, so that the producer loads the next tile while the consumers finish this one
    (the other kinds take False).
    """

    block_M: int = 128
    block_N: int = 128
    num_stages: int = 2
    threads: int = 256
    gemm_policy: str = "FullRow"
    swizzle_panel: int = 0
    schedule: str = "auto"
    persistent: bool = False

    def to_dict(self) -> dict:
        # The schedule and persistence only where they are not the defaults: tune files
        # written before they existed read back as they were written.
        data = dataclasses.asdict(self)
        if self.schedule == "auto":
            del data["schedule"]
        if not self.persistent:
            del data["persistent"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        return config_from_dict(cls, data)

    def key(self) -> str:
        return (
            f"M{self.block_M}_N{self.block_N}_s{self.num_stages}_t{self.threads}"
            f"_{self.gemm_policy}_sw{self.swizzle_panel}"
            + ("" if self.schedule == "auto" else f"_{self.schedule}")
            + ("_persistent" if self.persistent else "")
        )
