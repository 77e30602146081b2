"""The chunked forward's TileLang sources: the decay kernel, the state pass, the output kernel
and the single pass.

Every decay factor is exp(G_t - G_s) with s <= t, exp(G_end - G_s), exp(G_t) or exp(G_end),
G the chunk-local running sum of the log decays g (g read as zero past the sequence's end):
never above 1 for decays <= 0, and never an exp of a positive difference that a mask must then
remove. The forward's kernels read G per chunk slot (Gc [slots, H, chunk]) from a small decay
kernel run first (generate_decays), so their serial chunk loops load it with the chunk's tiles
instead of summing it behind a barrier per scan step; the backward's kernels sum it in place.

State pass (grid Dv/block_V x D/block_K x sequences*heads): S <- exp(G_end) S +
K_c^T (exp(G_end - G) * V_c), storing S entering each chunk (Hs, in the input dtype: the
output kernel's tensor-core operand) and the final state (fp32).
Output kernel (grid slots x heads): O_c = exp(G) * (Q_c S_c) + ((Q_c K_c^T) * D_c) V_c, with
D_c[t, s] = exp(G_t - G_s) for s <= t, looping over Dv in block_V steps.
"""

from __future__ import annotations

from engine.codegen.params import GeneratedKernel, KernelParam, param
from engine.codegen.source import SourceWriter, write_header
from engine.kernels.linear_fwd.plan import (
    NO_FOLDS,
    Folds,
    LinearConfig,
    LinearShape,
    blocks_per_sm,
    consumer_registers,
    scores_in_fragment,
)
from engine.plan.config import WS_PRODUCER_REGS


def head_text(heads: int, of: int, h: str = "h") -> str:
    """The index of the q (or k) head that output head `h` reads: `heads` of them over `of`."""
    if heads == of:
        return h
    return "0" if heads == 1 else f"({h} // {of // heads})"


def input_params(s: LinearShape) -> list[KernelParam]:
    T, dt = s.seqlen, s.dtype
    return [param("Q", (s.batch, s.heads_q, T, s.head_dim), dt),
            param("K", (s.batch, s.heads_k, T, s.head_dim), dt),
            param("V", (s.batch, s.heads, T, s.head_dim_v), dt)]


def table_params(s: LinearShape, cfg: LinearConfig) -> list[KernelParam]:
    """G (the log decays), Seqs (per sequence: batch row, first position, length, first slot)
    and Chunks (per slot: batch row, first position, length, unused)."""
    return [param("G", (s.batch, s.heads, s.seqlen), "float32"),
            param("Seqs", (s.num_seqs, 4), "int32"),
            param("Chunks", (s.slots(cfg.chunk), 4), "int32")]


def state_param(name: str, s: LinearShape, cfg: LinearConfig) -> KernelParam:
    """Per-slot states [slots, H, D, Dv] in the input dtype."""
    return param(name, (s.slots(cfg.chunk), s.heads, s.head_dim, s.head_dim_v), s.dtype)


def seq_state_param(name: str, s: LinearShape) -> KernelParam:
    """Per-sequence states (initial, final, and their gradients) [N, H, D, Dv] fp32."""
    return param(name, (s.num_seqs, s.heads, s.head_dim, s.head_dim_v), "float32")


def optional_states(s: LinearShape, *flags: tuple[str, bool]) -> list[KernelParam]:
    """The per-sequence state parameters named in `flags` whose flag is set, in order."""
    return [seq_state_param(name, s) for name, wanted in flags if wanted]


def state_pass_tiles(s: LinearShape, cfg: LinearConfig) -> tuple[str, str]:
    """A state pass's grid (Dv/block_V x D/block_K x sequences*heads) and the text of its
    block's [block_K, block_V] tile of a state."""
    BK, BV = cfg.block_K, cfg.block_V
    return (f"{s.head_dim_v // BV}, {s.head_dim // BK}, {s.num_seqs * s.heads}",
            f"ik * {BK}:(ik + 1) * {BK}, iv * {BV}:(iv + 1) * {BV}")


def emit_blocks_per_sm(w: SourceWriter, kernel: str, s: LinearShape, cfg: LinearConfig) -> None:
    """The launch bounds' blocks per SM of a chunk-loop kernel and its registers after
    TileLang's reallocation, where plan.blocks_per_sm asks for more than one block (nothing at
    one: the sources as before)."""
    blocks = blocks_per_sm(kernel, s, cfg)
    if blocks > 1:
        w.lines([f"T.annotate_min_blocks_per_sm({blocks})",
                 f"T.annotate_producer_reg_dealloc({WS_PRODUCER_REGS})",
                 f"T.annotate_consumer_reg_alloc({consumer_registers(kernel, cfg, blocks)})"])


def emit_sequence(w: SourceWriter, s: LinearShape) -> None:
    """The block's sequence and head (grid z: sequence * heads + head), from Seqs."""
    w.lines([f"n: T.int32 = nh // {s.heads}", f"h: T.int32 = nh % {s.heads}",
             "b: T.int32 = Seqs[n, 0]", "bos: T.int32 = Seqs[n, 1]",
             "seqlen: T.int32 = Seqs[n, 2]", "slot0: T.int32 = Seqs[n, 3]"])


def emit_chunk(w: SourceWriter) -> None:
    """The slot's batch row, first position and length, from Chunks (grid x: the slot)."""
    w.lines(["b: T.int32 = Chunks[j, 0]", "row0: T.int32 = Chunks[j, 1]",
             "nrows: T.int32 = Chunks[j, 2]"])


def emit_decays(w: SourceWriter, first: str, length: str, chunk: int) -> None:
    """G_s: the running sum of the chunk's log decays from position `first` (rows at or past
    `length` read as 0, so the sum ends on the chunk's total), by a log-step scan from G_r
    through G_t and G_s. (T.cumsum inside a pipelined loop sums one stage's buffer, not the
    current one; G_r is only ever loaded, so a pipeline may keep it in stages.)"""
    with w.block(f"for r in T.Parallel({chunk}):"):
        w.line(f"G_r[r] = T.if_then_else(r < {length}, G[b, h, {first} + r], T.float32(0))")
    steps = chunk.bit_length() - 1
    src, dst, step = "G_r", ("G_t" if steps % 2 == 0 else "G_s"), 1
    while step < chunk:
        with w.block(f"for r in T.Parallel({chunk}):"):
            w.line(f"{dst}[r] = {src}[r] + T.if_then_else(r >= {step}, {src}[r - {step}], "
                   "T.float32(0))")
        src, dst, step = dst, ("G_t" if dst == "G_s" else "G_s"), step * 2


def chunk_decay_param(s: LinearShape, cfg: LinearConfig) -> KernelParam:
    """Gc [slots, H, chunk]: each slot's G (float32), written by the decay kernel."""
    return param("Gc", (s.slots(cfg.chunk), s.heads, cfg.chunk), "float32")


def weight_param(s: LinearShape, cfg: LinearConfig) -> KernelParam:
    """Wc [slots, H, chunk]: each slot's value weights (Folds.v_weight; 0 past its length)."""
    return param("Wc", (s.slots(cfg.chunk), s.heads, cfg.chunk), "float32")


def forward_table_params(s: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS
                         ) -> list[KernelParam]:
    """The forward kernels' tables: Gc in place of G (and Wc with a value weight), then Seqs
    and Chunks."""
    weights = [weight_param(s, cfg)] if folds.v_weight else []
    return [chunk_decay_param(s, cfg), *weights, *table_params(s, cfg)[1:]]


def slot_buffers(chunk: int, folds: Folds = NO_FOLDS) -> list[str]:
    return [f'{name} = T.alloc_shared(({chunk},), "float32")'
            for name in ("G_s", *(("W_s",) if folds.v_weight else ()))]


def emit_decay_load(w: SourceWriter, slot: str, folds: Folds = NO_FOLDS) -> None:
    """G_s (and W_s): the slot's chunk-local running sum (and value weights), from Gc (Wc)."""
    w.line(f"T.copy(Gc[{slot}, h, :], G_s)")
    if folds.v_weight:
        w.line(f"T.copy(Wc[{slot}, h, :], W_s)")


def generate_decays(s: LinearShape, cfg: LinearConfig, weighted: bool = False
                    ) -> GeneratedKernel:
    """The decay kernel (grid slots x heads): each chunk slot's G into Gc (zeros for unused
    slots, the chunk's total past its length), and with `weighted` the value weights W
    [B, H, T] into Wc by slot (zeros past the length)."""
    C = cfg.chunk
    params = [*table_params(s, cfg), chunk_decay_param(s, cfg)]
    if weighted:
        params[1:1] = [param("W", (s.batch, s.heads, s.seqlen), "float32")]
        params.append(weight_param(s, cfg))
    w = SourceWriter()
    write_header(w, f"# Generated by engine.kernels.linear_fwd: decays {s.key()} {cfg.key()}"
                    + (" weights" if weighted else ""), params)
    with w.indented(), w.block(f"with T.Kernel({s.slots(C)}, {s.heads}, threads={C}) "
                               "as (j, h):"):
        emit_chunk(w)
        w.lines(decay_buffers(C))
        emit_decays(w, "row0", "nrows", C)
        with w.block(f"for r in T.Parallel({C}):"):
            w.line("Gc[j, h, r] = G_s[r]")
            if weighted:
                w.line("Wc[j, h, r] = T.if_then_else(r < nrows, W[b, h, row0 + r], "
                       "T.float32(0))")
    return GeneratedKernel(w.text(), tuple(params))


def decay_buffers(chunk: int) -> list[str]:
    return [f'{name} = T.alloc_shared(({chunk},), "float32")' for name in ("G_r", "G_t", "G_s")]


def cast(dtype: str, x: str) -> str:
    return f'T.Cast("{dtype}", {x})'


def generate_states(s: LinearShape, cfg: LinearConfig, initial: bool, final: bool,
                    folds: Folds = NO_FOLDS) -> GeneratedKernel:
    """The forward state pass: Hs (the state entering every chunk) and, if `final`, Ht."""
    C, BK, BV, dt = cfg.chunk, cfg.block_K, cfg.block_V, s.dtype
    params = [*input_params(s)[1:], *forward_table_params(s, cfg, folds),
              state_param("Hs", s, cfg), *optional_states(s, ("H0", initial), ("Ht", final))]
    w = SourceWriter()
    write_header(w, f"# Generated by engine.kernels.linear_fwd: state pass {s.key()} "
                    f"{cfg.key()} h0={int(initial)} ht={int(final)}{folds.note()}", params)
    hk = head_text(s.heads_k, s.heads)
    grid, tile = state_pass_tiles(s, cfg)
    with w.indented(), w.block(f"with T.Kernel({grid}, threads={cfg.threads}) as (iv, ik, nh):"):
        emit_blocks_per_sm(w, "states", s, cfg)
        emit_sequence(w, s)
        w.lines([f'K_s = T.alloc_shared(({C}, {BK}), "{dt}")',
                 f'V_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 f'Vd_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 f'S_s = T.alloc_shared(({BK}, {BV}), "{dt}")',
                 *slot_buffers(C, folds),
                 f'acc = T.alloc_fragment(({BK}, {BV}), "float32")'])
        w.line(f"T.copy(H0[n, h, {tile}], acc)" if initial else "T.clear(acc)")
        rows = f"bos + c * {C}:bos + (c + 1) * {C}"
        with w.block(f"for c in T.Pipelined(T.ceildiv(seqlen, {C}), "
                     f"num_stages={cfg.num_stages}):"):
            # by a TMA store from S_s: stored thread by thread from registers, the state
            # passes took 16-47% longer on the H200 (results/NOTES.md 205)
            w.line("T.copy(acc, S_s)")
            w.line(f"T.copy(S_s, Hs[slot0 + c, h, {tile}])")
            w.line(f"T.copy(K[b, {hk}, {rows}, ik * {BK}:(ik + 1) * {BK}], K_s)")
            w.line(f"T.copy(V[b, h, {rows}, iv * {BV}:(iv + 1) * {BV}], V_s)")
            emit_decay_load(w, "slot0 + c", folds)
            emit_state_update(w, C, BK, BV, dt, "acc", folds)
        if final:
            w.line(f"T.copy(acc, Ht[n, h, {tile}])")
    return GeneratedKernel(w.text(), tuple(params))


def generate_output(s: LinearShape, cfg: LinearConfig, folds: Folds = NO_FOLDS
                    ) -> GeneratedKernel:
    """The output kernel: O from the chunk's q, k, v and the state entering it (with the
    folded mods)."""
    C, BV, D, dt = cfg.chunk, cfg.block_V, s.head_dim, s.dtype
    params = [*input_params(s), *forward_table_params(s, cfg, folds),
              state_param("Hs", s, cfg),
              param("O", (s.batch, s.heads, s.seqlen, s.head_dim_v), dt)]
    w = SourceWriter()
    write_header(w, f"# Generated by engine.kernels.linear_fwd: output {s.key()} {cfg.key()}"
                    + folds.note(), params)
    hq, hk = head_text(s.heads_q, s.heads), head_text(s.heads_k, s.heads)
    grid = f"{s.slots(C)}, {s.heads}"
    with w.indented(), w.block(f"with T.Kernel({grid}, threads={cfg.threads}) as (j, h):"):
        emit_chunk(w)
        w.lines([f'Q_s = T.alloc_shared(({C}, {D}), "{dt}")',
                 f'K_s = T.alloc_shared(({C}, {D}), "{dt}")',
                 f'V_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 f'S_s = T.alloc_shared(({D}, {BV}), "{dt}")',
                 f'A_s = T.alloc_shared(({C}, {C}), "{dt}")',
                 f'O_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 *slot_buffers(C, folds),
                 f'A = T.alloc_fragment(({C}, {C}), "float32")',
                 f'acc = T.alloc_fragment(({C}, {BV}), "float32")'])
        w.line(f"T.copy(Q[b, {hq}, row0:row0 + {C}, :], Q_s)")
        w.line(f"T.copy(K[b, {hk}, row0:row0 + {C}, :], K_s)")
        emit_decay_load(w, "j", folds)
        emit_intra(w, "output", C, dt, folds)
        with w.block(f"for iv in T.serial({s.head_dim_v // BV}):"):
            w.line(f"T.copy(Hs[j, h, :, iv * {BV}:(iv + 1) * {BV}], S_s)")
            w.line(f"T.copy(V[b, h, row0:row0 + {C}, iv * {BV}:(iv + 1) * {BV}], V_s)")
            emit_output_tile(w, C, BV, f"O[b, h, row0 + t, iv * {BV} + v]", folds)
    return GeneratedKernel(w.text(), tuple(params))


def emit_state_update(w: SourceWriter, C: int, rows: int, BV: int, dt: str, state: str,
                      folds: Folds = NO_FOLDS) -> None:
    """state <- exp(G_end) state + K_s^T (exp(G_end - G) * W * V_s) (W: the value weights,
    if folded), the rows at or past the sequence's end (c * C + r >= seqlen) left out."""
    with w.block(f"for r, v in T.Parallel({C}, {BV}):"):
        decay = weighted(f"T.exp(G_s[{C - 1}] - G_s[r])", "r", folds.v_weight)
        w.line(f"Vd_s[r, v] = T.if_then_else(c * {C} + r < seqlen, "
               + cast(dt, f'T.Cast("float32", V_s[r, v]) * {decay}')
               + f", {cast(dt, 0)})")
    with w.block(f"for d, v in T.Parallel({rows}, {BV}):"):
        w.line(f"{state}[d, v] = {state}[d, v] * T.exp(G_s[{C - 1}])")
    w.line(f"T.gemm(K_s, Vd_s, {state}, transpose_A=True)")


def scaled(factor: str, folds: Folds) -> str:
    """`factor` times the folded q scale (the factor itself without one)."""
    q = folds.q_scale
    return factor if q == 1.0 else f"({factor} * T.float32({q!r}))"


def weighted(factor: str, pos: str, v_weight: bool) -> str:
    """`factor` times key position `pos`'s folded value weight W_s (itself without one)."""
    return f"({factor} * W_s[{pos}])" if v_weight else factor


def emit_intra(w: SourceWriter, kernel: str, C: int, dt: str, folds: Folds = NO_FOLDS) -> None:
    """A_s = (Q_s K_s^T) * exp(G_t - G_s) (* W_s, * q_scale: the folds) for s <= t: the
    chunk's own decayed scores."""
    w.line("T.clear(A)")
    w.line("T.gemm(Q_s, K_s, A, transpose_B=True)")
    factor = scaled(weighted("T.exp(G_s[t] - G_s[u])", "u", folds.v_weight), folds)
    emit_masked_scores(w, kernel, "A", "A_s", ("t", "u"), C, dt, "u <= t", factor)


def emit_masked_scores(w: SourceWriter, kernel: str, acc: str, target: str,
                       axes: tuple[str, str], C: int, dt: str, keep: str, factor: str) -> None:
    """target = acc * factor where `keep`, else 0, over `kernel`'s [C, C] scores (`axes`
    their indices), cast to `dt`: in acc's registers first and then copied whole where
    plan.scores_in_fragment says so, else element by element into shared memory."""
    i, j = axes
    in_fragment = scores_in_fragment(kernel)
    with w.block(f"for {i}, {j} in T.Parallel({C}, {C}):"):
        if in_fragment:
            w.line(f"{acc}[{i}, {j}] = T.if_then_else({keep}, {acc}[{i}, {j}] * {factor}, "
                   "T.float32(0))")
        else:
            w.line(f"{target}[{i}, {j}] = T.if_then_else({keep}, "
                   + cast(dt, f"{acc}[{i}, {j}] * {factor}") + f", {cast(dt, 0)})")
    if in_fragment:
        w.line(f"T.copy({acc}, {target})")


def emit_output_tile(w: SourceWriter, C: int, BV: int, target: str, folds: Folds = NO_FOLDS
                     ) -> None:
    """One value tile of the chunk's output, exp(G) * q_scale * (Q_s S_s) + A_s V_s (A_s
    already scaled), stored to `target` (row t, column v) for its valid rows."""
    w.line("T.clear(acc)")
    w.line("T.gemm(Q_s, S_s, acc)")
    with w.block(f"for t, v in T.Parallel({C}, {BV}):"):
        w.line(f"acc[t, v] = acc[t, v] * {scaled('T.exp(G_s[t])', folds)}")
    w.line("T.gemm(A_s, V_s, acc)")
    w.line("T.copy(acc, O_s)")
    emit_rows(w, target, "O_s[t, v]", C, BV)


def generate_fused(s: LinearShape, cfg: LinearConfig, initial: bool, final: bool,
                   folds: Folds = NO_FOLDS, save: bool = False) -> GeneratedKernel:
    """The single-pass forward (grid Dv/block_V x sequences*heads): each block walks its
    sequence's chunks with its [D, block_V] slice of the state in registers, writing the
    chunk's output from the state entering it and then updating the state. The per-chunk
    states go through memory only with `save` (Hs, as the state pass writes them, for the
    backward to read instead of running that pass again). `folds`: the mods applied in the
    kernel."""
    C, BV, D, dt = cfg.chunk, cfg.block_V, s.head_dim, s.dtype
    params = [*input_params(s), *forward_table_params(s, cfg, folds),
              param("O", (s.batch, s.heads, s.seqlen, s.head_dim_v), dt),
              *([state_param("Hs", s, cfg)] if save else []),
              *optional_states(s, ("H0", initial), ("Ht", final))]
    w = SourceWriter()
    write_header(w, f"# Generated by engine.kernels.linear_fwd: single pass {s.key()} "
                    f"{cfg.key()} h0={int(initial)} ht={int(final)}{folds.note()}"
                    + (" hs=1" if save else ""), params)
    hq, hk = head_text(s.heads_q, s.heads), head_text(s.heads_k, s.heads)
    grid = f"{s.head_dim_v // BV}, {s.num_seqs * s.heads}"
    cols = f"iv * {BV}:(iv + 1) * {BV}"
    with w.indented(), w.block(f"with T.Kernel({grid}, threads={cfg.threads}) as (iv, nh):"):
        emit_blocks_per_sm(w, "single", s, cfg)
        emit_sequence(w, s)
        w.lines([f'Q_s = T.alloc_shared(({C}, {D}), "{dt}")',
                 f'K_s = T.alloc_shared(({C}, {D}), "{dt}")',
                 f'V_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 f'Vd_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 f'S_s = T.alloc_shared(({D}, {BV}), "{dt}")',
                 f'A_s = T.alloc_shared(({C}, {C}), "{dt}")',
                 f'O_s = T.alloc_shared(({C}, {BV}), "{dt}")',
                 *slot_buffers(C, folds),
                 f'A = T.alloc_fragment(({C}, {C}), "float32")',
                 f'acc = T.alloc_fragment(({C}, {BV}), "float32")',
                 f'state = T.alloc_fragment(({D}, {BV}), "float32")'])
        w.line(f"T.copy(H0[n, h, :, {cols}], state)" if initial else "T.clear(state)")
        rows = f"bos + c * {C}:bos + (c + 1) * {C}"
        with w.block(f"for c in T.Pipelined(T.ceildiv(seqlen, {C}), "
                     f"num_stages={cfg.num_stages}):"):
            w.line(f"T.copy(Q[b, {hq}, {rows}, :], Q_s)")
            w.line(f"T.copy(K[b, {hk}, {rows}, :], K_s)")
            w.line(f"T.copy(V[b, h, {rows}, {cols}], V_s)")
            emit_decay_load(w, "slot0 + c", folds)
            w.line("T.copy(state, S_s)")
            if save:
                w.line(f"T.copy(S_s, Hs[slot0 + c, h, :, {cols}])")
            w.lines(["row0: T.int32 = bos + c * " + str(C),
                     f"nrows: T.int32 = T.min(seqlen - c * {C}, {C})"])
            emit_intra(w, "single", C, dt, folds)
            emit_output_tile(w, C, BV, f"O[b, h, row0 + t, iv * {BV} + v]", folds)
            emit_state_update(w, C, D, BV, dt, "state", folds)
        if final:
            w.line(f"T.copy(state, Ht[n, h, :, {cols}])")
    return GeneratedKernel(w.text(), tuple(params))


def emit_rows(w: SourceWriter, target: str, value: str, rows: int, cols: int) -> None:
    """Store the chunk's valid rows (t < nrows) of a [rows, cols] tile: the rows past a
    sequence's end belong to the next packed sequence, or lie past the tensor."""
    with w.block(f"for t, v in T.Parallel({rows}, {cols}):"), w.block("if t < nrows:"):
        w.line(f"{target} = {value}")
