"""Symbolic differentiation of IR expressions (for the backward of score_mod and for the
gradients of CustomIO inputs). Every elementwise op of the DSL has a rule."""

from __future__ import annotations

import math

from engine.dsl.expr import CUSTOM_READS, ROUNDING_OPS, Expr, leaves, topo, where

_LN2 = math.log(2.0)


def _c(x: float) -> Expr:
    return Expr.wrap(float(x))


def _is_const(e: Expr, value: float | None = None) -> bool:
    return e.op == "const" and (value is None or float(e.attr) == value)


def _add(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0.0):
        return b
    if _is_const(b, 0.0):
        return a
    return a + b


def _mul(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0.0) or _is_const(b, 0.0):
        return _c(0.0)
    if _is_const(a, 1.0):
        return b
    if _is_const(b, 1.0):
        return a
    return a * b


def _float(e: Expr) -> Expr:
    return e if e.dtype == "float" else e * 1.0


def diff(root: Expr, wrt: Expr) -> Expr:
    """d root / d wrt, elementwise (wrt is a leaf such as the `score` leaf or a custom read)."""
    grads: dict[tuple, Expr] = {}
    for node in topo([root]):
        if node.key == wrt.key:
            grads[node.key] = _c(1.0)
            continue
        if not node.args or node.dtype == "bool":
            grads[node.key] = _c(0.0)
            continue
        ds = [grads[a.key] for a in node.args]
        if all(_is_const(d, 0.0) for d in ds):
            grads[node.key] = _c(0.0)
            continue
        grads[node.key] = _rule(node, ds)
    return grads[root.key]


# d f(x) / dx of the smooth math ops, from x (as a float) and the node y = f(x) itself.
_MATH_RULES = {
    "exp": lambda x, y: y,
    "exp2": lambda x, y: y * _LN2,
    "log": lambda x, y: 1.0 / x,
    "log2": lambda x, y: 1.0 / (x * _LN2),
    "tanh": lambda x, y: 1.0 - y * y,
    "sigmoid": lambda x, y: y * (1.0 - y),
    "sin": lambda x, y: x.cos(),
    "cos": lambda x, y: -x.sin(),
    "tan": lambda x, y: 1.0 + y * y,
    "sqrt": lambda x, y: 0.5 / y,
    "rsqrt": lambda x, y: -0.5 * y * y * y,
    "log1p": lambda x, y: 1.0 / (1.0 + x),
    "expm1": lambda x, y: y + 1.0,
    "erf": lambda x, y: (2.0 / math.sqrt(math.pi)) * (-(x * x)).exp(),
}


def _rule(node: Expr, ds: list[Expr]) -> Expr:
    op, a = node.op, node.args
    x = a[0]
    if op == "neg":
        return _mul(_c(-1.0), ds[0])
    if op in _MATH_RULES:
        return _mul(_MATH_RULES[op](_float(x), node), ds[0])
    if op in (*ROUNDING_OPS, "toint", "floordiv"):
        return _c(0.0)  # piecewise constant
    if op == "mod":
        return ds[0]  # x - c * floor(x / c), c a constant
    if op == "abs":
        return _mul(where(x > 0, 1.0, where(x < 0, -1.0, 0.0)), ds[0])
    if op == "pow":
        c = node.attr
        if c == 0.0:
            return _c(0.0)
        dx = _c(c) if c == 1.0 else (x.pow(c - 1.0) * c)
        return _mul(dx, ds[0])
    if op == "add":
        return _add(ds[0], ds[1])
    if op == "sub":
        return _add(ds[0], _mul(_c(-1.0), ds[1]))
    if op == "mul":
        return _add(_mul(ds[0], a[1]), _mul(a[0], ds[1]))
    if op == "div":
        y = a[1]
        t0 = _mul(ds[0], 1.0 / _float(y))
        t1 = _mul(ds[1], _mul(_c(-1.0), a[0] / (_float(y) * y)))
        return _add(t0, t1)
    if op in ("max", "min"):
        pick_first = (a[0] >= a[1]) if op == "max" else (a[0] <= a[1])
        return where(pick_first, ds[0], ds[1])
    if op == "where":
        return where(a[0], ds[1], ds[2])
    if op == "reduce":
        raise ValueError("cannot differentiate a row reduction elementwise")
    raise ValueError(f"no derivative rule for op {op!r}")  # pragma: no cover - all ops covered


def score_mod_derivatives(spec) -> tuple[Expr, dict[str, tuple[Expr, Expr]]]:
    """d score_mod / d score, and for each custom read (or table lookup) in score_mod, keyed by
    the read's key, (the read's node, d score_mod / d read). Shared by the reference backward and the backward
    kernel generator."""
    score = next((n for n in leaves([spec.score_mod]) if n.op == "score"), None)
    ds = diff(spec.score_mod, score) if score is not None else Expr.wrap(0.0)
    dc = {}
    for n in topo([spec.score_mod]):
        if n.op in CUSTOM_READS:
            dc[n.key] = (n, diff(spec.score_mod, n))
    return ds, dc
