"""The forward's online step over one key block: from the score tile (acc_s) to P in acc_s_cast,
the output rescale o_scale_f and the new row scales, following the spec's OnlineFunc.

Written twice per kernel: for full blocks, and for partial blocks, where the mask makes
masked entries neutral in reductions and gives p = 0, and non-finite row updates (a row with
no key in the block) keep the previous state."""

from __future__ import annotations

from collections.abc import Callable

from engine.codegen.emit import Emitter, const_text, let_uniforms
from engine.codegen.source import SourceWriter
from engine.dsl.expr import Expr, leaf, topo
from engine.ir.rewrite import pull_out_of_max, substitute
from engine.ir.spec import TracedSpec

_NEUTRAL = {"max": float("-inf"), "min": float("inf"), "sum": 0.0, "abssum": 0.0}
ACC_S = "acc_s[i, j]"


def prepare_online(spec: TracedSpec) -> tuple[Expr, list[tuple[str, Expr]], Expr]:
    """online_fwd outputs written over the raw score (score_mod inlined), with max
    reductions moved off scaled/shifted tiles (exp becomes exp2 of an FFMA at emission)."""
    raw = leaf("score", ("m", "n"))
    # Mark the raw score with a distinct leaf so the substitution is not recursive.
    raw_mark = leaf("rawscore", ("m", "n"))
    sm = substitute(spec.score_mod, {raw.key: raw_mark})
    roots = [spec.online_p, spec.o_scale, *(e for _, e in spec.online_updates)]
    roots = [pull_out_of_max(substitute(r, {raw.key: sm})) for r in roots]
    p, o_scale, *upd = roots
    return p, list(zip(spec.online_names, upd, strict=True)), o_scale


def rescales(o_scale: Expr) -> bool:
    """Whether the output is rescaled each step (o_scale is not the constant 1)."""
    return not (o_scale.op == "const" and float(o_scale.attr) == 1.0)


def _rows(e: Expr) -> bool:
    return "n" not in e.axes and "d" not in e.axes


def _uses(expr: Expr, target: Expr, stop: Expr) -> bool:
    """Does `expr` read `target` other than inside subexpression `stop`?"""
    seen = set()
    stack = [expr]
    while stack:
        e = stack.pop()
        if e.key in seen or e.key == stop.key:
            continue
        seen.add(e.key)
        if e.key == target.key:
            return True
        stack.extend(e.args)
    return False


def step_roots(online: tuple[Expr, list[tuple[str, Expr]], Expr]) -> list[Expr]:
    """What one online step computes: P, the output's rescale and the row scales' updates."""
    p, updates, o_scale = online
    return [p, o_scale, *(e for _, e in updates)]


class OnlineBody:
    """The statements of one online step (`source`). `mask`: the partial blocks' condition
    (None: full blocks); `mask_once_dtype`: evaluate it once into acc_s_cast (of that dtype)
    and read it back. `p_in_acc`: P stays in acc_s (float32) for the caller to cast, as the
    overlapped schedule needs while the previous P is still an operand (not with the mask
    evaluated once, which uses acc_s_cast). `own_uniforms`: the step writes its block-uniform
    reads itself (False: the caller wrote them once per tile, `let_uniforms` over
    `step_roots`, and `base_bind` names them). `mask_by_value`: once acc_s holds the raw
    scores with -inf where masked (a max's input), later selects test acc_s against -inf
    instead of evaluating the mask again (a product of finite inputs is finite, so the two
    agree); the mask is then evaluated once without a tile to hold it. `temps`: the row
    fragments the statements need (the caller allocates)."""

    def __init__(self, online: tuple[Expr, list[tuple[str, Expr]], Expr],
                 base_bind: Callable[[Expr], str | None], mask: str | None, bM: int, bN: int,
                 mask_once_dtype: str | None = None, p_in_acc: bool = False,
                 own_uniforms: bool = True, mask_by_value: bool = False):
        self.p, self.updates, self.o_scale = online
        self.base_bind, self.mask, self.bM, self.bN = base_bind, mask, bM, bN
        self.own_uniforms, self.mask_by_value = own_uniforms, mask_by_value
        self.mask_once_dtype = mask_once_dtype
        self.p_in_acc = p_in_acc and not (mask is not None and mask_once_dtype is not None)
        self.w = SourceWriter()
        self.temps: set[str] = set()
        raw = self.raw = leaf("rawscore", ("m", "n"))
        self.acc_holds: Expr = raw  # which expression acc_s currently holds
        self.acc_masked: float | None = None  # what its masked entries hold (None: unknown)
        self.bound: dict[tuple, str] = {raw.key: ACC_S}
        self.counter = 0
        self.roots = step_roots(online)
        self.order = topo(self.roots)
        self.needed = self._needed_rows()
        self.source = self._build()

    def bind(self, node: Expr) -> str | None:
        if node.key in self.bound:
            return self.bound[node.key]
        return self.base_bind(node)

    def _needed_rows(self) -> set[tuple]:
        """Row nodes that need a fragment: referenced from a tile expression or a reduction's
        input, or a root. Everything else is inlined."""
        needed: set[tuple] = set()
        for n in self.order:
            if "n" in n.axes:
                needed |= {a.key for a in n.args if _rows(a) and a.args and a.op != "const" and a.axes}
        for r in [self.o_scale, *(e for _, e in self.updates)]:
            if r.args and r.axes:
                needed.add(r.key)
        return needed

    def _tile(self, assign: str) -> None:
        with self.w.block(f"for i, j in T.Parallel({self.bM}, {self.bN}):"):
            self.w.line(assign)

    def _row_loop(self, assigns: list[str]) -> None:
        with self.w.block(f"for i in T.Parallel({self.bM}):"):
            self.w.lines(assigns)

    def _new_temp(self) -> str:
        self.counter += 1
        name = f"r{self.counter}"
        self.temps.add(name)
        return name

    def _build(self) -> str:
        """The whole step: (mask once), the reductions with their row values, P, o_scale and
        the row scales' commit."""
        if self.own_uniforms:
            lets, self.base_bind = let_uniforms(self.roots, self.base_bind)
            self.w.lines(lets)
        if self.mask is not None and self.mask_once_dtype is not None:
            self._mask_once(self.mask_once_dtype)
        reduces = [n for n in self.order if n.op == "reduce"]
        for idx, rn in enumerate(reduces):
            self._emit_rows()
            later = [r.args[0] for r in reduces[idx + 1:]] + [self.p]
            buf = self._materialize(rn.args[0], _NEUTRAL[rn.attr], later)
            name = self._new_temp()
            if rn.attr == "abssum":
                self.w.line(f"T.reduce_abssum({buf}, {name}, dim=1)")
            else:
                self.w.line(f"T.reduce_{rn.attr}({buf}, {name}, dim=1, clear=True)")
            self.bound[rn.key] = f"{name}[i]"
        self._emit_rows()
        self._emit_p()
        self._emit_row_scales()
        return self.w.text()

    def _mask_once(self, dt: str) -> None:
        """The mask into acc_s_cast (free until P is written into it, in place, last); every
        select below reads it back."""
        one, zero = f'T.Cast("{dt}", 1)', f'T.Cast("{dt}", 0)'
        self._tile(f"acc_s_cast[i, j] = T.if_then_else({self.mask}, {one}, {zero})")
        self.mask = f"(acc_s_cast[i, j] != {zero})"

    def _materialize(self, src: Expr, neutral: float, remaining: list[Expr]) -> str:
        """`src` into acc_s (masked entries neutral) for a reduction; acc_s's old value must
        be dead by then."""
        em = Emitter(self.bind)
        if self.bound.get(src.key) == ACC_S:
            if self.mask is not None and self.acc_masked != neutral:
                self._tile(f"acc_s[i, j] = T.if_then_else({self.mask}, acc_s[i, j], "
                           f"{const_text(neutral, 'float')})")
                self.acc_masked = neutral
            return "acc_s"
        if any(_uses(e, self.acc_holds, src) for e in remaining):
            raise NotImplementedError("this spec needs two live score tiles; not supported yet")
        text = em.float_(src)
        cond = self.mask
        if self.mask_by_value and self.acc_masked == float("-inf") \
                and self.acc_holds.key == self.raw.key:
            cond = f"({ACC_S} != {const_text(float('-inf'), 'float')})"
        self.acc_masked = None
        if cond is not None:
            self.acc_masked = neutral or 0.0
            text = f"T.if_then_else({cond}, {text}, {const_text(self.acc_masked, 'float')})"
        self._tile(f"acc_s[i, j] = {text}")
        self.bound.pop(self.acc_holds.key, None)
        self.bound[src.key] = ACC_S
        self.acc_holds = src
        return "acc_s"

    def _emit_rows(self) -> None:
        """Row values whose reductions are all available, each into its own fragment."""
        for n in self.order:
            if n.key in self.needed and n.key not in self.bound and n.op != "reduce":
                deps = [m for m in topo([n]) if m.op == "reduce"]
                if all(d.key in self.bound for d in deps):
                    name = self._new_temp()
                    self._row_loop([f"{name}[i] = {Emitter(self.bind).float_(n)}"])
                    self.bound[n.key] = f"{name}[i]"

    def _emit_p(self) -> None:
        """P into the half-precision tile for the PV gemm (or, p_in_acc, into acc_s)."""
        text = Emitter(self.bind).float_(self.p)
        # P already in acc_s with its masked entries 0 (a sum's input) needs no second select.
        if self.mask is not None and not (text == ACC_S and self.acc_masked == 0.0):
            text = f"T.if_then_else({self.mask}, {text}, T.float32(0.0))"
        if not self.p_in_acc:
            self._tile(f"acc_s_cast[i, j] = {text}")
        elif text != ACC_S:
            self._tile(f"{ACC_S} = {text}")

    def _emit_row_scales(self) -> None:
        """o_scale and the new row scales (old values are read above; commit last)."""
        if rescales(self.o_scale):
            self.temps.add("o_scale_f")
            t = Emitter(self.bind).float_(self.o_scale)
            if self.mask is not None:
                t = f"T.if_then_else(T.isnan({t}), T.float32(1.0), {t})"
            self._row_loop([f"o_scale_f[i] = {t}"])
        commits = []
        for name, e in self.updates:
            t = Emitter(self.bind).float_(e)
            if t == f"rs_{name}[i]":
                continue
            if self.mask is not None:
                t = f"T.if_then_else(T.isnan({t}), rs_{name}[i], {t})"
            commits.append(f"rs_{name}[i] = {t}")
        if commits:
            self._row_loop(commits)
