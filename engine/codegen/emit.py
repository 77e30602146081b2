"""Render IR expressions as TileLang (TVM script) expression text.

Leaves are bound by the caller (`bind`: which buffer element or loop index a leaf reads).
Integer subexpressions (index arithmetic) stay int32 and are cast where they meet floats,
since TVM refuses mixed-type arithmetic.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from engine.dsl.expr import CUSTOM_READS, Expr, topo

LOG2E = 1.4426950408889634
F32 = '"float32"'

_INFIX = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "ge": ">=",
    "gt": ">",
    "le": "<=",
    "lt": "<",
    "eq": "==",
    "ne": "!=",
}
_UNARY = {
    "exp2": "T.exp2",
    "log": "T.log",
    "log2": "T.log2",
    "tanh": "T.tanh",
    "sigmoid": "T.sigmoid",
    "abs": "T.abs",
    "sin": "T.sin",
    "cos": "T.cos",
    "tan": "T.tan",
    "sqrt": "T.sqrt",
    "rsqrt": "T.rsqrt",
    "log1p": "T.log1p",
    "erf": "T.erf",
    "floor": "T.floor",
    "ceil": "T.ceil",
    "round": "T.nearbyint",  # halves to even, as torch.round (T.round rounds them away from 0)
}


def const_text(value: float | int | bool, dtype: str) -> str:
    if dtype == "bool":
        return "T.bool(True)" if value else "T.bool(False)"
    if dtype == "int":
        return f"T.int32({int(value)})"
    v = float(value)
    if math.isinf(v):
        return f"T.infinity({F32})" if v > 0 else f"(-T.infinity({F32}))"
    return f"T.float32({v!r})"


class Emitter:
    """Turns an expression into text; `bind(node) -> str | None` supplies leaf (or any
    precomputed node) text. Results are memoised per node key."""

    def __init__(self, bind: Callable[[Expr], str | None]):
        self.bind = bind
        self.memo: dict[tuple, str] = {}

    def float_(self, e: Expr) -> str:
        t = self.text(e)
        return f"T.Cast({F32}, {t})" if e.dtype in ("int", "bool") else t

    def text(self, e: Expr) -> str:
        if e.key in self.memo:
            return self.memo[e.key]
        bound = self.bind(e)
        if bound is not None:
            out = bound
        else:
            out = self._render(e)
        self.memo[e.key] = out
        return out

    def _floor_division(self, e: Expr) -> str:
        """x // c and x % c with floor semantics (Python's and torch's), c a constant."""
        x, c = e.args
        if e.dtype == "int":
            fn = "T.floordiv" if e.op == "floordiv" else "T.floormod"
            return f"{fn}({self.text(x)}, {self.text(c)})"
        q = f"T.floor({self.float_(x)} / {self.float_(c)})"
        return q if e.op == "floordiv" else f"({self.float_(x)} - {self.float_(c)} * {q})"

    @staticmethod
    def _power(x: str, c: float) -> str:
        """x ** c as torch computes it. TileLang's pow lowers to exp2(c * log2(x)), NaN for any
        x < 0, so integer exponents multiply out (small ones) or take |x| and restore the sign."""
        if c != int(c):
            return f"T.pow({x}, T.float32({c!r}))"
        n = int(c)
        if n == 0:
            return "T.float32(1.0)"
        if 1 <= n <= 4:
            return "(" + " * ".join([x] * n) + ")" if n > 1 else x
        p = f"T.pow(T.abs({x}), T.float32({c!r}))"
        return p if n % 2 == 0 else f"T.if_then_else({x} < T.float32(0.0), -{p}, {p})"

    def _render(self, e: Expr) -> str:
        op, a = e.op, e.args
        if op == "const":
            return const_text(e.attr, e.dtype)
        if not a:
            raise ValueError(f"codegen: leaf {op} ({e.attr}) has no binding in this context")
        if op in ("add", "sub", "mul", "div"):
            if e.dtype == "int":
                return f"({self.text(a[0])} {_INFIX[op]} {self.text(a[1])})"
            return f"({self.float_(a[0])} {_INFIX[op]} {self.float_(a[1])})"
        if op in ("ge", "gt", "le", "lt", "eq", "ne"):
            if a[0].dtype == "int" and a[1].dtype == "int":
                return f"({self.text(a[0])} {_INFIX[op]} {self.text(a[1])})"
            return f"({self.float_(a[0])} {_INFIX[op]} {self.float_(a[1])})"
        if op == "and":
            return f"T.And({self.text(a[0])}, {self.text(a[1])})"
        if op == "or":
            # Both sides, no short-circuit: nvcc branched per element on `||` inside the
            # online step, and with the persistent walk ptxas then serialised prefix-LM's
            # wgmmas (C7511). The operands are comparisons, free of effects.
            x, y = (f'T.Cast("int32", {self.text(v)})' for v in a)
            return f"(T.bitwise_or({x}, {y}) != 0)"
        if op == "not":
            return f"T.Not({self.text(a[0])})"
        if op == "neg":
            return f"(-{self.text(a[0])})"
        if op == "exp":
            # exp(x) = exp2(x * log2 e), with log2 e folded into constants and pushed through
            # + and - (stopping at values already in registers), so s*c - m becomes one FFMA.
            from engine.ir.rewrite import distribute_exp_scale

            inner = distribute_exp_scale(a[0], LOG2E, stop=lambda n: self.bind(n) is not None)
            return f"T.exp2({self.float_(inner)})"
        if op == "abs" and e.dtype == "int":  # |q_idx - kv_idx| stays an integer index
            return f"T.abs({self.text(a[0])})"
        if op in _UNARY:
            return f"{_UNARY[op]}({self.float_(a[0])})"
        if op == "expm1":  # no TileLang intrinsic; CUDA's keeps small x exact, unlike exp(x) - 1
            return f'T.call_extern({F32}, "expm1f", {self.float_(a[0])})'
        if op == "toint":
            return f'T.Cast("int32", {self.text(a[0])})'  # truncates towards zero, as torch
        if op in ("floordiv", "mod"):
            return self._floor_division(e)
        if op in ("max", "min"):
            fn = "T.max" if op == "max" else "T.min"
            if e.dtype == "int":
                return f"{fn}({self.text(a[0])}, {self.text(a[1])})"
            return f"{fn}({self.float_(a[0])}, {self.float_(a[1])})"
        if op == "pow":
            return self._power(self.float_(a[0]), e.attr)
        if op == "where":
            if e.dtype == "float":
                return (
                    f"T.if_then_else({self.text(a[0])}, {self.float_(a[1])}, {self.float_(a[2])})"
                )
            return f"T.if_then_else({self.text(a[0])}, {self.text(a[1])}, {self.text(a[2])})"
        raise ValueError(f"codegen: op {op!r} cannot be emitted here")


def reads_own_dim(dim: str | int, arg: Expr) -> bool:
    """Whether a table lookup's index `arg` on `dim` is b on "batch" or h on "heads": one value
    per thread block, never outside the dim."""
    return arg.op == "idx" and (arg.attr, dim) in (("b", "batch"), ("h", "heads"))


def gather_parts(node: Expr, bind: Callable[[Expr], str | None],
                 sizes: dict[str, object]) -> list[str]:
    """The index texts of a table lookup (op "gather"), each clamped into its dim: a kernel
    never reads or writes outside the tensor (the reference executor raises IndexError there
    instead). `sizes` gives the named dims' extents (numbers or symbol texts)."""
    name, dims = node.attr
    em = Emitter(bind)
    parts = []
    for dim, arg in zip(dims, node.args, strict=True):
        n = sizes[dim] if isinstance(dim, str) else dim
        last = n - 1 if isinstance(n, int) else f"{n} - 1"
        if arg.op == "const" and isinstance(n, int):
            parts.append(str(min(max(int(arg.attr), 0), last)))
        elif reads_own_dim(dim, arg):
            parts.append(em.text(arg))
        else:
            parts.append(f"T.max(T.min({em.text(arg)}, {last}), 0)")
    return parts


def gather_text(node: Expr, bind: Callable[[Expr], str | None], sizes: dict[str, object],
                prefix: str = "C_") -> str:
    """A table lookup as `C_name[...]` (or the gradient's `dC_name[...]`), indices clamped."""
    return f"{prefix}{node.attr[0]}[{', '.join(gather_parts(node, bind, sizes))}]"


def block_uniform(roots: list[Expr]) -> list[Expr]:
    """The largest float subexpressions of `roots` that read an input (a custom tensor or a
    table) but vary along no tile axis (a per-head gate's sigmoid, an ALiBi slope): one
    value per thread block. In a tile loop each would be a global load per element, which
    nvcc does not hoist past the kernel's stores (ALiBi's forward: 137 loads a thread)."""
    reads: set[tuple] = set()  # nodes that read an input, in one pass (topo: args first)
    for n in topo(roots):
        if n.op in CUSTOM_READS or any(a.key in reads for a in n.args):
            reads.add(n.key)
    found: dict[tuple, Expr] = {}
    seen: set[tuple] = set()
    stack = list(reversed(roots))
    while stack:
        e = stack.pop()
        if e.key in seen:
            continue
        seen.add(e.key)
        if not e.axes and e.dtype == "float" and e.key in reads:
            found[e.key] = e
        else:
            stack.extend(reversed(e.args))
    return list(found.values())


def let_uniforms(roots: list[Expr], bind: Callable[[Expr], str | None]
                 ) -> tuple[list[str], Callable[[Expr], str | None]]:
    """Scalar lets (`uni1: T.float32 = ...`) for the block-uniform subexpressions of `roots`,
    to write before the tile loops (over i, j) that read them, and `bind` extended to their
    names. One whose text reads i or j is left in the loop: a kernel that packs heads into
    rows (decode) binds h to a row's text."""
    em = Emitter(bind)
    names: dict[tuple, str] = {}
    lines = []
    for e in block_uniform(roots):
        text = em.float_(e)
        if re.search(r"\b[ij]\b", text):
            continue
        names[e.key] = f"uni{len(names) + 1}"
        lines.append(f"{names[e.key]}: T.float32 = {text}")
    if not names:
        return [], bind
    return lines, lambda n: names.get(n.key) or bind(n)
