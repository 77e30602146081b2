"""The backward's plan: the kernels' configs (validity models and defaults of the main kernel,
whose config the kind's search space and tune files hold, and of the deterministic mode's dQ
kernel), and BackwardPlan, every other decision about one backward, taken by plan_backward."""

from __future__ import annotations

from dataclasses import dataclass

from engine.dsl.expr import Expr, leaves
from engine.ir.spec import TracedSpec
from engine.kernels.attention_bwd.exprs import BackwardExprs, RowDotGrad, row_dot_grads
from engine.kernels.attention_bwd.panels import wave_panel
from engine.mask.analysis import reads_data
from engine.plan.config import (
    GEMM_POLICIES,
    H100_SMS,
    SMEM_LIMIT_BYTES,
    ConfigError,
    KernelConfig,
    consumer_register_cap,
    warp_partition,
)
from engine.plan.fold import RowFold, row_fold
from engine.plan.shape import KernelShape

# Preference order for the main kernel. block_N = keys per thread block (rows of every
# fragment), block_M = queries per inner step. The kernel holds dK and dV [block_N x D]
# accumulators for the whole loop, so block_M stays small: at D = 128 and 256 threads,
# 64 x 128 fits the 240 registers of a consumer (ptxas: no spills), 128 x 128 spills. At
# D 64, 128 x 128 fits with the finals and Delta read from the ring (rows_in_ring); it ran
# the backward 11-13% faster than 64 x 128 (H200, B 4 x S 4k and B 1 x S 16k, 16 heads;
# results/NOTES.md 172), and default_backward_config takes it where the warp-specialised
# schedule does.
# Last, the head-split schedule (gemm_policy FullCol: head_split_problems) for the head dims
# whose dK/dV do not fit a key split (D = Dv = 256: (D + Dv) / 2 registers a thread); past
# D 128 default_backward_config takes it first.
PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=128, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=128, num_stages=2, threads=256),
    KernelConfig(block_M=32, block_N=64, num_stages=2, threads=128),
    KernelConfig(block_M=16, block_N=64, num_stages=1, threads=128),
    KernelConfig(block_M=64, block_N=64, num_stages=2, threads=256, gemm_policy="FullCol"),
)


# Query rows a step from which the warp-specialised schedule reads the finals and Delta where
# used from its ring's stage instead of copying them into registers: at 128 rows their
# 32 values a thread each made ptxas spill 244 bytes at D 64 (the backward 1.58x as slow as
# from the ring); at 64 rows the copy ran as fast at D 64 and 2% faster at D 128 (H200;
# results/NOTES.md 172).
ROWS_IN_RING_M = 128
# The shortest query rows for which the default takes such steps: at ViT-S/16's 197 the
# backward ran 4-5% slower at 128 rows than at 64 (two steps a key block: the ring barely
# fills), at 512 8% faster, at 1024 8% (H200, D 64; results/NOTES.md 172-173).
WIDE_STEP_MIN_SQ = 512


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
    # and the 16-bit P^T, still read by the dV wgmma; dS^T's 16-bit values take the places
    # of the fp32 ones they are made from) and the dQ product (with dS^T's 16-bit copy).
    # Checked with ptxas --resource-usage: at D = 128, 64x128/256 threads and 64x64/128
    # threads (model 208) compile without spills, 128x128/256 threads (model 288) spills; at
    # D 64, 128x128/256 threads (model 224) does not, with the finals and Delta in the ring.
    regs = per(bN * (head_dim + head_dim_v)) + max(
        5 * per(bN * bM) // 2,
        per(bM * head_dim) + per(bN * bM) // 2,
    )
    return {"smem_bytes": smem, "regs_per_thread": regs}


# The warp-specialised schedule of the fast backward (codegen.py beside this): a producer
# warpgroup (warp 0 loads Q and dO, warp 1 adds dQ to global memory) beside the consumers
# (their sizes: WS_* in engine.plan.config).
WS_CONSUMER_BARRIER = 1  # named barrier id of the consumers' one meeting per step
# Row length (fp32 values) of the schedule's flat dQ tile: its TMA box is DQ_ROW x
# (block_M * head_dim / DQ_ROW), both within TMA's 256 per dimension.
DQ_ROW = 256


# Static shared memory beside the dynamic buffers (the mbarriers; ptxas reports 1 KiB).
WS_STATIC_SMEM = 1024


def ws_shared_bytes(cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                    n_vectors: int = 2) -> int:
    """Shared memory of the warp-specialised schedule: K and V, the Q/dO ring (num_stages,
    with `n_vectors` per-query fp32 vectors: finals, Delta, hoisted custom reads), the
    mbarriers and two-deep rings of the step's tiles: dS^T (16-bit) and the dQ tile (fp32),
    or, head-split (dQ from the dQ kernel), P^T and dS^T (16-bit)."""
    bM, bN = cfg.block_M, cfg.block_N
    tiles16, dq = (4 * bN * bM, 0) if head_split(cfg) else (2 * bN * bM, 2 * bM * head_dim)
    return (elem_bytes * (bN * (head_dim + head_dim_v)
                          + cfg.num_stages * bM * (head_dim + head_dim_v) + tiles16)
            + 4 * (dq + cfg.num_stages * n_vectors * bM) + WS_STATIC_SMEM)


def ws_schedule_fits(cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                     deterministic: bool = False, n_vectors: int = 2) -> bool:
    """Whether the backward at `cfg` uses the warp-specialised schedule: one or two consumer
    warpgroups and its rings in shared memory, and either (key split) dQ by wgmma in whole
    64 x 64 tiles handed to a writer warp (block_M and head_dim multiples of 64; the
    deterministic mode has no dQ to hand over and keeps the automatic pipeline) or (head
    split) dQ from the dQ kernel (separate_dq), in either mode."""
    if head_split(cfg):
        form = separate_dq(head_dim, True, deterministic)
    else:
        form = not deterministic and cfg.block_M % 64 == 0 and head_dim % 64 == 0
    return (form and cfg.threads in (128, 256)
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
    if cfg.schedule != "auto":
        out.append(f"schedule={cfg.schedule!r}: the backward's schedules come from its plan "
                   "(expected 'auto')")
    if cfg.persistent:
        out.append("persistent=True: only the forward's warp-specialised schedules walk tiles "
                   "persistently (expected False)")
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
    if head_split(cfg):
        return out + head_split_problems(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
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


def head_split(cfg: KernelConfig) -> bool:
    """Whether `cfg` runs the head-split schedule: the warps split the gemms' columns
    (FullCol), so dK and dV [block_N x D] are spread over every thread by head dim; P^T and
    dS^T, whose rows a warp then does not own whole, reach the dV and dK gemms through shared
    memory; dQ is computed and added (fp32 atomics) in column chunks of at most 128, or,
    past D 128, comes from the dQ kernel (separate_dq)."""
    return cfg.gemm_policy == "FullCol"


def dq_chunks(head_dim: int) -> int:
    """Column chunks of the head-split schedule's dQ (each at most 128 wide)."""
    return -(-head_dim // 128)


def head_split_problems(cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                        n_rows: int = 2) -> list[str]:
    """Every reason `cfg` is invalid for the head-split schedule (head_split). Registers per
    thread: dK and dV, plus the larger of the elementwise phase (S^T, dP^T and P^T in fp32,
    P^T and dS^T in 16 bits) and a dQ chunk. The probe of this design at D = 256 (64 x 64,
    256 threads, results/NOTES.md 70) compiled to 168 registers, no spills; this model says
    192. Shared memory: K, V, the Q/dO stages, P^T and dS^T, the per-query vectors."""
    out: list[str] = []
    warps = cfg.threads // 32
    chunk = head_dim // dq_chunks(head_dim)
    if head_dim % dq_chunks(head_dim):
        out.append(f"head_dim={head_dim}: dQ's {dq_chunks(head_dim)} column chunks must be equal")
    for what, m, n in (("S^T = K Q^T", cfg.block_N, cfg.block_M),
                       ("dV += P^T dO", cfg.block_N, head_dim_v),
                       ("dK += dS^T Q", cfg.block_N, head_dim),
                       ("dQ = dS K", cfg.block_M, chunk)):
        if warp_partition(m, n, warps, "FullCol", True) is None:
            out.append(f"{what} [{m}x{n}]: no FullCol warp partition for {warps} warps")
    per = lambda n: -(-n // cfg.threads)  # noqa: E731 - ceil division
    tile = per(cfg.block_N * cfg.block_M)
    regs = per(cfg.block_N * (head_dim + head_dim_v)) + max(4 * tile,
                                                            per(cfg.block_M * chunk) + tile // 2)
    cap = consumer_register_cap(cfg.threads)
    if regs > cap:
        out.append(f"accumulators need about {regs} registers per thread > {cap} (dK/dV "
                   f"[{cfg.block_N}x{head_dim}/{head_dim_v}], dQ chunk [{cfg.block_M}x{chunk}])")
    smem = (elem_bytes * (cfg.block_N * (head_dim + head_dim_v)
                          + cfg.num_stages * cfg.block_M * (head_dim + head_dim_v)
                          + 2 * cfg.block_N * cfg.block_M)
            + 4 * cfg.block_M * n_rows)
    if smem > SMEM_LIMIT_BYTES:
        out.append(f"shared memory {smem // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB")
    return out


def check_backward_config(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, n_rows: int = 2
) -> KernelConfig:
    problems = backward_config_problems(cfg, head_dim, head_dim_v, elem_bytes, n_rows)
    if problems:
        raise ConfigError(f"invalid backward KernelConfig {cfg.key()}: " + "; ".join(problems))
    return cfg


# Query rows a step where only a custom input's gradient reads the raw score: its per-step
# tile (the derivative times dS, reduced per key) keeps S^T live beside dP^T and dS^T. On the
# H100 (variants suite, B 2 x S 4k, D 128, fwd+bwd) RetNet's log-decay gradient took 21.4 ms
# at 64 x 128 (ptxas: 2552 bytes of spills) and 4.65 ms at 32 x 128 (the key gate's spilled
# 596 bytes at 64, none at 32). ALiBi's slopes (no score read) and sigmoid's bias (whose dS
# reads the score anyway) ran slower at 32 rows (2.58 -> 3.94 ms, 6.07 -> 7.57 ms) than
# with their 20-byte spill or serialised wgmmas at 64.
NARROW_BLOCK_M = 32


def wants_narrow_rows(spec: TracedSpec, custom_grads: tuple[str, ...]) -> bool:
    """Whether the gradients of `custom_grads` take steps of at most NARROW_BLOCK_M query
    rows: where only such a gradient reads the raw score (its derivative tile beside S^T,
    dP^T and P^T spilled or serialised the wgmmas at 64 rows: results/NOTES.md 93-94)."""
    grads = kernel_custom_grads(spec, custom_grads)
    return bool(grads) and BackwardExprs(spec, grads).only_grads_read_score


def step_rows_cap(spec: TracedSpec, custom_grads: tuple[str, ...]) -> int | None:
    """The most query rows a step should take for the gradients of `custom_grads` (None: no
    cap): NARROW_BLOCK_M where wants_narrow_rows; 64 where the kernels compute any, whose
    per-step tiles and sums at 128 rows spilled 236-2102 bytes (ptxas at D 64: ALiBi's
    slopes, sigmoid's and the bias tables' gradients; results/NOTES.md 172)."""
    if wants_narrow_rows(spec, custom_grads):
        return NARROW_BLOCK_M
    return ROWS_IN_RING_M // 2 if kernel_custom_grads(spec, custom_grads) else None


def kernel_custom_grads(spec: TracedSpec, custom_grads: tuple[str, ...]) -> tuple[str, ...]:
    """The gradients of `custom_grads` the kernels compute: not those that come from
    q . dQ afterwards (row_dot_grads)."""
    return _without(custom_grads, row_dot_grads(spec, custom_grads))


def _without(custom_grads: tuple[str, ...], dots: tuple[RowDotGrad, ...]) -> tuple[str, ...]:
    names = {g.name for g in dots}
    return tuple(n for n in custom_grads if n not in names)


def default_backward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                            spec: TracedSpec | None = None,
                            custom_grads: tuple[str, ...] = (),
                            deterministic: bool = False,
                            seqlen_q: int | None = None) -> KernelConfig:
    """The first valid config of PREFERENCE (the split/fused schedule, not the tile, adapts to
    a spec's registers), the head-split ones first past D 128; steps of ROWS_IN_RING_M query
    rows only where `seqlen_q` is at least WIDE_STEP_MIN_SQ (None, a length unknown or
    dynamic: never) and the schedule reads the finals and Delta from its ring (warp-specialised
    for `spec`, not `deterministic`); first those within step_rows_cap, if any."""
    n_vectors = 2 if spec is None else query_vectors(spec)

    def wide_ok(c: KernelConfig) -> bool:
        if c.block_M < ROWS_IN_RING_M:
            return True
        return (seqlen_q is not None and seqlen_q >= WIDE_STEP_MIN_SQ
                and ws_schedule_fits(c, head_dim, head_dim_v, elem_bytes, deterministic,
                                     n_vectors))

    valid = [c for c in PREFERENCE
             if not backward_config_problems(c, head_dim, head_dim_v, elem_bytes) and wide_ok(c)]
    if separate_dq(head_dim, True, False):
        # Past D 128 the head-split schedule first: there its dQ comes from the dQ kernel and
        # its main kernel is warp-specialised. At D 192 / Dv 128 (B 2 x S 4k, 16 heads) its
        # backward ran 1.32 ms causal and 2.30 ms not, against 1.96 and 3.26 for the 32 x 128
        # key split (H100, same process; results/NOTES.md 114).
        valid.sort(key=lambda c: not head_split(c))
    cap = None if spec is None else step_rows_cap(spec, custom_grads)
    if cap is not None:
        valid = [c for c in valid if c.block_M <= cap] + valid
    for cfg in valid:
        return cfg
    raise ConfigError(
        f"no valid backward kernel config for head dims D={head_dim}, Dv={head_dim_v} "
        "(dK and dV accumulators must fit in registers)"
    )


# The dQ kernel (forward frame: rows = queries) of the deterministic backward and of the
# head-split one past D 128 (separate_dq). It holds S, dP and P [block_M x block_N] in fp32
# plus the dQ accumulator [block_M x D]. At D 256, 128 x 32 in two stages ran the dQ kernel in
# 1.28 ms against 2.69 for 64 x 32 in one (H100, B 4 x S 4k, 8 heads; results/NOTES.md 112).
DQ_PREFERENCE: tuple[KernelConfig, ...] = (
    KernelConfig(block_M=128, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=64, block_N=64, num_stages=2, threads=256),
    KernelConfig(block_M=128, block_N=32, num_stages=2, threads=256),
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


# ---------------------------------------------------------------- the plan of one backward


@dataclass(frozen=True)
class HoistedRead:
    """A custom read indexed by one position axis ("q" or "kv"), held in a register vector
    instead of read per tile element; `slot` numbers it among the spec's custom reads."""

    name: str
    index: tuple
    axis: str
    slot: int


@dataclass(frozen=True)
class BackwardPlan:
    """Every decision about one backward, taken once by plan_backward; the code generator
    branches on nothing but this and the spec."""

    config: KernelConfig
    deterministic: bool
    # The main kernel's schedule: explicit producer, dQ-writer and consumer roles
    # (warp-specialised), or TileLang's automatic pipeline.
    warp_specialized: bool
    # The step: P while dP^T is in flight and dS while dV is (split), or P and dS in one loop
    # after both gemms (fused).
    split: bool
    # dK/dV split by head dim over the warps, P^T and dS^T through shared memory, the fused
    # step; dQ in column chunks added by atomics (automatic pipeline) or, past D 128, from
    # the dQ kernel (warp-specialised where the rings fit).
    head_split: bool
    # One thread block per kv head walks the query heads of its GQA group.
    heads_loop: bool
    # Groups per panel of the launch order (1: the plain grid).
    panel: int
    # Where dK/dV go: "once" (input dtype, one writer each), "per_query_head" (fp32, summed per
    # group afterwards: deterministic) or "atomic" (fp32 atomics into the kv head).
    kv_store: str
    # The main kernel's dQ: "fragment" (the accumulator's fragment order, turned into rows by
    # the postprocess kernel), "rows" ([B, Hq, Sq, D] fp32) or "none" (the dQ kernel's:
    # deterministic, or separate_dq).
    dq_layout: str
    # dQ = dS K as an asynchronous wgmma beside dK (whole 64-row warpgroups over block_M).
    dq_async: bool
    custom_grads: tuple[str, ...]
    # (name, index) of each custom read whose gradient the main kernel produces, in its order.
    custom_reads: tuple[tuple[str, tuple], ...]
    hoisted: tuple[HoistedRead, ...]
    # Table lookups (their places in BackwardExprs.dc_gathers) whose gradients are summed
    # along the diagonals of dS^T in shared memory (diagonal_tables).
    diagonal_tables: tuple[int, ...]
    # The per-query hoisted reads bound to the ring's shared memory where the partial blocks
    # use them, not copied into registers each step (warp-specialised, two or more of them).
    q_reads_in_ring: bool
    # The finals and Delta read where used from the ring's stage, not copied into registers
    # each step (the warp-specialised key split, ROWS_IN_RING_M query rows a step or more).
    rows_in_ring: bool
    preprocess: bool  # Delta = rowsum(dO * O) first: the spec's `bwd` reads doosum
    dq_config: KernelConfig | None  # the dQ kernel's (dq_layout "none")
    # Gradients of custom inputs that scale the raw score per (batch, head), from q . dQ
    # after the kernels (exprs.RowDotGrad); custom_grads are the kernels' own.
    row_dot_grads: tuple[RowDotGrad, ...] = ()
    # A dilated mask's rows folded into heads (engine.plan.fold): the kernels are generated
    # for fold.spec at fold.tiled, every decision above taken there.
    fold: RowFold | None = None
    # One thread block per SM walks the kv blocks (persistent_default): the next block's K
    # and V load while this one stores dK and dV.
    persistent: bool = False
    # dK and dV written into K's and V's tiles (free after the last step) and stored from
    # there by TMA copies, instead of element by element from the registers (staged_default).
    staged_store: bool = False

    @property
    def products_ahead(self) -> bool:
        """Whether a step issues the next step's S^T and dP^T wgmmas right behind its own dV
        and dK and waits once: the warp-specialised head split (main kernel 2.16 -> 2.07-2.09
        ms at D 256, B 4 x S 4k; results/NOTES.md 114)."""
        return self.warp_specialized and self.head_split


def separate_dq(head_dim: int, split_heads: bool, deterministic: bool) -> bool:
    """dQ from the dQ kernel (each query block walks its key blocks, dQ in registers, one
    store) instead of atomics from the main kernel: always in the deterministic mode, and in
    the head-split schedule past D 128. There the key block is 64 (dK and dV for more keys do
    not fit in registers), so each step adds 64 x D fp32 of dQ for 64 keys' products: at
    D 256 those adds took 2.7 of the fused kernel's 5.2 ms, and the two kernels ran 3.96 ms
    with their passes (H100, B 4 x S 4k, 8 heads; results/NOTES.md 112)."""
    return deterministic or (split_heads and head_dim > 128)


def backward_fold(spec: TracedSpec, shape: KernelShape) -> RowFold | None:
    """The forward's fold of a dilated mask, where the spec reads no custom inputs (their
    reads, hoisted vectors and gradients index the problem's rows, not the folded ones)."""
    return None if spec.customs else row_fold(spec, shape)


def single_axis(index: tuple) -> str | None:
    """"q" or "kv" when a custom read's index varies along that position axis only."""
    syms = {x for x in index if isinstance(x, str)}
    if ("q" in syms) != ("kv" in syms):
        return "q" if "q" in syms else "kv"
    return None


def query_vectors(spec: TracedSpec) -> int:
    """The per-query vectors of `spec`'s backward ring: finals, Delta and, at most, every
    custom read indexed by the query alone."""
    roots = [r for r in (spec.mask, spec.score_mod, spec.fwd_recompute, spec.bwd) if r is not None]
    by_query = {n.attr for n in leaves(roots) if n.op == "custom" and single_axis(n.attr[2]) == "q"}
    return len(spec.final_names) + int(spec.uses_doosum) + len(by_query)


def warp_specialized_default(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig,
                             deterministic: bool = False) -> bool:
    """Warp-specialised where ws_schedule_fits, counting this spec's per-query vectors."""
    return ws_schedule_fits(cfg, shape.head_dim, shape.head_dim_v, 2, deterministic,
                            query_vectors(spec))


def panel_default(shape: KernelShape, cfg: KernelConfig, warp_specialized: bool,
                  short_walks: bool = False) -> int:
    """Groups per panel of the warp-specialised backward's launch order (see panel_order): as
    many as keep a panel within one wave of thread blocks, so that every block of a group
    runs at once and their Q and dO stream through L2 once; the longest blocks of the panel
    start first. (Key blocks first over all groups streamed Q and dO from HBM per block: up
    to 1.8x slower on the H100. A group's blocks in key order, one group after another, left
    a causal mask a tail: 12% slower at LLaMA-3 8B heads, 2 x 4k, walking the GQA group.)
    `short_walks` (a mask that reads data: a block walks its document's queries, not the
    sequence's): two waves, whose longest blocks start before the first wave's run out. On
    the H100 at Llama-3-8B heads (NOTES 125): packed prefixes 8k 1.075x, 16k 1.087x
    (1.095x at four groups), documents 8k 1.036x, all groups at once 1.02-1.03x.
    1 (the plain grid) without the warp-specialised schedule or with a swizzle panel."""
    if not warp_specialized or cfg.swizzle_panel:
        return 1
    return wave_panel(-(-shape.seqlen_kv // cfg.block_N), 2 if short_walks else 1)


# Thread blocks (kv blocks x kv heads x batch) from which a GQA group's query heads share one:
# two per SM of an H100, so that the longer blocks still leave the machine a short tail.
HEADS_LOOP_MIN_BLOCKS = 2 * H100_SMS


def heads_loop_possible(shape: KernelShape, warp_specialized: bool) -> bool:
    """Whether a thread block can walk the query heads of a GQA group: the warp-specialised
    schedule, GQA, and a mask the same for every head."""
    return warp_specialized and shape.heads_q > shape.heads_kv and shape.mask_heads == 1


def heads_loop_default(shape: KernelShape, cfg: KernelConfig, warp_specialized: bool,
                       custom_grads: tuple[str, ...] = ()) -> bool:
    """Whether the warp-specialised backward's thread block walks the query heads of a GQA
    group: where it can, with enough thread blocks left and no custom gradients (on the H100
    ALiBi's slope gradient, flushed per head, ran 10-18% slower that way)."""
    blocks = kv_blocks(shape, cfg, heads_loop=True)
    return (heads_loop_possible(shape, warp_specialized) and not custom_grads
            and blocks >= HEADS_LOOP_MIN_BLOCKS)


# The query rows up to which the warp-specialised main kernel walks its kv blocks
# persistently by default (persistent_default). Backward alone, persistent over the plain
# grid (H200, same process, results/NOTES.md 184): D 64 at 197 rows 1.18-1.26x, 512 1.17x,
# 1024 0.99x, 2048 0.99x; D 128 at 256 1.37x, 512 1.21x, 1024 1.005x.
PERSISTENT_MAX_SQ = 512


def kv_blocks(shape: KernelShape, cfg: KernelConfig, heads_loop: bool = False) -> int:
    """The main kernel's thread blocks on the plain grid: kv blocks x heads x batch."""
    heads = shape.heads_kv if heads_loop else shape.heads_q
    return -(-shape.seqlen_kv // cfg.block_N) * heads * shape.batch


def persistent_blocks(shape: KernelShape, cfg: KernelConfig) -> int:
    """The persistent walk's thread blocks: one per SM, no more than kv blocks."""
    return min(H100_SMS, kv_blocks(shape, cfg))


def persistent_possible(shape: KernelShape, cfg: KernelConfig, warp_specialized: bool,
                        heads_loop: bool, custom_grads: tuple[str, ...]) -> bool:
    """Whether the main kernel can walk its kv blocks persistently: the warp-specialised
    schedule with dQ in the main kernel (not the head split), one query head a block, no
    swizzle panel (the walk takes the blocks in grid order), no custom gradients (their
    flushes are per block) and static lengths (the walk's count)."""
    return (warp_specialized and not head_split(cfg) and not heads_loop and not custom_grads
            and not cfg.swizzle_panel and not shape.dynamic)


def persistent_default(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig,
                       warp_specialized: bool, heads_loop: bool,
                       custom_grads: tuple[str, ...]) -> bool:
    """The persistent walk where it can run, without a mask (every kv block walks the same
    steps, so a fixed deal is even), at up to PERSISTENT_MAX_SQ query rows (few steps a kv
    block, beside which each block's K/V load and dK/dV store were exposed: ViT-S/16's main
    kernel on 3072 blocks took 1.7x the time of cuDNN's on 132, H200 ncu) and at least two
    thread blocks per SM."""
    return (persistent_possible(shape, cfg, warp_specialized, heads_loop, custom_grads)
            and spec.mask is None and shape.seqlen_q <= PERSISTENT_MAX_SQ
            and kv_blocks(shape, cfg) >= 2 * H100_SMS)


def staged_store_possible(warp_specialized: bool, split_heads: bool, once: bool) -> bool:
    """Whether dK and dV can go out through K's and V's tiles: the warp-specialised key split
    (its tiles are [block_N, D] in the input dtype) storing each once."""
    return warp_specialized and not split_heads and once


def staged_default(warp_specialized: bool, split_heads: bool, once: bool,
                   persistent: bool) -> bool:
    """Staged where it can be, but on the persistent walk, whose next K and V load into the
    tiles the stores would read."""
    return staged_store_possible(warp_specialized, split_heads, once) and not persistent


def hoisted_reads(roots: list[Expr]) -> tuple[HoistedRead, ...]:
    """Custom reads of the tile expressions indexed by one position axis (a document id per
    query or per key, say), held in register vectors instead of read per element: per key,
    loaded once before the loop; per query, each step like the finals. Read per element they
    are 2 x bM x bN / threads loads per step, whose latency sits behind each gemm's wait."""
    reads = sorted({n.attr for n in leaves(roots) if n.op == "custom"}, key=repr)
    return tuple(HoistedRead(name, index, axis, slot)
                 for slot, (name, _, index) in enumerate(reads)
                 if (axis := single_axis(index)) is not None)


# The side of the dS^T blocks a lane sums by diagonals: a row of one is a 16-byte load.
DIAG_BLOCK = 8


@dataclass(frozen=True)
class DiagonalLanes:
    """How the consumers sum a [block_N, block_M] dS^T tile by diagonals (codegen/diagonals.py):
    `groups` groups of `group` lanes, one group per diagonal of DIAG_BLOCK-square blocks (a
    lane per block along it), in `warps` whole warps; each lane then owns `owned` of its
    group's 2 DIAG_BLOCK - 1 local diagonals (2 DIAG_BLOCK / group)."""

    group: int
    groups: int
    owned: int
    warps: int


def diagonal_lanes(block_M: int, block_N: int) -> DiagonalLanes:
    nr, nc = block_N // DIAG_BLOCK, block_M // DIAG_BLOCK
    group = 1 << (min(nr, nc) - 1).bit_length()  # a power of two for the shuffles
    groups = nr + nc - 1
    return DiagonalLanes(group, groups, max(1, 2 * DIAG_BLOCK // group),
                         -(-groups * group // 32))


def diagonal_tables(ex: BackwardExprs, cfg: KernelConfig, deterministic: bool
                    ) -> tuple[int, ...]:
    """The table lookups whose gradients the kernel sums along dS^T's diagonals: indexed by
    q - kv alone and dS^T's element times a constant, where the consumers have the lanes
    (diagonal_lanes; at most 2 DIAG_BLOCK lanes a group). Added element by element with
    atomics instead, T5's 32 buckets took 29x the backward's time (NOTES 51). Not
    deterministic: the sums are added atomically."""
    lanes = diagonal_lanes(cfg.block_M, cfg.block_N)
    if (deterministic or cfg.block_M % DIAG_BLOCK or cfg.block_N % DIAG_BLOCK
            or lanes.group > 2 * DIAG_BLOCK or 32 * lanes.warps > cfg.threads):
        return ()
    return tuple(r for r, g in enumerate(ex.dc_gathers)
                 if g.diag_dim is not None and g.ds_factor is not None)


def _launch_order(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig,
                  warp_specialized: bool, heads_loop: bool, custom_grads: tuple[str, ...],
                  persistent: bool | None, panel: int | None) -> tuple[bool, int]:
    """(persistent, panel): the persistent walk or the launch's panels, each forced (checked)
    or by default."""
    if persistent is None:
        persistent = persistent_default(spec, shape, cfg, warp_specialized, heads_loop,
                                        custom_grads)
    elif persistent and not persistent_possible(shape, cfg, warp_specialized, heads_loop,
                                                custom_grads):
        raise ValueError("persistent: needs the warp-specialised schedule without the head "
                         "split or the heads walk, no custom gradients and static lengths")
    if panel is None:
        panel = 1 if persistent else panel_default(shape, cfg, warp_specialized,
                                                   reads_data(spec.mask))
    elif panel > 1 and persistent:
        raise ValueError("panel: the persistent walk takes the kv blocks in grid order "
                         "(expected 1)")
    return persistent, panel


def plan_backward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig,
                  custom_grads: tuple[str, ...] = (), deterministic: bool = False, *,
                  warp_specialized: bool | None = None, heads_loop: bool | None = None,
                  panel: int | None = None, persistent: bool | None = None,
                  staged_store: bool | None = None) -> BackwardPlan:
    """The plan of `spec`'s backward at `shape` and `cfg` (a valid config), producing the
    gradients of the CustomIO tensors in `custom_grads` too. The keyword arguments force a
    decision (tests); NotImplementedError when the kernels cannot run the spec, ValueError
    when a forced decision cannot apply.

    Fast mode: dQ, dK, dV and the custom gradients are accumulated with fp32 atomics (dQ +=
    dS K per kv block; dK, dV over the query heads of a GQA group unless the heads walk stores
    them once). Deterministic: no atomics and no dQ in the main kernel; dK and dV per query
    head, custom gradients per (b, h, key) row, dQ from the dQ kernel; every output element
    has one writer, so runs are bitwise identical.

    A dilated mask's backward is planned, and its kernels generated, for the folded spec
    and shape (BackwardPlan.fold)."""
    fold = backward_fold(spec, shape)
    if fold is not None:
        spec, shape = fold.spec, fold.tiled
    dots = row_dot_grads(spec, tuple(custom_grads))
    custom_grads = _without(tuple(custom_grads), dots)
    ex = BackwardExprs(spec, custom_grads, deterministic)
    split_heads = head_split(cfg)
    dq_kernel = separate_dq(shape.head_dim, split_heads, deterministic)
    if warp_specialized is None:
        warp_specialized = warp_specialized_default(spec, shape, cfg, deterministic)
    elif warp_specialized and split_heads and not dq_kernel:
        raise ValueError("warp_specialized: the head-split schedule's takes dQ from the dQ "
                         "kernel (deterministic, or head_dim > 128)")
    elif warp_specialized and deterministic and not split_heads:
        raise ValueError("warp_specialized: the deterministic backward has no dQ to hand over")
    if heads_loop is None:
        heads_loop = heads_loop_default(shape, cfg, warp_specialized, custom_grads)
    elif heads_loop and not heads_loop_possible(shape, warp_specialized):
        raise ValueError("heads_loop: needs the warp-specialised schedule, GQA and a mask "
                         "the same for every head")
    persistent, panel = _launch_order(spec, shape, cfg, warp_specialized, heads_loop,
                                      custom_grads, persistent, panel)
    hoisted = hoisted_reads(ex.tile_roots(spec))
    # Split spills where S^T stays live beside the per-query vectors (soft-capping: 588 bytes,
    # 30% slower; a document id per query: 184 bytes, and fused ran 4% faster on the H100).
    n_q_reads = sum(h.axis == "q" for h in hoisted)
    rows_in_ring = warp_specialized and not split_heads and cfg.block_M >= ROWS_IN_RING_M
    n_vectors = len(spec.final_names) + int(spec.uses_doosum) + n_q_reads
    # At 128 rows split's three 64-register tiles beside dK and dV spilled even with the
    # finals and Delta in the ring (ptxas at D 64: 72 bytes, causal 324); fused did not.
    split = not split_heads and not rows_in_ring and split_schedule_fits(
        cfg, shape.head_dim, shape.head_dim_v, n_vectors, ex.ds_reads_score)
    once = shape.heads_q == shape.heads_kv or heads_loop
    if staged_store is None:
        staged_store = staged_default(warp_specialized, split_heads, once, persistent)
    elif staged_store and not staged_store_possible(warp_specialized, split_heads, once):
        raise ValueError("staged_store: needs the warp-specialised key split storing dK and "
                         "dV once")
    # In registers, two per-query vectors (a document id and a prefix end) made ptxas spill
    # 316 bytes and each block step take 6.9 us against causal's 2.5 (4.5 from the ring); one
    # (a document id) ran 7% faster in registers (4.18 against 4.49 ms, H100, S 16k).
    q_in_ring = warp_specialized and n_q_reads >= 2
    return BackwardPlan(
        config=cfg, deterministic=deterministic, warp_specialized=warp_specialized,
        split=split, head_split=split_heads, heads_loop=heads_loop, panel=panel,
        kv_store="once" if once else "per_query_head" if deterministic else "atomic",
        dq_layout="none" if dq_kernel else "fragment" if warp_specialized else "rows",
        dq_async=not deterministic and not split_heads and cfg.block_M % 64 == 0,
        custom_grads=tuple(custom_grads),
        custom_reads=tuple((name, index) for name, index, _ in ex.dc_reads),
        hoisted=hoisted, diagonal_tables=diagonal_tables(ex, cfg, deterministic),
        q_reads_in_ring=q_in_ring, rows_in_ring=rows_in_ring, preprocess=spec.uses_doosum,
        dq_config=default_dq_config(shape.head_dim, shape.head_dim_v) if dq_kernel else None,
        row_dot_grads=dots, fold=fold, persistent=persistent, staged_store=staged_store,
    )
