"""The warp-specialised schedule's rings and roles: Q/dO rings filled by a producer warp, dS^T
and dQ (head-split: P^T and dS^T) two deep, the mbarriers between the roles, the producer warp
and the dQ writer warp, and the loops each role walks: the kv blocks (persistent), the query
heads (the heads walk) and the steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.codegen.rings import parity, ring
from engine.codegen.source import SourceWriter
from engine.codegen.walk_order import WalkOrder
from engine.kernels.attention_bwd.codegen.vectors import VectorGroup
from engine.kernels.attention_bwd.plan import DQ_ROW
from engine.plan.config import WS_PRODUCER_REGS, WS_PRODUCER_THREADS, KernelConfig


def ws_buffers(cfg: KernelConfig, D: int, Dv: int, dt: str, head_split: bool,
               persistent: bool = False) -> list[str]:
    """Shared buffers and mbarriers: Q and dO rings (num_stages deep, filled by the producer
    warp); two deep, so that a step writes one while the previous step's readers finish the
    other, dS^T and the dQ tile or, head-split (dQ from the dQ kernel), P^T and dS^T. Full
    barriers count the producer (or writer) warp's 32 arrivals, empty ones the consumers'.
    `persistent`: K and V freed by the consumers after a kv block's last step, and each
    role's count of the steps before its kv block (`base`)."""
    bM, bN, st, C = cfg.block_M, cfg.block_N, cfg.num_stages, cfg.threads
    out = [
        f'Q_shared = T.alloc_shared(({st}, {bM}, {D}), "{dt}")',
        f'dO_shared = T.alloc_shared(({st}, {bM}, {Dv}), "{dt}")',
    ]
    if head_split:
        out.append(f'pT_shared = T.alloc_shared((2, {bN}, {bM}), "{dt}")')
    out.append(f'dsT_shared = T.alloc_shared((2, {bN}, {bM}), "{dt}")')
    if not head_split:
        out.append(f'dq_shared = T.alloc_shared((2, {bM * D // DQ_ROW}, {DQ_ROW}), "float32")')
    out += [f"kv_full = {ring(32, 1)}", f"q_full = {ring(32, st)}", f"do_full = {ring(32, st)}",
            f"qdo_empty = {ring(C, st)}"]
    if not head_split:
        out += [f"dq_full = {ring(C, 2)}", f"dq_empty = {ring(32, 2)}"]
    if persistent:
        out += [f"kv_empty = {ring(C, 1)}", 'base = T.alloc_local((1,), "int32")']
    return out


@dataclass(frozen=True)
class KvWalk:
    """The persistent walk's texts (plan.persistent): the order of a thread block's kv
    blocks, and a kv block's first and end query steps."""

    order: WalkOrder
    lo: str
    hi: str


@contextmanager
def kv_walk(w: SourceWriter, walk: KvWalk | None) -> Iterator[None]:
    """With the persistent walk, a level per kv block it of the thread block's: its bz, by
    and bx, its steps [lo, lo + n), and after it `base` (this role's steps so far, from which
    steps() counts k) counting on; otherwise none (the launch's one block, lo and n named
    before the roles)."""
    if walk is None:
        yield
        return
    w.line("base[0] = 0")
    with w.block(f"for it in T.serial({walk.order.trips}):"):
        w.line(f"tile: T.int32 = {walk.order.tile}")
        w.lines([*walk.order.indices, f"lo: T.int32 = {walk.lo}", f"n: T.int32 = {walk.hi} - lo"])
        yield
        w.line("base[0] = base[0] + n")


@contextmanager
def per_head(w: SourceWriter, heads: int) -> Iterator[None]:
    """With the heads walk (`heads` > 1: a kv head's thread block walks its query heads), a
    level per query head hq; otherwise none."""
    if heads == 1:
        yield
        return
    with w.block(f"for g in T.serial({heads}):"):
        w.line(f"hq: T.int32 = by * {heads} + g")
        yield


@contextmanager
def steps(w: SourceWriter, heads: int, persistent: bool = False) -> Iterator[None]:
    """The step loop inside per_head: step k walks query block qb = lo + k; with the heads
    walk, k keeps counting across heads, and with the persistent walk across kv blocks, so
    the rings' stages and parities run on."""
    if persistent:
        with w.block("for kk in T.serial(n):"):
            w.line("k: T.int32 = base[0] + kk")
            w.line("qb: T.int32 = lo + kk")
            yield
        return
    if heads == 1:
        with w.block("for k in T.serial(n):"):
            w.line("qb: T.int32 = lo + k")
            yield
        return
    with w.block("for kk in T.serial(n):"):
        w.line("k: T.int32 = g * n + kk")
        w.line("qb: T.int32 = lo + kk")
        yield


def emit_producer_roles(w: SourceWriter, cfg: KernelConfig, G: int, heads_loop: bool,
                        q_vectors: list[VectorGroup], do_vectors: list[VectorGroup],
                        dq_writer: bool, walk: KvWalk | None = None) -> None:
    """The producer warpgroup's branch: warp 0 loads K and V once, then per step Q (with the
    per-query vectors `q_vectors`) and dO (with `do_vectors`: Delta) into the rings; warp 1,
    with `dq_writer`, is the dQ writer. Uses `lo`, `n` (the step range) and `tx`. With
    `heads_loop` the thread block is kv head `by`'s and walks its G query heads (hq);
    otherwise query head `by`'s. With `walk` (persistent) both warps walk the
    thread block's kv blocks, warp 0 loading each K and V once the consumers free the last."""
    bM, bN, st = cfg.block_M, cfg.block_N, cfg.num_stages
    q_rows = f"qb * {bM}:(qb + 1) * {bM}"
    kv_head, head = ("by", "hq") if heads_loop else (f"by // {G}", "by")
    heads = G if heads_loop else 1
    persistent = walk is not None
    with w.block(f"if tx < {WS_PRODUCER_THREADS}:"):
        w.line(f"T.set_max_nreg({WS_PRODUCER_REGS}, 0)")
        with w.block("if tx < 32:"), kv_walk(w, walk):
            if persistent:
                w.line(f"T.mbarrier_wait_parity(kv_empty[0], {parity(1, 'it')} ^ 1)")
            for src, dst in (("K", "K_shared"), ("V", "V_shared")):
                w.line(f"T.tma_copy({src}[bz, bx * {bN}:(bx + 1) * {bN}, {kv_head}, :], {dst}, "
                       "barrier=kv_full[0])")
            w.line("T.mbarrier_arrive(kv_full[0])")
            with per_head(w, heads), steps(w, heads, persistent):
                w.line(f"T.mbarrier_wait_parity(qdo_empty[k % {st}], {parity(st)} ^ 1)")
                for src, bar, fills in (("Q", "q_full", q_vectors), ("dO", "do_full", do_vectors)):
                    w.line(f"T.tma_copy({src}[bz, {q_rows}, {head}, :], "
                           f"{src}_shared[k % {st}, :, :], barrier={bar}[k % {st}])")
                    for group in fills:
                        group.emit_fill(w, f"{bar}[k % {st}]")
                    w.line(f"T.mbarrier_arrive({bar}[k % {st}])")
        if not dq_writer:
            return
        # The writer warp: one bulk reduce-add per step (TMA cp.reduce; rows past Sq fall
        # outside the tensor and are dropped by the copy engine), waited for here, off the
        # consumers' path.
        with w.block("elif tx < 64:"), kv_walk(w, walk), \
                per_head(w, heads), steps(w, heads, persistent):
            w.line(f"T.mbarrier_wait_parity(dq_full[k % 2], {parity(2)})")
            w.line(f"T.atomic_add(dQ[bz, {head}, qb, :, :], dq_shared[k % 2, :, :], use_tma=True)")
            w.line("T.mbarrier_arrive(dq_empty[k % 2])")
