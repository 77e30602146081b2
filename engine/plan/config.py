"""KernelConfig and its validity model.

The validity model answers "can this config compile and run on an H100 for this problem?"
before anything is compiled, from the tile sizes alone: shared memory, accumulator registers
per thread and the warp partition TileLang needs for both gemms of the forward template
(S = Q K^T over [block_M x block_N], O += P V over [block_M x head_dim_v]). The tuner uses it
as Optuna's constraint and to prune; the engine uses it to reject a bad config with a clear message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GEMM_POLICIES = ("FullRow", "FullCol", "Square")

# H100 SXM: 227 KiB of shared memory per block (opt-in), 64 Ki 32-bit registers per SM,
# 255 registers per thread at most.
SMEM_LIMIT_BYTES = 227 * 1024
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 64 * 1024
# Registers a consumer thread needs beyond its accumulators (addresses, row scales, loop state).
REG_OVERHEAD = 48


def consumer_register_cap(threads: int) -> int:
    """Registers per consumer thread under TileLang's warp specialisation (a producer warpgroup
    of 24 registers per thread beside the consumers, within 64 Ki registers per SM)."""
    return 240 if threads <= 256 else 160


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


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and pipeline of one kernel launch.

    block_M: query rows per thread block; block_N: keys per inner-loop step; num_stages:
    depth of the K/V shared-memory pipeline; threads: consumer threads per block (a producer
    warpgroup is added by TileLang's warp specialisation); gemm_policy: how warps split the
    score tile; swizzle_panel: rasterisation panel width in blocks (0 disables rasterisation).
    """

    block_M: int = 128
    block_N: int = 128
    num_stages: int = 2
    threads: int = 256
    gemm_policy: str = "FullRow"
    swizzle_panel: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(
                f"KernelConfig: unknown field(s) {sorted(unknown)}; known: {sorted(names)}"
            )
        return cls(**data)

    def key(self) -> str:
        return (
            f"M{self.block_M}_N{self.block_N}_s{self.num_stages}_t{self.threads}"
            f"_{self.gemm_policy}_sw{self.swizzle_panel}"
        )


def estimate_resources(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, extra_tiles: int = 0
) -> dict[str, int]:
    """Shared memory (bytes) and accumulator registers per consumer thread of the forward
    template. `extra_tiles` counts additional float32 [block_M, block_N] fragments a spec
    needs (e.g. a second live score tile)."""
    smem = elem_bytes * (
        cfg.block_M * head_dim  # Q tile
        + cfg.num_stages * cfg.block_N * (head_dim + head_dim_v)  # K and V ring buffers
        + cfg.block_M * head_dim_v  # O staging for the TMA store
    )
    per_thread = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    regs = (
        per_thread(cfg.block_M * cfg.block_N) * (1 + extra_tiles)  # fp32 score tile(s)
        + per_thread(cfg.block_M * cfg.block_N) // 2  # fp16/bf16 copy of P for the PV gemm
        + per_thread(cfg.block_M * head_dim_v)  # fp32 output accumulator
        + REG_OVERHEAD
    )
    return {"smem_bytes": smem, "regs_per_thread": regs}


def config_problems(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, extra_tiles: int = 0
) -> list[str]:
    """Every reason `cfg` is invalid for this problem (empty list: valid)."""
    out: list[str] = []
    if cfg.threads not in (128, 256, 384):
        out.append(f"threads={cfg.threads}: expected 128, 256 or 384 (whole warpgroups)")
    if cfg.gemm_policy not in GEMM_POLICIES:
        out.append(f"gemm_policy={cfg.gemm_policy!r}: expected one of {GEMM_POLICIES}")
    if cfg.block_M not in (64, 128, 192, 256):
        out.append(f"block_M={cfg.block_M}: expected 64, 128, 192 or 256")
    if cfg.block_N not in (32, 64, 96, 128, 160, 176, 192, 256):
        out.append(f"block_N={cfg.block_N}: expected a multiple of 32 up to 256")
    if not 1 <= cfg.num_stages <= 4:
        out.append(f"num_stages={cfg.num_stages}: expected 1..4")
    if cfg.swizzle_panel < 0:
        out.append(f"swizzle_panel={cfg.swizzle_panel}: expected >= 0")
    if cfg.threads in (128, 256, 384) and cfg.gemm_policy in GEMM_POLICIES:
        wgmma = elem_bytes == 2  # bf16/fp16 operands: Hopper wgmma; others: mma.sync
        warps = cfg.threads // 32
        for what, n in (("S = Q K^T", cfg.block_N), ("O += P V", head_dim_v)):
            split = warp_partition(cfg.block_M, n, warps, cfg.gemm_policy, wgmma)
            if split is None:
                out.append(
                    f"{what} [{cfg.block_M}x{n}]: no warp partition for {warps} warps with "
                    f"{cfg.gemm_policy} (each warp owns a multiple of 16 rows and 8 columns"
                    f"{'; warps go along M in groups of 4' if wgmma else ''})"
                )
            elif split[1] != 1:
                # P stays in registers as the A operand of the PV gemm, so each warp must own
                # whole rows of both tiles; a split along N is a layout conflict between the
                # score tile and P at lowering (seen with 64x64, 256 threads, FullRow).
                out.append(
                    f"{what} [{cfg.block_M}x{n}]: {cfg.gemm_policy} splits {warps} warps "
                    f"{split[0]}x{split[1]} (M x N); the template needs every warp along M "
                    f"(block_M a multiple of {16 * warps})"
                )
                break
    if head_dim % 16 or head_dim_v % 16:
        out.append(f"head dims {head_dim}/{head_dim_v}: expected multiples of 16")
    res = estimate_resources(cfg, head_dim, head_dim_v, elem_bytes, extra_tiles)
    if res["smem_bytes"] > SMEM_LIMIT_BYTES:
        out.append(
            f"shared memory {res['smem_bytes'] // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB "
            f"(block_M={cfg.block_M}, block_N={cfg.block_N}, num_stages={cfg.num_stages}, "
            f"D={head_dim}, Dv={head_dim_v})"
        )
    cap = consumer_register_cap(cfg.threads)
    acc = res["regs_per_thread"] - REG_OVERHEAD
    if acc > cap:
        out.append(
            f"accumulators need about {acc} registers per thread > {cap} (the consumer cap with "
            f"threads={cfg.threads}; {cfg.block_M}x{cfg.block_N} scores and {cfg.block_M}x{head_dim_v} "
            f"output)"
        )
    return out


# The masked-block register model. In a partial block the consumer evaluates the mask and the
# score_mod per score element on top of its accumulators; where the accumulators already fill
# the register cap (192 x 128 tiles on 384 threads at D = 128), ptxas spills once that work
# exceeds a plain causal mask. Calibrated with ptxas --resource-usage at D = 128, 192 x 128 on
# 384 threads (ops = TracedSpec.masked_block_ops): causal (2) spills 24 bytes; prefix-LM (4)
# 180, document (4) 542, ALiBi and soft-capping (5) 100-112, sliding window (5) 544; RetNet
# (6) 28, where the model is conservative. At 128 x 128 on 256 threads none spills.
FREE_MASKED_OPS = 2
REGS_PER_MASKED_OP = 8


def masked_body_fits(cfg: KernelConfig, head_dim: int, head_dim_v: int, masked_ops: int,
                     elem_bytes: int = 2) -> bool:
    """Whether a partial block's `masked_ops` elementwise ops fit beside the accumulators."""
    res = estimate_resources(cfg, head_dim, head_dim_v, elem_bytes)
    headroom = consumer_register_cap(cfg.threads) - (res["regs_per_thread"] - REG_OVERHEAD)
    return masked_ops <= FREE_MASKED_OPS + max(0, headroom) // REGS_PER_MASKED_OP


def check_config(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, extra_tiles: int = 0
) -> KernelConfig:
    problems = config_problems(cfg, head_dim, head_dim_v, elem_bytes, extra_tiles)
    if problems:
        raise ConfigError(f"invalid KernelConfig {cfg.key()}: " + "; ".join(problems))
    return cfg
