"""One step of the main kernel: the thread block's keys against query block qb.

    S^T = K Q^T (recomputed), P^T = fwd_recompute(score_mod(S^T), finals)
    dP^T = V dO^T, dS'^T = bwd(dP^T, P^T, finals, doosum), dS^T = dS'^T * d score_mod/d score
    dV += P^T dO, dK += dS^T Q, dQ += dS K, and the custom gradients' row sums

Only partial blocks (mask analysis, plus the key and query tails) evaluate the mask; there
masked entries give P = 0 and dS = 0."""

from __future__ import annotations

from engine.codegen.emit import Emitter, gather_parts, gather_text
from engine.codegen.rings import parity
from engine.codegen.source import SourceWriter
from engine.dsl.expr import Expr
from engine.kernels.attention_bwd.codegen import diagonals
from engine.kernels.attention_bwd.codegen.fragments import dq_fragment_index
from engine.kernels.attention_bwd.codegen.frame import Frame
from engine.kernels.attention_bwd.codegen.tiles import (
    emit_by_class,
    emit_ds_loop,
    emit_p_ds_loop,
    emit_p_loop,
)
from engine.kernels.attention_bwd.plan import DQ_ROW, WS_CONSUMER_BARRIER, dq_chunks


def emit_step(w: SourceWriter, f: Frame) -> None:
    if f.plan.products_ahead:  # (issued by the previous step, or before the loop, and waited for)
        _emit_class(w, f)
    else:
        _emit_products(w, f)
    if f.plan.split:
        _emit_split_tiles(w, f)
    else:
        _emit_fused_tiles(w, f)
    _emit_custom_grad_sums(w, f)
    if f.plan.head_split:
        _emit_head_split_end(w, f)
        return
    if f.plan.dq_layout != "none":
        _emit_dq_product(w, f)
    if f.plan.warp_specialized:
        _emit_ws_step_end(w, f)
    else:
        _emit_pipelined_step_end(w, f)


def _emit_class(w: SourceWriter, f: Frame) -> None:
    w.line(f'qcls: T.int32 = T.Cast("int32", ClsT[{f.d.mb}, {f.d.mh}, bx, qb])')


def _emit_products(w: SourceWriter, f: Frame) -> None:
    """The block's class, then the step's products, waited for (all but dP^T's with the split
    step)."""
    # The block's class is read once, ahead of the gemms: a global load at each branch would
    # sit behind a gemm's wait (its asm has a memory clobber) with its whole latency exposed.
    _emit_class(w, f)
    issue_products(w, f)
    w.line(f"T.wait_wgmma({1 if f.plan.split else 0})")
    # Keep nvcc from reading an accumulator before the wait that completes it.
    w.line(f"T.warpgroup_fence_operand(sT, num_regs={f.tile_regs})")


def issue_products(w: SourceWriter, f: Frame) -> None:
    """Q and dO (step f.step's ring stage, or copied), the per-query vectors, and the S^T and
    dP^T wgmmas (Delta loaded where the schedule has registers for it); not waited for."""
    ws, split, st = f.plan.warp_specialized, f.plan.split, f.plan.config.num_stages
    if ws:
        w.line(f"T.mbarrier_wait_parity(q_full[{f.step} % {st}], {parity(st, f.step)})")
    else:
        w.line(f"T.copy(Q[bz, {f.q_rows}, by, :], Q_shared)")
        w.line(f"T.copy(dO[bz, {f.q_rows}, by, :], dO_shared)")
    f.finals.emit_load(w)
    f.by_q.emit_load(w)
    if not split and not ws:
        f.delta.emit_load(w)
    w.line(f"T.wgmma_gemm(K_shared, {f.q_sh}, sT, transpose_B=True, policy={f.policy}, "
           "clear_accum=True)")
    if ws:
        w.line(f"T.mbarrier_wait_parity(do_full[{f.step} % {st}], {parity(st, f.step)})")
        if not split:
            f.delta.emit_load(w)
    w.line(f"T.wgmma_gemm(V_shared, {f.do_sh}, dpT, transpose_B=True, policy={f.policy}, "
           "clear_accum=True)")


def fused_grad(f: Frame) -> Expr | None:
    """The d score_mod / d read of the one custom read whose gradient is summed per key,
    whose tile the dS loop writes (dS' is computed there, and only partial blocks evaluate
    the mask; a loop of its own recomputed dS' and evaluated the mask on every block); None
    with several such reads (cg_tile is reused read by read, so they keep their own loops)
    or none."""
    return f.ex.dc_reads[0][2] if len(f.ex.dc_reads) == 1 else None


def _tails(f: Frame) -> bool:
    """Whether the step's blocks can hold rows past the sequences."""
    return bool(f.d.Sq % f.d.bM or f.d.Skv % f.d.bN)


def _emit_split_tiles(w: SourceWriter, f: Frame) -> None:
    """P while dP^T is in flight, dS while dV += P^T dO is."""
    tile = (f.d.bN, f.d.bM)
    emit_by_class(w, "qcls", lambda m: emit_p_loop(w, f.ex, f.bind, tile, m, "pT", "pT_cast"),
                  f.mask)
    # Delta is loaded here, not with the finals: the P loop then keeps 16 registers more
    # (at D = 128 that is the difference from spilling), and dV runs while it arrives.
    f.delta.emit_load(w)
    # (Automatic pipeline) TileLang frees a pipeline stage right after the last statement
    # that reads it, and this wgmma is still reading the dO stage when it returns: the
    # stage is held by a read of dO_shared after dK's gemm, which waits for every wgmma in
    # flight (the last read of Q is that synchronous gemm itself).
    w.line(f"T.wgmma_gemm(pT_cast, {f.do_sh}, dv, policy={f.policy})")
    w.line("T.wait_wgmma(1)")
    w.line(f"T.warpgroup_fence_operand(dpT, num_regs={f.tile_regs})")
    emit_by_class(w, "qcls", lambda m: emit_ds_loop(w, f.ex, f.bind, tile, m, "dsT_cast",
                                                           fused_grad(f), _tails(f)),
                  f.mask)


def _emit_fused_tiles(w: SourceWriter, f: Frame) -> None:
    """P and dS in one loop after both gemms, which frees each S^T and P element at once."""
    tile = (f.d.bN, f.d.bM)
    w.line(f"T.warpgroup_fence_operand(dpT, num_regs={f.tile_regs})")
    emit_by_class(w, "qcls", lambda m: emit_p_ds_loop(w, f.ex, f.bind, tile, m, "pT", "dsT_cast",
                                                      p_cast="pT_cast", grad=fused_grad(f),
                                                      tails=_tails(f)), f.mask)
    if not f.plan.head_split:  # (there, from shared memory: _emit_head_split_end)
        w.line(f"T.gemm(pT_cast, {f.do_sh}, dv, policy={f.policy})")


def _emit_custom_grad_sums(w: SourceWriter, f: Frame) -> None:
    """Per custom read whose gradient is wanted: dS' * d score_mod / d read, summed over the
    step's queries into its per-key accumulator; per table lookup not summed along diagonals,
    added element by element with fp32 atomics into the thread block's row of the table in
    shared memory (a small row) or into the table's gradient."""
    bN, bM = f.d.bN, f.d.bM
    for r, (_, _, d_read) in enumerate(f.ex.dc_reads):
        if fused_grad(f) is None:  # (else the dS loop wrote cg_tile)
            em = Emitter(f.bind)
            g_text = f"({em.float_(f.ex.ds_mod)} * {em.float_(d_read)})"
            with w.block(f"for i, j in T.Parallel({bN}, {bM}):"):
                w.line(f"cg_tile[i, j] = T.if_then_else({f.mask}, {g_text}, T.float32(0.0))")
        w.line("T.reduce_sum(cg_tile, cg_row, dim=1)")
        with w.block(f"for i in T.Parallel({bN}):"):
            w.line(f"cg_acc{r}[i] += cg_row[i]")
    sizes = f.shape.dim_sizes
    for r, g in enumerate(f.ex.dc_gathers):
        if r in f.plan.diagonal_tables:
            continue  # (from dS^T in shared memory: diagonals.py)
        em = Emitter(f.bind)
        target = (gather_text(g.read, f.bind, sizes, prefix="dC_") if g.row_dim is None
                  else f"tg{r}[{gather_parts(g.read, f.bind, sizes)[g.row_dim]}]")
        with w.block(f"for i, j in T.Parallel({bN}, {bM}):"), w.block(f"if {f.mask}:"):
            w.line(f"T.atomic_add({target}, {em.float_(f.ex.ds_mod)} * {em.float_(g.d_read)})")


def _emit_dq_product(w: SourceWriter, f: Frame) -> None:
    """dQ = dS K from dS^T in shared memory; it reads only the kv block's own tiles, so with
    whole 64-row warpgroups it runs as an asynchronous wgmma beside dK."""
    w.line(f"T.copy(dsT_cast, {f.ds_sh})")
    if f.plan.warp_specialized:
        # Every consumer's dS^T rows are in shared memory (and visible to the tensor
        # cores) before any of them multiplies the whole tile.
        w.line("T.fence_proxy_async()")
        w.line(f"T.sync_threads({WS_CONSUMER_BARRIER}, {f.plan.config.threads})")
    gemm = "T.wgmma_gemm" if f.plan.dq_async else "T.gemm"
    w.line(f"{gemm}({f.ds_sh}, K_shared, dq, transpose_A=True, clear_accum=True)")


def _emit_head_split_end(w: SourceWriter, f: Frame) -> None:
    """The head-split schedule's step end (plan.head_split): P^T and dS^T to shared memory
    (the warps split their columns, so none holds whole rows for a register A operand), dV
    and dK from there, then, unless the dQ kernel takes it, dQ = dS K in column chunks (a
    chunk's registers, not all of dQ's, beside dK and dV), each added to dQ by fp32 atomics,
    the rows past Sq left out."""
    d = f.d
    w.line(f"T.copy(pT_cast, {f.p_sh})")
    w.line(f"T.copy(dsT_cast, {f.ds_sh})")
    if f.plan.warp_specialized:
        _emit_head_split_ws_gemms(w, f)
        return
    w.line(f"T.gemm({f.p_sh}, {f.do_sh}, dv, policy={f.policy})")
    w.line(f"T.gemm({f.ds_sh}, {f.q_sh}, dk, policy={f.policy})")
    diagonals.emit_step(w, f)
    if f.plan.dq_layout == "none":
        return
    n = dq_chunks(d.D)
    cols = d.D // n
    with w.block(f"for c in T.serial({n}):"):
        w.line(f"T.gemm({f.ds_sh}, K_shared[:, c * {cols}:(c + 1) * {cols}], dq, "
               f"transpose_A=True, policy={f.policy}, clear_accum=True)")
        with w.block(f"for i, j in T.Parallel({d.bM}, {cols}):"), \
                w.block(f"if qb * {d.bM} + i < {d.Sq}:"):
            w.line(f"T.atomic_add(dQ[bz, {f.head}, qb * {d.bM} + i, c * {cols} + j], dq[i, j])")


def _emit_head_split_ws_gemms(w: SourceWriter, f: Frame) -> None:
    """Warp-specialised: once every consumer's rows of P^T and dS^T are in the step's ring
    stage (and visible to the tensor cores), the dV and dK wgmmas go out together, and right
    behind them the next step's S^T and dP^T (plan.products_ahead; the last step repeats its
    own, on the stage it still holds); one wait for all four, then the Q/dO stage goes back
    to the producer. The P^T/dS^T stage written next step is the other one, which every
    consumer's previous wgmmas have finished reading before it passed this step's barrier.
    (Waiting for the next step's products at its top instead, with wgmmas in flight across
    the loop's back edge, ptxas serialised every wgmma.)"""
    w.line("T.fence_proxy_async()")
    w.line(f"T.sync_threads({WS_CONSUMER_BARRIER}, {f.plan.config.threads})")
    w.line(f"T.wgmma_gemm({f.p_sh}, {f.do_sh}, dv, policy={f.policy})")
    w.line(f"T.wgmma_gemm({f.ds_sh}, {f.q_sh}, dk, policy={f.policy})")
    diagonals.emit_step(w, f)  # beside the dV and dK wgmmas
    steps = f"n * {f.d.G}" if f.plan.heads_loop else "n"  # (k counts on across the heads)
    w.line(f"kn: T.int32 = T.min(k + 1, {steps} - 1)")
    issue_products(w, f.at_step("kn"))
    emit_products_wait(w, f)
    w.line(f"T.warpgroup_fence_operand(dv, num_regs={f.dv_regs})")
    w.line(f"T.warpgroup_fence_operand(dk, num_regs={f.dk_regs})")
    w.line(f"T.mbarrier_arrive(qdo_empty[k % {f.plan.config.num_stages}])")


def emit_products_wait(w: SourceWriter, f: Frame) -> None:
    """Every wgmma in flight waited for, S^T and dP^T fenced (products issued ahead)."""
    w.line("T.wait_wgmma(0)")
    w.line(f"T.warpgroup_fence_operand(sT, num_regs={f.tile_regs})")
    w.line(f"T.warpgroup_fence_operand(dpT, num_regs={f.tile_regs})")


def _emit_ws_step_end(w: SourceWriter, f: Frame) -> None:
    """dK's wgmma runs while dQ goes to shared memory: wait for dQ's alone (the groups in
    flight are dV's, dQ's and dK's), hand it to the writer once its slot is free, then wait
    for dK's before the Q/dO stage goes back to the producer. (Storing dQ after dK's
    synchronous gemm instead: 3-5% slower on the H100.)"""
    w.line(f"T.wgmma_gemm(dsT_cast, {f.q_sh}, dk, policy={f.policy})")
    diagonals.emit_step(w, f)  # beside the dQ and dK wgmmas
    w.line("T.wait_wgmma(1)")
    w.line(f"T.warpgroup_fence_operand(dq, num_regs={f.dq_regs})")
    w.line(f"T.mbarrier_wait_parity(dq_empty[k % 2], {parity(2)} ^ 1)")
    index = dq_fragment_index("i", "j", f.d.D)
    with w.block(f"for i, j in T.Parallel({f.d.bM}, {f.d.D}):"):
        w.line(f"dq_shared[k % 2, {index} // {DQ_ROW}, {index} % {DQ_ROW}] = dq[i, j]")
    w.line("T.fence_proxy_async()")
    w.line("T.mbarrier_arrive(dq_full[k % 2])")
    w.line("T.wait_wgmma(0)")
    w.line(f"T.warpgroup_fence_operand(dk, num_regs={f.dk_regs})")
    w.line(f"T.mbarrier_arrive(qdo_empty[k % {f.plan.config.num_stages}])")


def _emit_pipelined_step_end(w: SourceWriter, f: Frame) -> None:
    """dK, then (fast mode) dQ by one bulk reduce-add per step (TMA cp.reduce; rows past Sq
    fall outside the tensor and are dropped by the copy engine) instead of bM x D scalar
    atomics."""
    w.line(f"T.gemm(dsT_cast, {f.q_sh}, dk, policy={f.policy})")
    diagonals.emit_step(w, f)
    if f.plan.split:
        w.line("dO_hold[0] = dO_shared[0, 0]")
    if f.plan.dq_async:
        w.line(f"T.warpgroup_fence_operand(dq, num_regs={f.dq_regs})")
    if f.plan.dq_layout != "none":
        w.line("T.copy(dq, dq_shared)")
        w.line(f"T.atomic_add(dQ[bz, by, {f.q_rows}, :], dq_shared, use_tma=True)")
