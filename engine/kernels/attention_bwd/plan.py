"""The backward kernels' configs: validity models and defaults (the main kernel, and the dQ
kernel of the deterministic mode). The kind's search space and tune files hold the main
kernel's config."""

from __future__ import annotations

from engine.plan.config import (
    GEMM_POLICIES,
    SMEM_LIMIT_BYTES,
    ConfigError,
    KernelConfig,
    consumer_register_cap,
    warp_partition,
)

# Preference order for the main kernel. block_N = keys per thread block (rows of every
# fragment), block_M = queries per inner step. The kernel holds dK and dV [block_N x D]
# accumulators for the whole loop, so block_M stays small: at D = 128 and 256 threads,
# 64 x 128 fits the 240 registers of a consumer (ptxas: no spills), 128 x 128 spills.
PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=64, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=64, num_stages=2, threads=128),
    KernelConfig(block_M=16, block_N=64, num_stages=1, threads=128),
)


def backward_resources(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> dict[str, int]:
    """Shared memory (bytes) and fp32-equivalent accumulator registers per consumer thread of
    the main backward kernel; `n_rows` counts the per-query fp32 vectors (finals, Delta)."""
    bM, bN, st = cfg.block_M, cfg.block_N, cfg.num_stages
    smem = (
        elem_bytes
        * (
            bN * (head_dim + head_dim_v)  # K, V (loaded once)
            + st * bM * (head_dim + head_dim_v)  # Q, dO ring buffers
            + bN * bM  # dS^T staged for the dQ gemm
        )
        + 4 * bM * n_rows
    )
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    # Peak live registers: dK and dV throughout, plus the larger of two phases (ptxas reuses
    # the tiles' registers): the elementwise phase (two live fp32 tiles, S^T/P^T and dP^T,
    # and the 16-bit P^T and dS^T) and the dQ product (with dS^T's 16-bit copy).
    # Checked with ptxas --resource-usage at D = 128: 64x128/256 threads and 64x64/128 threads
    # (model 224) compile without spills; 128x128/256 threads (model 320) spills.
    regs = per(bN * (head_dim + head_dim_v)) + max(
        3 * per(bN * bM),
        per(bM * head_dim) + per(bN * bM) // 2,
    )
    return {"smem_bytes": smem, "regs_per_thread": regs}


# The warp-specialised schedule of the fast backward (codegen.py beside this): a producer
# warpgroup (warp 0 loads Q and dO, warp 1 adds dQ to global memory) beside the consumers.
WS_PRODUCER_THREADS = 128
WS_PRODUCER_REGS = 24
WS_CONSUMER_REGS = 240
WS_CONSUMER_BARRIER = 1  # named barrier id of the consumers' one meeting per step
# Row length (fp32 values) of the schedule's flat dQ tile: its TMA box is DQ_ROW x
# (block_M * head_dim / DQ_ROW), both within TMA's 256 per dimension.
DQ_ROW = 256


# Static shared memory beside the dynamic buffers (the mbarriers; ptxas reports 1 KiB).
WS_STATIC_SMEM = 1024


def ws_shared_bytes(cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                    n_vectors: int = 2) -> int:
    """Shared memory of the warp-specialised schedule: K and V, the Q/dO ring (num_stages,
    with `n_vectors` per-query fp32 vectors: finals, Delta, hoisted custom reads), two-deep
    rings of dS^T (16-bit) and the dQ tile (fp32), and the mbarriers."""
    bM, bN = cfg.block_M, cfg.block_N
    return (elem_bytes * (bN * (head_dim + head_dim_v)
                          + cfg.num_stages * bM * (head_dim + head_dim_v) + 2 * bN * bM)
            + 4 * (2 * bM * head_dim + cfg.num_stages * n_vectors * bM) + WS_STATIC_SMEM)


def ws_schedule_fits(cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                     deterministic: bool = False, n_vectors: int = 2) -> bool:
    """Whether the fast backward at `cfg` uses the warp-specialised schedule: dQ by wgmma in
    whole 64 x 64 tiles (block_M and head_dim multiples of 64), one or two consumer
    warpgroups, and its rings in shared memory. The deterministic mode has no dQ to hand over
    and keeps the automatic pipeline."""
    return (not deterministic and cfg.block_M % 64 == 0 and head_dim % 64 == 0
            and cfg.threads in (128, 256)
            and ws_shared_bytes(cfg, head_dim, head_dim_v, elem_bytes, n_vectors)
            <= SMEM_LIMIT_BYTES)


def split_schedule_fits(cfg: KernelConfig, head_dim: int, head_dim_v: int, n_rows: int,
                        ds_reads_score: bool) -> bool:
    """Whether the main kernel's split schedule (P while dP^T is in flight, dS while dV is) keeps
    within a consumer's registers: in its dS phase dK, dV, P^T, dP^T, the 16-bit P^T still read
    by the dV wgmma, the per-query vectors (finals, Delta: block_M / 4 each per thread) and, when
    dS reads the raw score, S^T are live. Checked with ptxas at D = 128, 64 x 128, 256 threads:
    softmax (two vectors) and sigmoid (S^T, no vectors) estimate 256 and do not spill;
    soft-capping (S^T and two vectors) estimates 288 and spills 588 bytes."""
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    tile = per(cfg.block_N * cfg.block_M)
    live = per(cfg.block_N * (head_dim + head_dim_v)) + 3 * tile + n_rows * (cfg.block_M // 4)
    if ds_reads_score:
        live += tile
    return live <= 256


def backward_config_problems(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> list[str]:
    """Every reason `cfg` is invalid for the main backward kernel (empty list: valid)."""
    out: list[str] = []
    if cfg.threads not in (128, 256, 384):
        out.append(f"threads={cfg.threads}: expected 128, 256 or 384 (whole warpgroups)")
        return out
    if cfg.gemm_policy not in GEMM_POLICIES:
        out.append(f"gemm_policy={cfg.gemm_policy!r}: expected one of {GEMM_POLICIES}")
        return out
    if cfg.block_M % 16 or not 16 <= cfg.block_M <= 128:
        out.append(f"block_M={cfg.block_M}: expected a multiple of 16 in 16..128")
    if not 1 <= cfg.num_stages <= 4:
        out.append(f"num_stages={cfg.num_stages}: expected 1..4")
    if head_dim % 16 or head_dim_v % 16:
        out.append(f"head dims {head_dim}/{head_dim_v}: expected multiples of 16")
    warps = cfg.threads // 32
    # P^T and dS^T stay in registers as the A operand of the dV / dK gemms: every warp must own
    # whole rows (keys) of S^T, dV and dK, i.e. the warps split block_N only.
    for what, n in (
        ("S^T = K Q^T", cfg.block_M),
        ("dV += P^T dO", head_dim_v),
        ("dK += dS^T Q", head_dim),
    ):
        split = warp_partition(cfg.block_N, n, warps, cfg.gemm_policy, True)
        if split is None or split[1] != 1:
            out.append(
                f"{what} [{cfg.block_N}x{n}]: {warps} warps must all split the {cfg.block_N} "
                f"keys (block_N a multiple of {16 * warps} with wgmma warpgroups of 64 rows)"
            )
            break
    if warp_partition(cfg.block_M, head_dim, warps, "Square", False) is None:
        out.append(f"dQ = dS K [{cfg.block_M}x{head_dim}]: no warp partition for {warps} warps")
    res = backward_resources(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
    if res["smem_bytes"] > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {res['smem_bytes'] // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB")
    cap = consumer_register_cap(cfg.threads)
    if res["regs_per_thread"] > cap:
        out.append(
            f"accumulators need about {res['regs_per_thread']} registers per thread > {cap} "
            f"(dK/dV [{cfg.block_N}x{head_dim}/{head_dim_v}], tiles [{cfg.block_N}x{cfg.block_M}])"
        )
    return out


def check_backward_config(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> KernelConfig:
    problems = backward_config_problems(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
    if problems:
        raise ConfigError(f"invalid backward KernelConfig {cfg.key()}: " + "; ".join(problems))
    return cfg


def default_backward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                            spec: object = None) -> KernelConfig:
    """The first valid config of PREFERENCE (the same for every spec: the split/fused schedule,
    not the tile, adapts to a spec's registers)."""
    for cfg in PREFERENCE:
        if not backward_config_problems(cfg, head_dim, head_dim_v, elem_bytes):
            return cfg
    raise ConfigError(
        f"no valid backward kernel config for head dims D={head_dim}, Dv={head_dim_v} "
        "(dK and dV accumulators must fit in registers)"
    )


# The dQ kernel of the deterministic backward (forward frame: rows = queries). It holds S, dP
# and P [block_M x block_N] in fp32 plus the dQ accumulator [block_M x D].
DQ_PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=128, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=32, num_stages=1, threads=128),
)


def dq_config_problems(cfg: KernelConfig, head_dim: int, head_dim_v: int,
                       elem_bytes: int = 2) -> list[str]:
    """Every reason `cfg` is invalid for the deterministic dQ kernel (empty list: valid)."""
    out: list[str] = []
    warps = cfg.threads // 32
    # dS is the register A operand of dQ += dS K: the warps split the query rows only.
    for what, n in (("S = Q K^T", cfg.block_N), ("dQ += dS K", head_dim)):
        split = warp_partition(cfg.block_M, n, warps, "FullRow", True)
        if split is None or split[1] != 1:
            out.append(f"{what} [{cfg.block_M}x{n}]: {warps} warps must split the query rows")
            break
    smem = elem_bytes * (cfg.block_M * (head_dim + head_dim_v)
                         + cfg.num_stages * cfg.block_N * (head_dim + head_dim_v))
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {smem // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB")
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    regs = 3 * per(cfg.block_M * cfg.block_N) + per(cfg.block_M * cfg.block_N) // 2
    regs += per(cfg.block_M * head_dim)
    if regs > consumer_register_cap(cfg.threads):
        out.append(f"accumulators need about {regs} registers per thread")
    return out


def default_dq_config(head_dim: int, head_dim_v: int) -> KernelConfig:
    for cfg in DQ_PREFERENCE:
        if not dq_config_problems(cfg, head_dim, head_dim_v):
            return cfg
    raise ConfigError(f"no valid dQ kernel config for head dims D={head_dim}, Dv={head_dim_v}")
