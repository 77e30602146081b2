"""The step's tile loops: P and dS over a [rows x cols] fragment of one block, the mask that
partial blocks evaluate, and how the spec's leaves bind to fragments, indices and vectors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.codegen.emit import Emitter, gather_text, let_uniforms
from engine.codegen.source import SourceWriter
from engine.dsl.expr import Expr, topo
from engine.ir.spec import TracedSpec
from engine.kernels.attention_bwd.exprs import BackwardExprs
from engine.plan.config import KernelConfig
from engine.plan.shape import KernelShape

Bind = Callable[[Expr], "str | None"]
ZERO = "T.float32(0.0)"


@dataclass(frozen=True)
class Dims:
    """Sizes of a kernel at a shape and config, and the texts that index its mask tables."""

    bM: int
    bN: int
    D: int
    Dv: int
    Sq: int
    Skv: int
    G: int  # query heads per kv head
    nqb: int  # query blocks
    nkb: int  # key blocks
    dt: str  # TileLang dtype of the inputs
    mb: str  # a thread block's index into the tables' batch dim
    mh: str  # and head dim


def dims(shape: KernelShape, cfg: KernelConfig) -> Dims:
    bM, bN, Sq, Skv = cfg.block_M, cfg.block_N, shape.seqlen_q, shape.seqlen_kv
    return Dims(bM, bN, shape.head_dim, shape.head_dim_v, Sq, Skv,
                shape.heads_q // shape.heads_kv, -(-Sq // bM), -(-Skv // bN),
                shape.dtype, "bz" if shape.mask_batch > 1 else "0",
                "by" if shape.mask_heads > 1 else "0")


def binder(shape: KernelShape, q_idx: str, kv_idx: str, tiles: dict[str, str], q_var: str,
           hoisted: dict[tuple, str] | None = None, head: str = "by",
           rows_at: str | None = None) -> tuple[Bind, dict]:
    """Emitter binding for one frame: `q_idx`/`kv_idx` the index texts of the fragment element
    [i, j], `tiles` the fragments holding rawscore, dp and p, `q_var` the loop variable (i or
    j) that indexes the per-query register vectors; `hoisted` maps a custom read (name, index)
    to the register-vector element that holds it; `head` the query head's text; `rows_at`
    the ring stage from which the finals and Delta are read (None: their register vectors)."""
    Sq, Skv = shape.seqlen_q, shape.seqlen_kv
    index_text = {"b": "bz", "h": head, "q": q_idx, "kv": kv_idx}
    clamp = {"q": f"T.min({q_idx}, {Sq - 1})", "kv": f"T.min({kv_idx}, {Skv - 1})"}

    def bind(node: Expr) -> str | None:
        if node.op in tiles:
            return f"{tiles[node.op]}[i, j]"
        if node.op == "idx":
            return index_text[node.attr]
        if node.op == "custom":
            name, _, index = node.attr
            if hoisted and (name, index) in hoisted:
                return hoisted[(name, index)]
            parts = [clamp.get(s, index_text.get(s, "0")) if isinstance(s, str) else "0" for s in index]
            return f"C_{name}[{', '.join(parts)}]"
        if node.op == "gather":
            return gather_text(node, bind, shape.dim_sizes)
        if node.op == "final":
            return f"Fs_{node.attr}[{rows_at}, {q_var}]" if rows_at else f"Fr_{node.attr}[{q_var}]"
        if node.op == "doosum":
            return f"Ds[{rows_at}, {q_var}]" if rows_at else f"Dr[{q_var}]"
        return None

    return bind, index_text


def mask_text(spec: TracedSpec, bind: Bind, q_row: str, kv_row: str, shape: KernelShape) -> str:
    """What a partial block evaluates: the spec's mask (positions as `bind` gives them) and
    both bounds on the rows `q_row`, `kv_row` (the positions, unless the rows are folded)."""
    conds = [f"({kv_row} < {shape.seqlen_kv})", f"({q_row} < {shape.seqlen_q})"]
    if spec.mask is not None:
        conds.insert(0, Emitter(bind).text(spec.mask))
    text = conds[0]
    for c in conds[1:]:
        text = f"T.And({text}, {c})"
    return text


def emit_by_class(w: SourceWriter, cls: str, emit_loop: Callable[[str | None], None],
                  mask: str) -> None:
    """`emit_loop(mask)` under the block class `cls`: full blocks (class 2) skip the mask;
    partial ones (and the tails) evaluate it."""
    with w.block(f"if {cls} == 2:"):
        emit_loop(None)
    with w.block("else:"):
        emit_loop(mask)


def _masked(text: str, mask: str | None) -> str:
    return text if mask is None else f"T.if_then_else({mask}, {text}, {ZERO})"


def ds_text(ex: BackwardExprs, em: Emitter) -> str:
    """dS = dS' times d score_mod / d score (the chain rule, where it is not 1)."""
    text = em.float_(ex.ds_mod)
    return f"({text} * {em.float_(ex.dsm_ds)})" if ex.chain_rule else text


def _uniforms(w: SourceWriter, roots: list[Expr], bind: Bind) -> Bind:
    """`bind` with the roots' block-uniform reads in scalars written here, before the loop."""
    lets, bind = let_uniforms(roots, bind)
    w.lines(lets)
    return bind


def _tile_loop(w: SourceWriter, shape: tuple[int, int], assigns: list[str]) -> None:
    with w.block(f"for i, j in T.Parallel({shape[0]}, {shape[1]}):"):
        w.lines(assigns)


def emit_p_loop(w: SourceWriter, ex: BackwardExprs, bind: Bind, shape: tuple[int, int],
                mask: str | None, p: str, p_cast: str) -> None:
    """P over a tile into fragment `p` and its 16-bit copy `p_cast` (masked entries give 0)."""
    bind = _uniforms(w, [ex.p], bind)
    text = _masked(Emitter(bind).float_(ex.p), mask)
    _tile_loop(w, shape, [f"{p}[i, j] = {text}", f"{p_cast}[i, j] = {p}[i, j]"])


def emit_ds_loop(w: SourceWriter, ex: BackwardExprs, bind: Bind, shape: tuple[int, int],
                 mask: str | None, ds: str, grad: Expr | None = None,
                 tails: bool = True) -> None:
    """dS over a tile into `ds`, P already computed (masked entries give 0); with `grad` (a
    custom read's d score_mod / d read), that gradient's tile into cg_tile beside it;
    `tails`: whether the blocks can hold rows past the sequences (see _ds_mask)."""
    em = Emitter(_uniforms(w, [ex.ds_mod, ex.dsm_ds, *_grads(grad)], bind))
    _tile_loop(w, shape, [f"{ds}[i, j] = {_masked(ds_text(ex, em), _ds_mask(ex, mask, tails))}",
                          *_grad_tile(ex, em, mask, grad)])


def emit_p_ds_loop(w: SourceWriter, ex: BackwardExprs, bind: Bind, shape: tuple[int, int],
                   mask: str | None, p: str, ds: str, p_cast: str | None = None,
                   grad: Expr | None = None, tails: bool = True) -> None:
    """P into `p` (and its 16-bit copy `p_cast`) and dS into `ds` in one loop over a tile;
    `grad` and `tails` as emit_ds_loop's."""
    em = Emitter(_uniforms(w, [ex.p, ex.ds_mod, ex.dsm_ds, *_grads(grad)], bind))
    p_text, d_text = _masked(em.float_(ex.p), mask), _masked(ds_text(ex, em), _ds_mask(ex, mask, tails))
    cast = [f"{p_cast}[i, j] = {p}[i, j]"] if p_cast else []
    _tile_loop(w, shape, [f"{p}[i, j] = {p_text}", *cast, f"{ds}[i, j] = {d_text}",
                          *_grad_tile(ex, em, mask, grad)])


# Operations that keep finite operands finite: a product with P's 0 is then 0.
_FINITE_OPS = {"const", "rawscore", "dp", "doosum", "p", "final", "custom", "idx", "add", "sub",
               "mul", "neg", "tanh", "sigmoid", "abs"}


def _ds_mask(ex: BackwardExprs, mask: str | None, tails: bool) -> str | None:
    """The mask dS needs: none where dS is P (masked to 0 just before, in the P loop or the
    same loop) times finite terms, as the softmax's P (dP - Delta) * scale: a second
    evaluation of the mask per element in partial blocks, which nvcc does not remove. Not
    where blocks hold rows past the sequences (`tails`): their dO and Delta rows need not
    be finite there."""
    x = ex.ds_mod
    if not tails and x.op == "mul" and "p" in (x.args[0].op, x.args[1].op):
        other = x.args[1] if x.args[0].op == "p" else x.args[0]
        terms = [other, *([ex.dsm_ds] if ex.chain_rule else [])]
        if all(n.op in _FINITE_OPS for n in topo(terms)):
            return None
    return mask


def _grads(grad: Expr | None) -> list[Expr]:
    return [] if grad is None else [grad]


def _grad_tile(ex: BackwardExprs, em: Emitter, mask: str | None, grad: Expr | None) -> list[str]:
    if grad is None:
        return []
    return [f"cg_tile[i, j] = {_masked(f'({em.float_(ex.ds_mod)} * {em.float_(grad)})', mask)}"]
