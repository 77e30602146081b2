"""The keys a query row can see, as bounds on kv_idx read off a mask's conjunction.

Decode places its rows at runtime positions (the cache lengths), so block tables made on the
host do not apply; the kernel instead bounds its key loop by the affine atoms of the mask's
top-level `&`: `kv_idx >= q_idx - c`, `kv_idx <= q_idx + c` (sliding windows, causal) and
`kv_idx >= c`, `kv_idx < c` (fixed ranges). Every atom of a conjunction is necessary, so the
bounds are sound for any mask; other atoms stay in the mask, evaluated per element. With
`exact`, the mask is nothing but those atoms, so a key block inside the range of every row of
a tile needs no mask at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.dsl.expr import Expr

_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}


@dataclass(frozen=True)
class KeyRange:
    """kv_idx >= q_idx + rel_lo, kv_idx <= q_idx + rel_hi, abs_lo <= kv_idx <= abs_hi (None:
    no bound on that side); exact: the mask is the conjunction of these bounds."""

    rel_lo: int | None = None
    rel_hi: int | None = None
    abs_lo: int | None = None
    abs_hi: int | None = None
    exact: bool = False

    def span(self, seqlen_q: int) -> int | None:
        """The most keys `seqlen_q` consecutive rows can see together (None: unbounded)."""
        if self.rel_lo is None or self.rel_hi is None:
            return None
        return seqlen_q - 1 + self.rel_hi - self.rel_lo + 1


def linear_form(e: Expr) -> tuple[int, int, int] | None:
    """(a, b, c) with e = a * q_idx + b * kv_idx + c, or None if e is not of that form."""
    if e.op == "const" and e.dtype == "int":
        return 0, 0, int(e.attr)
    if e.op == "idx" and e.attr in ("q", "kv"):
        return (1, 0, 0) if e.attr == "q" else (0, 1, 0)
    if e.op in ("add", "sub"):
        x, y = linear_form(e.args[0]), linear_form(e.args[1])
        if x is None or y is None:
            return None
        s = 1 if e.op == "add" else -1
        return x[0] + s * y[0], x[1] + s * y[1], x[2] + s * y[2]
    if e.op == "neg":
        x = linear_form(e.args[0])
        return None if x is None else (-x[0], -x[1], -x[2])
    if e.op == "mul":
        for u, w in ((e.args[0], e.args[1]), (e.args[1], e.args[0])):
            if u.op == "const" and u.dtype == "int":
                x = linear_form(w)
                return None if x is None else (x[0] * u.attr, x[1] * u.attr, x[2] * u.attr)
    return None


def _atom_bound(e: Expr) -> tuple[str, int] | None:
    """An atom as (which bound: rel_lo/rel_hi/abs_lo/abs_hi, its value), or None."""
    if e.op not in _FLIP:
        return None
    lhs, rhs = linear_form(e.args[0]), linear_form(e.args[1])
    if lhs is None or rhs is None:
        return None
    a, b, c = lhs[0] - rhs[0], lhs[1] - rhs[1], lhs[2] - rhs[2]  # a q + b kv + c  op  0
    op = e.op
    if b == -1:
        a, b, c, op = -a, 1, -c, _FLIP[op]
    if b != 1 or a not in (0, -1):
        return None
    # kv + c' op 0 with c' = c - q (a = -1) or c (a = 0): kv op -c' (ints: strict -> closed).
    bound = -c
    if op in ("gt", "ge"):
        return ("rel_lo" if a else "abs_lo"), bound + (op == "gt")
    return ("rel_hi" if a else "abs_hi"), bound - (op == "lt")


def conjuncts(e: Expr) -> list[Expr]:
    if e.op == "and":
        return conjuncts(e.args[0]) + conjuncts(e.args[1])
    return [e]


def key_range(mask: Expr | None) -> KeyRange:
    """The bounds on kv_idx that the mask's top-level conjunction implies."""
    if mask is None:
        return KeyRange(exact=True)
    bounds: dict[str, int] = {}
    exact = True
    for atom in conjuncts(mask):
        got = _atom_bound(atom)
        if got is None:
            exact = False
            continue
        name, value = got
        pick = max if name.endswith("lo") else min
        bounds[name] = pick(bounds[name], value) if name in bounds else value
    return KeyRange(**bounds, exact=exact)
