"""Dilated masks as shorter rows: a conjunct `(q_idx - kv_idx) % d == 0` of a mask's top-level
`&` lets query q = i*d + r meet only keys j*d + r. Each residue r is then its own attention
over the rows i and keys j, and a kernel that walks them so computes none of the pairs the
conjunct masks out: (d - 1)/d of the key blocks a dilated mask leaves partial, with no block
full (LongNet's dilated attention splits its segments the same way).

Accepted forms (d an integer constant >= 2): `(q - kv) % d == 0`, `(kv - q) % d == 0` (or
with a multiple of d added), and `q % d == kv % d`, either side of the `==`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.dsl.expr import Expr
from engine.mask.key_range import conjuncts, linear_form


@dataclass(frozen=True)
class Congruence:
    """The mask is `(q_idx - kv_idx) % stride == 0 & rest` (rest None: nothing else)."""

    stride: int
    rest: Expr | None


def _int_const(e: Expr) -> int | None:
    return int(e.attr) if e.op == "const" and e.dtype == "int" else None


def _modulus(e: Expr) -> tuple[Expr, int] | None:
    """(x, d) for e = x % d with d an integer constant >= 2."""
    if e.op != "mod":
        return None
    d = _int_const(e.args[1])
    return (e.args[0], d) if d is not None and d >= 2 else None


def _stride(atom: Expr) -> int | None:
    """d where `atom` says q_idx and kv_idx are congruent modulo d, else None."""
    if atom.op != "eq":
        return None
    for lhs, rhs in (atom.args, atom.args[::-1]):
        m = _modulus(lhs)
        if m is None:
            continue
        x, d = m
        if _int_const(rhs) == 0:
            form = linear_form(x)
            if form is not None and form[0] == -form[1] and abs(form[0]) == 1 \
                    and form[2] % d == 0:
                return d
        other = _modulus(rhs)
        if other is not None and other[1] == d and \
                {linear_form(x), linear_form(other[0])} == {(1, 0, 0), (0, 1, 0)}:
            return d
    return None


def congruence(mask: Expr | None) -> Congruence | None:
    """The largest congruence among the mask's conjuncts and the mask without it (None: the
    mask has no such conjunct)."""
    if mask is None:
        return None
    atoms = conjuncts(mask)
    found = [(d, i) for i, a in enumerate(atoms) if (d := _stride(a)) is not None]
    if not found:
        return None
    stride, pick = max(found)
    rest = None
    for i, atom in enumerate(atoms):
        if i != pick:
            rest = atom if rest is None else rest & atom
    return Congruence(stride, rest)
