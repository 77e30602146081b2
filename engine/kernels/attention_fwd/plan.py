"""The forward kernel's plan: its validity model (shared memory, registers, TileLang's warp
partition of both gemms: S = Q K^T over [block_M x block_N], O += P V over
[block_M x head_dim_v]) and its default config, the first valid one from a preference order
measured on the H100 (see results/)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.dsl.expr import CUSTOM_READS, Expr, topo
from engine.kernels.attention_fwd.online import rescales
from engine.mask.analysis import reads_data
from engine.plan.config import (
    GEMM_POLICIES,
    SCHEDULES,
    SMEM_LIMIT_BYTES,
    ConfigError,
    KernelConfig,
    consumer_register_cap,
    warp_partition,
)

if TYPE_CHECKING:
    from engine.ir.spec import TracedSpec
    from engine.plan.shape import KernelShape

# Registers a consumer thread needs beyond its accumulators (addresses, row scales, loop state).
REG_OVERHEAD = 48

# Key blocks of every schedule; the warp-specialised ones also take WS_BLOCK_N, for keys
# shorter than a block (fit_short_keys picks from FIT_BLOCKS). Only blocks run on the H100
# are listed: other multiples of 16 compile without spills (80, 144, 224) but are untested.
BLOCK_N = (32, 64, 96, 128, 160, 176, 192, 256)
WS_BLOCK_N = (112, 208, 240)
FIT_BLOCKS = (64, 112, 128, 208, 240, 256)


def o_staged_in_q(cfg: KernelConfig, head_dim: int, head_dim_v: int) -> bool:
    """Whether O goes out through Q's shared tile: in the warp-specialised schedule, where
    they have one shape (every Q K^T has finished by then), unless it is persistent (the
    producer then loads the next tile's Q while this tile's O goes out)."""
    return cfg.schedule != "auto" and not cfg.persistent and head_dim == head_dim_v


def has_partial_blocks(spec: TracedSpec, shape: KernelShape, block_N: int) -> bool:
    """Whether some key block may need the masked body: a mask, or a key tail (a dynamic
    length may leave one)."""
    return spec.mask is not None or bool(shape.seqlen_kv % block_N) or shape.dynamic


def one_key_block(shape: KernelShape, block_N: int) -> bool:
    """Whether every query block sees one key block at most (static keys no longer than a
    block): the consumers' loops over the later blocks are left out, and with them the
    registers ptxas would keep for them (124 bytes of spills at ViT's 208-key block)."""
    return not shape.dynamic and shape.seqlen_kv <= block_N


def walks_full_run(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> bool:
    """Whether the warp-specialised consumers walk each query block's longest run of full key
    blocks first, in a loop of the unmasked body alone, and the other blocks after it by
    their class: a branch per block costs the causal forward about 10% (results/NOTES.md
    89-91)."""
    return cfg.schedule != "auto" and has_partial_blocks(spec, shape, cfg.block_N)


def estimate_resources(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, extra_tiles: int = 0
) -> dict[str, int]:
    """Shared memory (bytes) and accumulator registers per consumer thread of the forward
    template. `extra_tiles` counts additional float32 [block_M, block_N] fragments a spec
    needs (e.g. a second live score tile)."""
    o_in_q = o_staged_in_q(cfg, head_dim, head_dim_v)
    smem = elem_bytes * (
        cfg.block_M * head_dim  # Q tile
        + cfg.num_stages * cfg.block_N * (head_dim + head_dim_v)  # K and V ring buffers
        + (0 if o_in_q else cfg.block_M * head_dim_v)  # O staging for the TMA store
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
    if cfg.block_N not in BLOCK_N and not (cfg.schedule != "auto" and cfg.block_N in WS_BLOCK_N):
        out.append(f"block_N={cfg.block_N}: expected one of {BLOCK_N}, or with a "
                   f"warp-specialised schedule one of {WS_BLOCK_N}")
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
    out += _schedule_problems(cfg)
    res = estimate_resources(cfg, head_dim, head_dim_v, elem_bytes, extra_tiles)
    if res["smem_bytes"] > SMEM_LIMIT_BYTES:
        out.append(
            f"shared memory {res['smem_bytes'] // 1024} KiB > {SMEM_LIMIT_BYTES // 1024} KiB "
            f"(block_M={cfg.block_M}, block_N={cfg.block_N}, num_stages={cfg.num_stages}, "
            f"D={head_dim}, Dv={head_dim_v})"
        )
    cap = accumulator_cap(cfg)
    acc = res["regs_per_thread"] - REG_OVERHEAD
    if acc > cap:
        out.append(
            f"accumulators need about {acc} registers per thread > {cap} (the consumer cap with "
            f"threads={cfg.threads}, schedule={cfg.schedule!r}; {cfg.block_M}x{cfg.block_N} "
            f"scores and {cfg.block_M}x{head_dim_v} output)"
        )
    return out


# The warp-specialised schedules' shapes, (block_M, threads): consumer warpgroups of 64 query
# rows each (one warpgroup's rows keep its softmax to itself), two or, overlapped only, three
# (FlashAttention-3's D 64 tile; the ping-pong pairs two); each with the registers its
# consumers keep beyond the accumulators the model counts. Three warpgroups get 160 registers
# a thread; ptxas (locally) at 192 x 128: D 128 (160 of accumulators) spilled 328 bytes,
# D 80 (136) 48, D 64 (128) none, causal 8, masks of more than 2 ops (masked_body_fits)
# 12-404 (key gate, prefix-LM, document, ALiBi, soft-cap, sliding window).
WS_SHAPES = {"overlap": {(128, 256): 0, (192, 384): 32}, "pingpong": {(128, 256): 0}}


def accumulator_cap(cfg: KernelConfig) -> int:
    """Registers a consumer thread of `cfg` has for its accumulators: the cap less what the
    schedule's shape keeps beyond them (WS_SHAPES)."""
    reserve = WS_SHAPES.get(cfg.schedule, {}).get((cfg.block_M, cfg.threads), 0)
    return consumer_register_cap(cfg.threads) - reserve


# The shapes whose unmasked steps retire at the top of the next (FlashAttention-3's order, ws.py):
# three warpgroups, 3-8% faster at D 64; on two it measured 2-9% slower (NOTES 120, 179).
NEXT_STEP_RETIRES = {(192, 384)}


def retires_next_step(cfg: KernelConfig) -> bool:
    """Whether `cfg`'s warp-specialised steps retire at the top of the next step."""
    return cfg.schedule == "overlap" and (cfg.block_M, cfg.threads) in NEXT_STEP_RETIRES


def _schedule_problems(cfg: KernelConfig) -> list[str]:
    """The warp-specialised schedules' shape (WS_SHAPES) and their walk's order."""
    if cfg.schedule not in SCHEDULES:
        return [f"schedule={cfg.schedule!r}: expected one of {SCHEDULES}"]
    if cfg.schedule == "auto":
        return ["persistent=True: expected a warp-specialised schedule ('overlap' or "
                "'pingpong'), not 'auto'"] if cfg.persistent else []
    if cfg.persistent and cfg.swizzle_panel:
        return [f"persistent=True walks the tiles in order: expected swizzle_panel=0, not "
                f"{cfg.swizzle_panel}"]
    shapes = tuple(WS_SHAPES[cfg.schedule])
    if (cfg.block_M, cfg.threads) not in shapes or cfg.gemm_policy != "FullRow":
        allowed = " or ".join(f"block_M={m} with threads={t}" for m, t in shapes)
        return [f"schedule={cfg.schedule!r}: expected {allowed}, and FullRow (consumer "
                f"warpgroups of 64 rows), not block_M={cfg.block_M}, threads={cfg.threads}, "
                f"{cfg.gemm_policy}"]
    return []


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
    headroom = accumulator_cap(cfg) - (res["regs_per_thread"] - REG_OVERHEAD)
    return masked_ops <= FREE_MASKED_OPS + max(0, headroom) // REGS_PER_MASKED_OP


def check_config(
    cfg: KernelConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2, extra_tiles: int = 0
) -> KernelConfig:
    problems = config_problems(cfg, head_dim, head_dim_v, elem_bytes, extra_tiles)
    if problems:
        raise ConfigError(f"invalid KernelConfig {cfg.key()}: " + "; ".join(problems))
    return cfg


# Forward kernels with batch and sequence lengths as runtime symbols (one compile serves every
# length; engine.plan.shape.KernelShape.dynamic). Off until the H100 shows it costs no speed
# (the `engine-dynamic` implementation measures it beside `engine` in the same run);
# ATTNBENCH_DYNAMIC_SHAPES=1 turns it on, as does setting a module's `dynamic_shapes`.
DYNAMIC_SHAPES = os.environ.get("ATTNBENCH_DYNAMIC_SHAPES", "0") == "1"

# Preference order: large tiles first (they amortise the softmax per wgmma best), then
# smaller tiles / fewer stages as head dims grow and shared memory runs out. A spec whose
# partial blocks do more than the register model allows beside the accumulators skips the
# tiles that would spill (masked_body_fits).
PREFERENCE: tuple[KernelConfig, ...] = (
    # The overlap's persistent walk (one block per SM, the next tile loaded while this one
    # finishes), where persistent_by_default allows it: on the H100 (same process, against
    # the plain grid or the tuned entries then in the tune file) ViT-S/16 0.140 -> 0.105 ms,
    # 32/8 heads D 128 at 2k 7% faster, at 8k within 1% (NOTES 116); masked, NOTES 118.
    KernelConfig(128, 128, 2, 256, schedule="overlap", persistent=True),
    # The warp-specialised overlap (FlashAttention-3's intra-warpgroup schedule): on the H100
    # D = 256 went from 0.73-0.75x to 0.83-0.92x FA3; at D = 128 it is within run-to-run
    # noise of the automatic pipeline (results/NOTES.md 88-91).
    KernelConfig(128, 128, 2, 256, schedule="overlap"),
    KernelConfig(128, 64, 2, 256, schedule="overlap"),
    KernelConfig(192, 128, 2, 384),  # 3 consumer warpgroups: 648-656 TFLOP/s at D=128 (H100)
    # Rasterised in panels of 8 blocks: on the H100 at D = 128, 4k, masked variants ran
    # 3-6% faster than unrasterised (sliding window and document within 2%).
    KernelConfig(128, 128, 2, 256, "FullRow", 8),
    KernelConfig(128, 64, 2, 256),
    KernelConfig(128, 64, 1, 256),
    KernelConfig(64, 64, 2, 128),
    KernelConfig(64, 64, 1, 128),
    KernelConfig(64, 32, 1, 128),
)


def ws_by_default(spec: TracedSpec) -> bool:
    """The warp-specialised schedule by default: for online softmaxes (a rescaled output:
    there is an exponential step to overlap) whose score, mask and online step read tensors
    at most per query or per key (staged: per query in registers, per key in the producer's
    rings) or per (batch, head) (ALiBi's slopes, a key gate), not per (query, key).
    On the H100 once the full run is walked without the class branch (results/NOTES.md 100,
    101; B 2 x S 4k, 32/8 heads, D 128), against the automatic pipeline: neighbourhood_2d
    15% faster, soft-cap 7%, Gemma-2 6%, sliding window and dilated 4%, key gate 3%,
    prefix-LM, Mistral's window and ALiBi even; ReLU attention (no softmax to hide) 12%
    slower. The document masks (ids read per query and key), 12-44% slower while their
    consumers read the key ids from global memory and held the mask in P's tile, ran 1.37x
    (document) and 1.47x (document with prefixes) faster walked once the ids came from the
    producer's rings (NOTES 124; Llama-3-8B heads, B 1 x 8k). Not with dynamic shapes: plain
    softmax at 4k took 0.98 ms against the automatic pipeline's 0.85 (NOTES 90)."""
    unstaged = [n for n in _step_nodes(spec) if n.op in CUSTOM_READS and n.axes
                and not (per_query_read(n) or per_key_read(n))]
    return rescales(spec.o_scale) and not unstaged


def _step_nodes(spec: TracedSpec) -> list[Expr]:
    """The nodes a forward step evaluates per score element."""
    return topo([spec.score_mod, spec.online_p, spec.o_scale,
                 *([spec.mask] if spec.mask is not None else [])])


def per_query_read(node: Expr) -> bool:
    """A custom read indexed by the query position alone (staged per query block in a row
    fragment: the codegen's `staged`)."""
    return node.op == "custom" and node.axes == ("m",)


def stages_key_reads(cfg: KernelConfig) -> bool:
    """Whether `cfg`'s kernels stage the per-key reads beside K (the codegen's `per_key`): not
    on three consumer warpgroups, where TileLang's warp specialisation gave the copy to a
    second producer group that ran out of registers; there each element reads them."""
    return cfg.threads <= 256


def per_key_read(node: Expr) -> bool:
    """A custom read indexed by the key position alone (staged per key block: the codegen's
    `per_key`)."""
    return node.op == "custom" and node.axes == ("n",) and node.attr[2][-1] == "kv"


# Masked rows longer than this take the plain grid: the walk hides a fixed cost per tile (its
# Q load and epilogue under the previous tile), a smaller share of longer rows. On the H100,
# causal D 128 against the grid in one process (NOTES 118): 1.17x at 1k, 1.1-1.2x at 2k,
# 1.04-1.08x at 4k, 0.96-1.05x at 8k; at 16k 0.95-0.99x in three probes, Mistral's window 0.97x.
MASKED_WALK_ROWS = 8192


def persistent_by_default(spec: TracedSpec, seqlen_q: int | None = None) -> bool:
    """The persistent walk by default wherever the warp-specialised schedule is the default,
    masked specs up to MASKED_WALK_ROWS query rows (`seqlen_q`; any where unknown); masked
    tiles come from the host's table (walk.py). On the H100, against the plain grid in one
    process (NOTES 118), at 4k: sliding window 1.11x, neighbourhood_2d 1.27x, dilated 1.13x,
    soft-cap 1.07x, ALiBi 1.07-1.20x (1.10-1.20x at 1k); prefix-LM 1.08x and the key gate
    1.16x once ptxas no longer serialised their wgmmas (NOTES 119). Masks that read data
    (documents) walk at every length: a row spans its document, not the sequence (packed
    prefixes at 16k, Llama-3-8B heads: 1.077x the grid, NOTES 124)."""
    long_rows = seqlen_q is not None and seqlen_q > MASKED_WALK_ROWS
    masked_long = spec.mask is not None and long_rows and not reads_data(spec.mask)
    return ws_by_default(spec) and not masked_long


# FlashAttention-3's D 64 forward tile: 192 rows on three consumer warpgroups. Where it pays
# (H200, D 64, B S = 16k, 32 heads, FA3's time over ours against the 128-row walk; NOTES 175):
# unmasked, even at 2k, 0.90 -> 0.94 at 4k, 0.82-0.84 -> 0.93-0.94 at 8k and 16k with three
# stages (two: 0.89-0.94); causal 3% slower at 4k (a tile's diagonal covers two or three key
# blocks instead of one), 0.74 -> 0.83 at 8k and 0.77-0.88 -> 0.87-0.90 at 16k with two
# stages on the persistent walk at every length (three: 0.86-0.89; the plain grid 0.85).
# Other head dims the register model allows (D 32) are not measured. Since the unmasked steps
# retire at the next step's top (ws.py), also from 2k: 0.92 -> 0.98 there, 1.12 -> 1.08 at 1k
# (NOTES 179). Not for specs that read a tensor per key (stages_key_reads): read per element
# at 192 rows a key bias spilled 240 bytes (ptxas, NOTES 180).
WIDE_HEAD_DIM = 64
WIDE_ROWS = 2048
WIDE_MASKED_ROWS = 8192


def wide_tile(head_dim: int, spec: TracedSpec | None, seqlen_q: int | None,
              seqlen_kv: int | None) -> KernelConfig | None:
    """The 192-row tile where it pays: at WIDE_HEAD_DIM, rows and keys known and at least
    WIDE_ROWS (WIDE_MASKED_ROWS masked), no tensor read per key; None elsewhere."""
    masked = spec is not None and spec.mask is not None
    least = WIDE_MASKED_ROWS if masked else WIDE_ROWS
    if head_dim != WIDE_HEAD_DIM or seqlen_q is None or seqlen_kv is None \
            or min(seqlen_q, seqlen_kv) < least:
        return None
    wide = KernelConfig(192, 128, 2 if masked else 3, 384, schedule="overlap", persistent=True)
    if spec is not None and not stages_key_reads(wide) \
            and any(per_key_read(n) for n in _step_nodes(spec)):
        return None
    return wide


# Rows spanning fewer blocks of the preferred tile than this take the least padded tile.
SHORT_ROW_BLOCKS = 4


def default_forward_config(head_dim: int, head_dim_v: int, elem_bytes: int = 2,
                           spec: TracedSpec | None = None, seqlen_q: int | None = None,
                           dynamic: bool = False, seqlen_kv: int | None = None) -> KernelConfig:
    """The first valid config of PREFERENCE; with `spec`, the first whose partial blocks also
    keep within the consumer's registers (the first valid one if none does), the
    warp-specialised schedule only where ws_by_default says so (and its persistent walk
    where persistent_by_default does; its 192-row tile where wide_tile gives it), and
    neither with `dynamic` shapes (runtime lengths).
    With a short `seqlen_q` (a few blocks), the first of those that pads the rows least; with
    a short `seqlen_kv`, its keys in one block (fit_short_keys)."""
    ops = spec.masked_block_ops() if spec is not None else 0
    ws = not dynamic and (spec is None or ws_by_default(spec))
    persistent = ws and (spec is None or persistent_by_default(spec, seqlen_q))

    def sound(c: KernelConfig) -> bool:
        return not config_problems(c, head_dim, head_dim_v, elem_bytes)

    def fits(c: KernelConfig) -> bool:
        return masked_body_fits(c, head_dim, head_dim_v, ops, elem_bytes)

    wide = wide_tile(head_dim, spec, seqlen_q, seqlen_kv) if ws else None
    # its full blocks too evaluate the score_mod per element beside 160 registers of
    # accumulators: counted as a masked block's ops (ptxas at D 64, unmasked: 3 ops, a
    # soft-cap, spilled 24 bytes; 5, ALiBi, 296; NOTES 180)
    step_ops = spec.elementwise_ops() if spec is not None else 0
    if wide is not None and sound(wide) \
            and masked_body_fits(wide, head_dim, head_dim_v, step_ops, elem_bytes):
        return wide
    valid = [c for c in PREFERENCE if sound(c) and (c.schedule == "auto" or ws)
             and (not c.persistent or persistent)]
    if not valid:
        raise ValueError(
            f"no valid forward kernel config for head dims D={head_dim}, Dv={head_dim_v}"
        )
    cfg = _least_padding([c for c in valid if fits(c)] or valid, seqlen_q)
    return fit_short_keys(cfg, seqlen_kv, lambda c: sound(c) and fits(c))


def fit_short_keys(cfg: KernelConfig, seqlen_kv: int | None,
                   valid: Callable[[KernelConfig], bool]) -> KernelConfig:
    """Keys fewer than 256 in one warp-specialised block, the least of FIT_BLOCKS that holds
    them, where that pads less than `cfg`'s blocks: ViT's 197 keys in one block of 208
    rather than two of 128 (on the H100, B 256, 6 heads, D 64: 0.103 -> 0.091 ms, NOTES 121).
    `valid`: whether the fitted config fits the problem."""
    if seqlen_kv is None or cfg.schedule == "auto":
        return cfg
    fitted = next((b for b in FIT_BLOCKS if b >= seqlen_kv), None)
    if fitted is None or fitted >= -(-seqlen_kv // cfg.block_N) * cfg.block_N:
        return cfg
    short = dataclasses.replace(cfg, block_N=fitted)
    return short if valid(short) else cfg


def _least_padding(configs: list[KernelConfig], seqlen_q: int | None) -> KernelConfig:
    """Short rows (ViT's 197 tokens) are mostly tail: 192-row tiles compute 384 rows there,
    128-row ones 256 (the H100: 0.166 -> 0.137 ms at B 256, 6 heads, D 64). Long rows keep the
    preference order, whose first tile amortises best."""
    first = configs[0]
    if seqlen_q is None or seqlen_q >= SHORT_ROW_BLOCKS * first.block_M:
        return first
    # One warpgroup's 64-row tiles run well below the larger ones' rate: only where one tile
    # holds every row.
    fair = [c for c in configs if c.block_M >= min(128, seqlen_q)] or configs
    return min(fair, key=lambda c: -(-seqlen_q // c.block_M) * c.block_M)
