"""The forward kernel: TileLang source generated from a TracedSpec and a KernelConfig.

One thread block computes block_M query rows of one (batch, query head) (with the persistent
walk, ws.TileWalk, such tiles one after another). It loads its Q tile
once (TMA), then walks the non-empty key blocks [lo, hi) given by the mask analysis: for each,
S = Q K^T (wgmma), the spec's score_mod and online_fwd (row reductions, new row scales,
o_scale: online.py), O = O * o_scale + P V (wgmma). Only blocks the mask analysis marks partial
evaluate the mask. After the loop the epilogue normalises O and writes O and the final row
scales (e.g. lse) for the backward.
"""

from __future__ import annotations

from engine.codegen.emit import Emitter, const_text, gather_text, let_uniforms
from engine.codegen.params import GeneratedKernel, KernelParam, custom_param, param
from engine.codegen.rings import pass_configs_line
from engine.codegen.source import SourceWriter, write_header
from engine.codegen.walk_order import grid_order
from engine.dsl.expr import CUSTOM_READS, Expr, topo
from engine.ir.spec import TracedSpec
from engine.kernels.attention_fwd import walk, ws
from engine.kernels.attention_fwd.online import OnlineBody, prepare_online, rescales, step_roots
from engine.kernels.attention_fwd.plan import (
    has_partial_blocks,
    one_key_block,
    per_key_read,
    per_query_read,
    stages_key_reads,
    walks_full_run,
)
from engine.mask.analysis import reads_data
from engine.plan.config import (
    H100_SMS,
    WS_PRODUCER_THREADS,
    KernelConfig,
    consumer_register_cap,
)
from engine.plan.fold import index_texts, row_fold
from engine.plan.shape import KernelShape


class _Frame:
    """The texts the kernel's pieces share: sizes, indices and where custom reads come from.
    `shape` is the problem's, `tiled` the one the kernel tiles: a dilated mask's fold
    (engine.plan.fold) has more heads and shorter rows, and its indices name the positions."""

    def __init__(self, spec: TracedSpec, shape: KernelShape, cfg: KernelConfig):
        self.fold = fold = row_fold(spec, shape)
        self.spec = fold.spec if fold else spec
        self.shape, self.cfg = shape, cfg
        self.tiled = fold.tiled if fold else shape
        self.ws = cfg.schedule != "auto"
        self.full_run = walks_full_run(self.spec, self.tiled, cfg)
        bM, bN = cfg.block_M, cfg.block_N
        self.q_row = f"bx * {bM} + i"  # the tile's row, of the tiled shape
        self.q_idx, self.kv_idx, head = index_texts(fold, f"({self.q_row})", f"(kb * {bN} + j)",
                                                    "by")
        self.q_pos = self.q_idx if fold else self.q_row  # row i's query position, F's index
        self.index_text = {"b": "bz", "h": head, "q": self.q_idx, "kv": self.kv_idx}
        self.clamp = {"q": f"T.min({self.q_idx}, {shape.last_text('q')})",
                      "kv": f"T.min({self.kv_idx}, {shape.last_text('kv')})"}
        # Custom reads indexed by the query alone (staged in row fragments), and by the key
        # alone (copied per key block beside K: buffer, source slice).
        self.customs_1d: dict[tuple, Expr] = {}
        self.staged: dict[tuple, str] = {}
        self.per_key: dict[tuple, tuple[str, str]] = {}
        self._place_custom_reads()
        # Reads that are one value per (batch, head) (a gate's sigmoid, ALiBi's slope), as
        # scalars written once per tile: written in each step, their global load and math
        # sat between the scores' wait and the row max, and held registers there that made
        # ptxas serialise the key gate's wgmmas with the persistent walk (C7511).
        self.online = prepare_online(self.spec)
        self.uniform_lets, self.step_bind = let_uniforms(step_roots(self.online), self.bind)

    def _place_custom_reads(self) -> None:
        """Custom reads indexed by the query position only are staged once per query block in
        a row fragment instead of being re-read from global memory per element. Those indexed
        by the key position only (a document id per key) are copied per key block into shared
        memory beside K: on the H100 the document forward ran 5% faster (the per-element
        global reads of partial blocks were 13% of its time). In the automatic pipeline a
        T.copy of the block's slice; in the warp-specialised schedule the producer warp fills
        a ring stage beside K's (`per_key` then holds the element read at position t). Not
        where the config does not stage them (stages_key_reads)."""
        spec, bN = self.spec, self.cfg.block_N
        nodes = topo([spec.score_mod, *([spec.mask] if spec.mask is not None else []),
                      spec.online_p, spec.o_scale, *(e for _, e in spec.online_updates)])
        self.customs_1d = {n.key: n for n in nodes if per_query_read(n)}
        self.staged = {key: f"cq{i}" for i, key in enumerate(sorted(self.customs_1d, key=str))}
        # The automatic pipeline copies a whole key block: static lengths that the key blocks
        # tile exactly; the producer warp's fill clamps each position.
        whole_blocks = not self.shape.dynamic and self.shape.seqlen_kv % bN == 0
        if not stages_key_reads(self.cfg) or self.fold or not (self.ws or whole_blocks):
            return
        reads = sorted({n.key: n for n in nodes if per_key_read(n)}.items(),
                       key=lambda kv: str(kv[0]))
        key_at = f"T.min(kb * {bN} + t, {self.shape.last_text('kv')})" if self.ws \
            else f"kb * {bN}:(kb + 1) * {bN}"
        for i, (key, node) in enumerate(reads):
            name, _, index = node.attr
            parts = [key_at if s == "kv" else self.index_text.get(s, "0")
                     if isinstance(s, str) else "0" for s in index]
            self.per_key[key] = (f"cks{i}", f"C_{name}[{', '.join(parts)}]")

    def mask_reads_staged(self) -> bool:
        """Whether every tensor the mask reads is staged (per query in registers, per key in
        shared memory): re-evaluating it then costs no global read."""
        reads = [n for n in topo([self.spec.mask]) if n.op in CUSTOM_READS]
        return all(n.key in self.staged or n.key in self.per_key for n in reads)

    def custom_global(self, node: Expr) -> str:
        name, _, index = node.attr
        parts = [self.clamp.get(s, self.index_text.get(s, "0")) if isinstance(s, str) else "0"
                 for s in index]
        return f"C_{name}[{', '.join(parts)}]"

    def bind(self, node: Expr) -> str | None:
        if node.op == "idx":
            return self.index_text[node.attr]
        if node.op == "custom":
            if node.key in self.staged:
                return f"{self.staged[node.key]}[i]"
            if node.key in self.per_key:  # ws: the ring stage of the step (ConsumerLoop)
                return f"{self.per_key[node.key][0]}[{'ks, ' if self.ws else ''}j]"
            return self.custom_global(node)
        if node.op == "gather":
            return gather_text(node, self.bind, self.shape.dim_sizes)
        if node.op == "rowscale":
            return f"rs_{node.attr}[i]"
        return None

    @property
    def table_index(self) -> str:
        """A thread block's row of the mask tables (batch, head)."""
        return f"{self.shape.mask_batch_index}, {'by' if self.shape.mask_heads > 1 else '0'}"


def generate_forward(spec: TracedSpec, shape: KernelShape, cfg: KernelConfig) -> GeneratedKernel:
    """TileLang source defining `main`, the forward prim_func of `spec` at `shape`, and its
    parameters."""
    f = _Frame(spec, shape, cfg)
    full, partial = _online_bodies(f)
    params = signature(f)
    w = SourceWriter()
    preamble = "\n".join(x for x in (shape.preamble, pass_configs_line() if f.ws else "") if x)
    folded = f", rows folded by {f.fold.stride}" if f.fold else ""
    write_header(w, f"# Generated by engine.codegen.forward: spec {spec.hash}, config {cfg.key()}"
                 f"{folded}", params, preamble=preamble)
    grid_q = f.tiled.blocks_text(f.tiled.sq_text, f.tiled.seqlen_q, cfg.block_M)
    threads = cfg.threads + (WS_PRODUCER_THREADS if f.ws else 0)
    # Masked rows differ in length: the longest of a head's query blocks start first (for a
    # causal mask, the last ones), so that the shortest make the grid's tail.
    reverse = f.full_run
    tiles = _tile_walk(f, grid_q, reverse)
    if tiles.persistent:
        grid, names = f"{tiles.blocks}", "pid"
    else:
        grid, names = f"{grid_q}, {f.tiled.heads_q}, {shape.b_text}", \
            f"({'bxr' if reverse else 'bx'}, by, bz)"
    with w.indented(), w.block(f"with T.Kernel({grid}, threads={threads}) as {names}:"):
        if reverse and not tiles.persistent:
            w.line(f"bx: T.int32 = {grid_q} - 1 - bxr")
        _emit_buffers(w, f, full.temps | (partial.temps if partial else set()))
        if f.ws:
            _emit_ws_body(w, f, full, partial, tiles)
        else:
            w.line(f"T.copy({_q_tile(f)}, Q_shared)")
            _emit_state_init(w, f)
            _emit_key_loop(w, f, full, partial)
            _emit_epilogue(w, f)
    return GeneratedKernel(w.text(), tuple(params))


def _tile_walk(f: _Frame, grid_q: str, reverse: bool) -> ws.TileWalk:
    """The persistent walk's tiles over one thread block per SM (walk.py: in grid order, or
    from the host's table where a mask makes rows differ in length), or the plain grid's one
    tile a block."""
    if not f.cfg.persistent:
        return ws.TileWalk(False, f.cfg.num_stages)
    t = f.tiled
    if f.shape.dynamic:  # runtime lengths: the tiles counted in the kernel
        count, blocks = f"{grid_q} * {t.heads_q} * {f.shape.b_text}", H100_SMS
    else:
        blocks, tiles = walk.static_blocks(t, f.cfg.block_M)
        count = str(tiles)
    order = walk.table_order(blocks, grid_q, t.heads_q) if walk.walks_table(f.spec, t, f.cfg) \
        else grid_order(count, blocks, grid_q, t.heads_q, reverse)
    return ws.TileWalk(True, f.cfg.num_stages, order.trips, order.tile, blocks,
                       (*order.indices, *_key_range_lines(f)))


def _key_range_lines(f: _Frame) -> list[str]:
    """A tile's key blocks: [lo, lo + n), and the full run [fs, fs + nf) where walked."""
    lines = [f"lo: T.int32 = Lo[{f.table_index}, bx]",
             f"n: T.int32 = Hi[{f.table_index}, bx] - lo"]
    if f.full_run:
        lines += [f"fs: T.int32 = Fs[{f.table_index}, bx]",
                  f"nf: T.int32 = Fe[{f.table_index}, bx] - fs"]
    return lines


def signature(f: _Frame) -> list[KernelParam]:
    """Q, K, V (of the tiled shape), the custom inputs, the block tables, O (tiled) and the
    final row scales (the problem's)."""
    shape, t, cfg = f.shape, f.tiled, f.cfg
    Bt, Sq, Skv, Hq, dt = shape.b_text, shape.sq_text, shape.skv_text, shape.heads_q, shape.dtype
    nqb = t.table_blocks_text("q", t.seqlen_q, cfg.block_M)
    nkb = t.table_blocks_text("kv", t.seqlen_kv, cfg.block_N)
    lead = (shape.mask_batch_text, shape.mask_heads)
    return [
        param("Q", (Bt, t.sq_text, t.heads_q, shape.head_dim), dt),
        param("K", (Bt, t.skv_text, t.heads_kv, shape.head_dim), dt),
        param("V", (Bt, t.skv_text, t.heads_kv, shape.head_dim_v), dt),
        *(custom_param(f"C_{name}", dims, Bt, Hq, Sq, Skv) for name, dims in f.spec.customs),
        param("Lo", (*lead, nqb), "int32"),
        param("Hi", (*lead, nqb), "int32"),
        param("Cls", (*lead, nqb, nkb), "int8"),
        *([param(n, (*lead, nqb), "int32") for n in ("Fs", "Fe")] if f.full_run else []),
        *([param("Walk", (sum(walk.static_blocks(t, cfg.block_M)) + 1,), "int32")]
          if walk.walks_table(f.spec, t, cfg) else []),
        param("O", (Bt, t.sq_text, t.heads_q, shape.head_dim_v), dt),
        *(param(f"F_{name}", (Bt, Hq, Sq), "float32") for name in f.spec.final_names),
    ]


def _online_bodies(f: _Frame) -> tuple[OnlineBody, OnlineBody | None]:
    """The online step for full blocks, and for partial ones (None when no block is partial)."""
    spec, shape, bM, bN = f.spec, f.shape, f.cfg.block_M, f.cfg.block_N
    full = OnlineBody(f.online, f.step_bind, None, bM, bN, p_in_acc=f.ws, own_uniforms=False)
    # A dynamic length may leave a key tail: the bound is then always part of the mask (it
    # costs nothing in full blocks, which the class table sends to the unmasked body).
    if not has_partial_blocks(spec, f.tiled, bN):
        return full, None
    conds = [f"({f.kv_idx} < {shape.skv_text})"]
    if spec.mask is not None:
        conds.insert(0, Emitter(f.bind).text(spec.mask))
    mask = conds[0] if len(conds) == 1 else f"T.And({conds[0]}, {conds[1]})"
    # Masks that read tensors (document ids) are evaluated once per partial block into a tile;
    # index-only masks are cheaper to recompute inline (measured on the H100: causal 4k
    # 516 vs 452 TFLOP/s inline vs once, document 61 vs 104). In the warp-specialised
    # schedule the tile would be acc_s_cast, the running P V's operand, so a partial block
    # waited for that gemm before its softmax: there a mask whose reads are all staged
    # is recomputed inline.
    by_value = f.ws and reads_data(spec.mask) and f.mask_reads_staged()
    once = shape.dtype if reads_data(spec.mask) and not by_value else None
    return full, OnlineBody(f.online, f.step_bind, mask, bM, bN, once, p_in_acc=f.ws,
                            own_uniforms=False, mask_by_value=by_value)


def _emit_buffers(w: SourceWriter, f: _Frame, temps: set[str]) -> None:
    bM, bN, D, Dv, dt = f.cfg.block_M, f.cfg.block_N, f.shape.head_dim, f.shape.head_dim_v, \
        f.shape.dtype
    if f.ws:
        w.lines(ws.ws_buffers(f.cfg, D, Dv, dt))
    else:
        for name, rows, cols in (("Q_shared", bM, D), ("K_shared", bN, D),
                                 ("V_shared", bN, Dv), ("O_shared", bM, Dv)):
            w.line(f'{name} = T.alloc_shared(({rows}, {cols}), "{dt}")')
    w.line(f'acc_s = T.alloc_fragment(({bM}, {bN}), "float32")')
    w.line(f'acc_s_cast = T.alloc_fragment(({bM}, {bN}), "{dt}")')
    w.line(f'acc_o = T.alloc_fragment(({bM}, {Dv}), "float32")')
    rows = [f"rs_{name}" for name, _ in f.spec.online_init] + sorted(temps) + list(f.staged.values())
    w.lines([f'{name} = T.alloc_fragment(({bM},), "float32")' for name in rows])
    ring = f"{f.cfg.num_stages}, " if f.ws else ""
    w.lines([f'{buf} = T.alloc_shared(({ring}{bN},), "float32")' for buf, _ in f.per_key.values()])
    if f.cfg.swizzle_panel:
        w.line(f"T.use_swizzle({f.cfg.swizzle_panel})")


def _q_tile(f: _Frame) -> str:
    bM = f.cfg.block_M
    return f"Q[bz, bx * {bM}:(bx + 1) * {bM}, by, :]"


def _kv_tile(f: _Frame, name: str) -> str:
    bN, G = f.cfg.block_N, f.shape.heads_q // f.shape.heads_kv
    return f"{name}[bz, kb * {bN}:(kb + 1) * {bN}, by // {G}, :]"


def _emit_state_init(w: SourceWriter, f: _Frame) -> None:
    """The output accumulator, the staged custom reads, the block-uniform reads and the row
    scales."""
    bM = f.cfg.block_M
    w.line("T.fill(acc_o, 0)")
    for key, buf in f.staged.items():
        with w.block(f"for i in T.Parallel({bM}):"):
            w.line(f"{buf}[i] = {f.custom_global(f.customs_1d[key])}")
    w.lines(f.uniform_lets)
    for name, init in f.spec.online_init:
        w.line(f"T.fill(rs_{name}, {const_text(init, 'float')})")


def _emit_key_loop(w: SourceWriter, f: _Frame, full: OnlineBody, partial: OnlineBody | None
                   ) -> None:
    """The pipelined walk over the key blocks [Lo, Hi): S, the online step (the partial one
    where the class table says so), the rescale and O += P V."""
    bM = f.cfg.block_M
    policy = f"T.GemmWarpPolicy.{f.cfg.gemm_policy}"
    lo, hi = f"Lo[{f.table_index}, bx]", f"Hi[{f.table_index}, bx]"
    with w.block(f"for k in T.Pipelined({hi} - {lo}, num_stages={f.cfg.num_stages}):"):
        w.line(f"kb: T.int32 = {lo} + k")
        w.line(f"T.copy({_kv_tile(f, 'K')}, K_shared)")
        w.lines([f"T.copy({src}, {buf})" for buf, src in f.per_key.values()])
        w.line("T.clear(acc_s)")
        w.line(f"T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy={policy})")
        if partial is None:
            w.line(full.source)
        else:
            with w.block(f"if Cls[{f.table_index}, bx, kb] == 2:"):
                w.line(full.source)
            with w.block("else:"):
                w.line(partial.source)
        if rescales(full.o_scale):
            with w.block(f"for i, j in T.Parallel({bM}, {f.shape.head_dim_v}):"):
                w.line("acc_o[i, j] *= o_scale_f[i]")
        w.line(f"T.copy({_kv_tile(f, 'V')}, V_shared)")
        w.line(f"T.gemm(acc_s_cast, V_shared, acc_o, policy={policy})")


def _emit_ws_body(w: SourceWriter, f: _Frame, full: OnlineBody, partial: OnlineBody | None,
                  tiles: ws.TileWalk) -> None:
    """The warp-specialised schedule (ws.py): the producer warp's branch, then the
    consumers' state, key loop and epilogue, for each of the block's tiles."""
    cfg = f.cfg
    order = ws.KeyOrder(f.full_run)
    w.line("tx = T.get_thread_binding()")
    if tiles.persistent:
        w.line("cnt[0] = 0")
    else:
        w.lines(_key_range_lines(f))
    ws.emit_producer(w, _q_tile(f), _kv_tile(f, "K"), _kv_tile(f, "V"), order, tiles,
                     tuple(f.per_key.values()), cfg.block_N)
    with w.block("else:"):
        w.line(f"T.set_max_nreg({consumer_register_cap(cfg.threads)}, 1)")
        loop = ws.ConsumerLoop(w, full, partial,
                               f"Cls[{f.table_index}, bx, kb]" if partial else None, cfg,
                               f.shape.head_dim_v, order, tiles,
                               one_block=one_key_block(f.tiled, cfg.block_N),
                               key_stage=bool(f.per_key))
        if tiles.persistent:  # the turns go on from tile to tile
            loop.start()
        with tiles.each(w):
            _emit_state_init(w, f)
            if not tiles.persistent:
                loop.start()
            policy = f"policy=T.GemmWarpPolicy.{cfg.gemm_policy}"
            loop.emit(lambda st: f"T.wgmma_gemm(Q_shared, K_shared[{st}, :, :], acc_s, "
                                 f"transpose_B=True, {policy}, clear_accum=True)",
                      lambda st: f"T.wgmma_gemm(acc_s_cast, V_shared[{st}, :, :], acc_o, "
                                 f"{policy})")
            _emit_epilogue(w, f)


def _emit_epilogue(w: SourceWriter, f: _Frame) -> None:
    """O normalised by the spec's epilogue (NaN, from rows without any unmasked key such as
    0/0 in softmax, outputs 0), and the final row scales."""
    bM, Sq = f.cfg.block_M, f.tiled.sq_text
    o_text = Emitter(lambda n: "acc_o[i, j]" if n.op == "o" else f.bind(n)).text(f.spec.epilogue_o)
    with w.block(f"for i, j in T.Parallel({bM}, {f.shape.head_dim_v}):"):
        w.line(f"acc_o[i, j] = T.if_then_else(T.isnan({o_text}), T.float32(0.0), {o_text})"
               if o_text != "acc_o[i, j]" else "acc_o[i, j] = acc_o[i, j]")
    stage = ws.o_stage(f.cfg, f.shape.head_dim, f.shape.head_dim_v) if f.ws else "O_shared"
    if f.cfg.persistent:  # the last tile's O store has read the stage (its issuer waits)
        w.line(f"T.sync_threads({ws.EPILOGUE_BARRIER}, {f.cfg.threads})")
    w.line(f"T.copy(acc_o, {stage})")
    if f.ws:  # the stores seen by the copy engine, then every consumer's rows in
        w.line("T.fence_proxy_async()")
        w.line(f"T.sync_threads({ws.EPILOGUE_BARRIER}, {f.cfg.threads})")
    w.line(f"T.copy({stage}, O[bz, bx * {bM}:(bx + 1) * {bM}, by, :])")
    inits = dict(f.spec.final_init)
    for name, fexpr in f.spec.epilogue_final:
        t = Emitter(f.bind).text(fexpr)
        with w.block(f"for i in T.Parallel({bM}):"), w.block(f"if {f.q_row} < {Sq}:"):
            w.line(f"F_{name}[bz, {f.index_text['h']}, {f.q_pos}] = T.if_then_else(T.isnan({t}), "
                   f"{const_text(inits[name], 'float')}, {t})")
