"""The gradients of table lookups indexed by q - kv alone (a bias per distance, T5's
buckets), summed along the diagonals of dS^T (plan.diagonal_tables).

Every element of one diagonal of the score tile reads the same table entry, so its gradient
is that diagonal's sum of dS. Once a step's dS^T (keys i, queries j) is in shared memory for
dQ's gemm, the consumers sum it by diagonals (plan.DiagonalLanes): a lane reads one 8 x 8
block with eight 16-byte loads and sums its 15 local diagonals in registers; the lanes of a
group hold the blocks along one block diagonal and add their sums by shuffles; then lane k
of the group owns the tile diagonals at local offsets k - 8 + L e. It keeps each owned sum in
a register while the table entry stays the same and adds it into the gradient when the entry
changes (T5's far bucket: once per thread block). Added element by element with atomics
instead, T5's 32 buckets serialised (NOTES 51); one thread per diagonal reading dS^T an
element at a time tripled the backward (NOTES 104)."""

from __future__ import annotations

from engine.codegen.emit import gather_parts
from engine.codegen.source import SourceWriter
from engine.dsl.expr import Expr
from engine.kernels.attention_bwd.codegen.frame import Frame
from engine.kernels.attention_bwd.exprs import TableGrad, diagonal_text
from engine.kernels.attention_bwd.plan import DIAG_BLOCK, diagonal_lanes
from engine.plan.config import WS_PRODUCER_THREADS

ZERO = "T.float32(0.0)"
_LOCAL = 2 * DIAG_BLOCK - 1  # a block's diagonals


def _tables(f: Frame) -> list[tuple[int, TableGrad]]:
    return [(r, f.ex.dc_gathers[r]) for r in f.plan.diagonal_tables]


def _slot(f: Frame) -> str:
    """The consumer thread's number (the producer warpgroup comes first when warp-specialised)."""
    return f"(tx - {WS_PRODUCER_THREADS})" if f.plan.warp_specialized else "tx"


def _parts(f: Frame, g: TableGrad, diagonal: str) -> list[str]:
    """The lookup's index texts with q - kv bound to `diagonal`."""
    def bind(node: Expr) -> str | None:
        text = diagonal_text(node, diagonal)
        return text if text is not None else f.bind(node)

    return gather_parts(g.read, bind, f.shape.dim_sizes)


def emit_allocs(w: SourceWriter, f: Frame) -> None:
    """Per table: the owned running sums and their entries; a lane's block sums and loads."""
    if not f.plan.diagonal_tables:
        return
    owned = diagonal_lanes(f.d.bM, f.d.bN).owned
    for r, _ in _tables(f):
        w.line(f'dg_acc{r} = T.alloc_local(({owned},), "float32")')
        w.line(f'dg_at{r} = T.alloc_local(({owned},), "int32")')
    w.line(f'dg_part = T.alloc_local(({_LOCAL},), "float32")')
    w.line(f'dg_v = T.alloc_local(({DIAG_BLOCK},), "{f.d.dt}")')


def emit_reset(w: SourceWriter, f: Frame) -> None:
    """No running sums, no entries (-1: none of the table's)."""
    if not f.plan.diagonal_tables:
        return
    owned = diagonal_lanes(f.d.bM, f.d.bN).owned
    for r, _ in _tables(f):
        with w.block(f"for e in T.unroll({owned}):"):
            w.lines([f"dg_acc{r}[e] = {ZERO}", f"dg_at{r}[e] = -1"])


def _emit_add(w: SourceWriter, f: Frame, r: int, g: TableGrad, e: str) -> None:
    """Running sum `e` of table `r` added into its gradient at its entry (when not zero)."""
    parts = _parts(f, g, "0")
    parts[g.diag_dim] = f"dg_at{r}[{e}]"
    with w.block(f"if dg_acc{r}[{e}] != {ZERO}:"):
        w.line(f"T.atomic_add(dC_{g.read.attr[0]}[{', '.join(parts)}], "
               f"dg_acc{r}[{e}] * T.float32({g.ds_factor!r}))")


def emit_flush(w: SourceWriter, f: Frame) -> None:
    """Every running sum into its gradient (the end of a thread block's, or a head's, steps)."""
    if not f.plan.diagonal_tables:
        return
    lanes = diagonal_lanes(f.d.bM, f.d.bN)
    with w.block(f"if {_slot(f)} < {lanes.groups * lanes.group}:"), \
            w.block(f"for e in T.unroll({lanes.owned}):"):
        for r, g in _tables(f):
            _emit_add(w, f, r, g, "e")


def emit_step(w: SourceWriter, f: Frame) -> None:
    """This step's dS^T (in shared memory, visible to every consumer) summed by diagonals into
    the owned running sums, after flushing those whose entry changes. Whole warps take part
    (the shuffles); lanes past the last group hold no block."""
    if not f.plan.diagonal_tables:
        return
    lanes = diagonal_lanes(f.d.bM, f.d.bN)
    L, nr, nc = lanes.group, f.d.bN // DIAG_BLOCK, f.d.bM // DIAG_BLOCK
    slot = _slot(f)
    with w.block(f"if {slot} < {32 * lanes.warps}:"):
        w.lines([f"dgg: T.int32 = {slot} // {L}",  # the group: block diagonal c - r = dgu
                 f"dgk: T.int32 = {slot} % {L}",
                 f"dgu: T.int32 = dgg - {nr - 1}",
                 "dgr: T.int32 = T.max(0, -dgu) + dgk"])  # the lane's block row
        with w.block(f"for d in T.unroll({_LOCAL}):"):
            w.line(f"dg_part[d] = {ZERO}")
        _emit_block_sums(w, f, lanes.groups, nr, nc)
        with w.block(f"for d in T.unroll({_LOCAL}):"):
            off = L // 2
            while off:
                w.line(f"dg_part[d] = dg_part[d] + T.shfl_xor(dg_part[d], {off})")
                off //= 2
        with w.block(f"if dgg < {lanes.groups}:"), w.block(f"for e in T.unroll({lanes.owned}):"):
            _emit_owned(w, f, L)


def _emit_block_sums(w: SourceWriter, f: Frame, groups: int, nr: int, nc: int) -> None:
    """The lane's 8 x 8 block of dS^T, a row (16 bytes) at a time, into its 15 diagonals."""
    n = DIAG_BLOCK
    with w.block(f"if T.And(dgg < {groups}, T.And(dgr < {nr}, dgr + dgu < {nc})):"), \
            w.block(f"for a in T.unroll({n}):"):
        with w.block(f"for b in T.vectorized({n}):"):
            w.line(f"dg_v[b] = {f.ds_at(f'dgr * {n} + a', f'(dgr + dgu) * {n} + b')}")
        with w.block(f"for b in T.unroll({n}):"):
            w.line(f'dg_part[b - a + {n - 1}] += T.Cast("float32", dg_v[b])')


def _emit_owned(w: SourceWriter, f: Frame, L: int) -> None:
    """Owned diagonal e of lane dgk: local offset dgd = dgk - 8 + L e (none below -7), its
    q - kv, and per table the flush on a new entry and the add."""
    n = DIAG_BLOCK
    w.line(f"dgd: T.int32 = dgk - {n} + {L} * e")
    pick = ZERO
    for d in range(_LOCAL):
        pick = f"T.if_then_else(dgd == {d - (n - 1)}, dg_part[{d}], {pick})"
    w.line(f"dgs: T.float32 = {pick}")
    w.line(f"dgl: T.int32 = qb * {f.d.bM} - bx * {f.d.bN} + dgu * {n} + dgd")
    for r, g in _tables(f):
        w.line(f"dgi{r}: T.int32 = {_parts(f, g, 'dgl')[g.diag_dim]}")
        with w.block(f"if dgi{r} != dg_at{r}[e]:"):
            _emit_add(w, f, r, g, "e")
            w.lines([f"dg_acc{r}[e] = {ZERO}", f"dg_at{r}[e] = dgi{r}"])
        w.line(f"dg_acc{r}[e] += dgs")
