"""IR rewrites used before code generation (each preserves the value of the expression)."""

from __future__ import annotations

from collections.abc import Callable

from engine.dsl.expr import Expr, topo


def rebuild(root: Expr, fn: Callable[[Expr, tuple[Expr, ...]], Expr | None]) -> Expr:
    """Bottom-up rebuild: `fn(node, new_args)` returns a replacement or None (keep)."""
    new: dict[tuple, Expr] = {}
    for node in topo([root]):
        args = tuple(new[a.key] for a in node.args)
        rep = fn(node, args)
        if rep is None:
            rep = (
                node
                if all(x is y for x, y in zip(args, node.args, strict=True))
                else Expr(
                    node.op, args, node.attr, None if node.op != "reduce" else node.axes, node.dtype
                )
            )
        new[node.key] = rep
    return new[root.key]


def substitute(root: Expr, mapping: dict[tuple, Expr]) -> Expr:
    """Replace nodes whose key is in `mapping`."""
    return rebuild(root, lambda node, args: mapping.get(node.key))


def positive(e: Expr) -> bool:
    """Whether `e` is positive by its structure (positive constants, exponentials, sigmoids,
    and their products, quotients and sums)."""
    if e.op == "const":
        return e.dtype != "bool" and float(e.attr) > 0
    if e.op in ("exp", "exp2", "sigmoid"):
        return True
    return e.op in ("mul", "div", "add") and all(positive(a) for a in e.args)


def _no_n(e: Expr) -> bool:
    return "n" not in e.axes


def _row_factor(e: Expr) -> bool:
    """A factor that a max along keys commutes with: positive and the same for every key."""
    return _no_n(e) and positive(e)


def pull_out_of_max(root: Expr) -> Expr:
    """reduce_max(x * c) -> reduce_max(x) * c for c positive and constant along keys (a
    constant, a per-head sigmoid gate), and
    reduce_max(x + r) -> reduce_max(x) + r for r constant along keys (likewise min), so that
    the reduction can read the raw score tile instead of a materialised copy."""

    def fn(node: Expr, args: tuple[Expr, ...]) -> Expr | None:
        if node.op != "reduce" or node.attr not in ("max", "min"):
            return None
        x = args[0]
        outer: list[tuple[str, Expr]] = []
        while True:
            if x.op == "mul" and _row_factor(x.args[1]):
                outer.append(("mul", x.args[1]))
                x = x.args[0]
            elif x.op == "mul" and _row_factor(x.args[0]):
                outer.append(("mul", x.args[0]))
                x = x.args[1]
            elif x.op in ("add", "sub") and _no_n(x.args[1]) and "n" in x.args[0].axes:
                outer.append((x.op, x.args[1]))
                x = x.args[0]
            elif x.op == "add" and _no_n(x.args[0]) and "n" in x.args[1].axes:
                outer.append(("add", x.args[0]))
                x = x.args[1]
            else:
                break
        if not outer:
            return None
        out = Expr("reduce", (x,), node.attr, node.axes, "float")
        for op, c in reversed(outer):
            out = Expr(op, (out, c))
        return out

    return rebuild(root, fn)


def distribute_exp_scale(
    root: Expr, factor: float, stop: Callable[[Expr], bool] | None = None
) -> Expr:
    """x * factor with constant factors folded and pushed through + and -, so that
    exp2((s*c - m) * log2e) becomes s*(c*log2e) - m*log2e: one FFMA per element. Nodes for
    which `stop` holds are treated as opaque."""
    if stop is not None and stop(root):
        return Expr("mul", (root, Expr.wrap(factor)))
    rec = lambda e: distribute_exp_scale(e, factor, stop)  # noqa: E731
    if root.op == "const" and root.dtype == "float":
        return Expr.wrap(float(root.attr) * factor)
    if root.op in ("add", "sub") and root.dtype == "float":
        return Expr(root.op, (rec(root.args[0]), rec(root.args[1])))
    if root.op == "neg":
        return Expr("neg", (rec(root.args[0]),))
    if root.op == "mul" and "n" in root.axes:
        # A score tile times factors constant along keys: one product of those factors (and
        # `factor`) per row, so each element is one multiply (an FFMA with the max's shift).
        tiles, rows = _split_product(root, stop)
        if rows:
            return Expr("mul", (_product(tiles), rec(_product(rows))))
    if root.op == "mul" and root.args[1].op == "const" and root.args[1].dtype == "float":
        return Expr("mul", (root.args[0], Expr.wrap(float(root.args[1].attr) * factor)))
    if root.op == "mul" and root.args[0].op == "const" and root.args[0].dtype == "float":
        return Expr("mul", (root.args[1], Expr.wrap(float(root.args[0].attr) * factor)))
    return Expr("mul", (root, Expr.wrap(factor)))


def _split_product(e: Expr, stop: Callable[[Expr], bool] | None) -> tuple[list[Expr], list[Expr]]:
    """(factors varying along keys, factors constant along keys) of the product `e`, in
    order; nodes for which `stop` holds are single factors."""
    if e.op != "mul" or (stop is not None and stop(e)):
        return ([e], []) if "n" in e.axes else ([], [e])
    (ta, ra), (tb, rb) = (_split_product(a, stop) for a in e.args)
    return ta + tb, ra + rb


def _product(factors: list[Expr]) -> Expr:
    out = factors[0]
    for f in factors[1:]:
        out = Expr("mul", (out, f))
    return out
