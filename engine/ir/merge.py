"""The merge rule of split-KV decode: how the partial results of one row, computed by several
thread blocks over disjoint key ranges, combine (engine.dsl.online.OnlineFunc's
`combine_online` or `combine`).

Traced like the other hooks, with each row scale a tile over (rows "m", splits "n"), so that
`get_reduce` reduces over the splits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.dsl.expr import Expr, leaf, to_text, topo
from engine.dsl.online import OnlineFunc, OnlineIdentity, OnlineRetention, OnlineSoftmax
from engine.ir.spec import TracedSpec
from engine.ir.trace import TraceError, as_expr, call_hook, dict_result, trace_spec, tuple_result

ONLINE, FINAL = "online", "final"


@dataclass(frozen=True, eq=False)
class TracedMerge:
    """form ONLINE: the splits' unnormalised outputs weighted by `weight` and summed, then the
    spec's epilogue on the `merged` online row scales. form FINAL: the splits' outputs after
    the epilogue weighted by `weight` (over their final row scales) and summed.
    `weight` reads leaves `rowscale.<name>` (ONLINE) or `final.<name>` (FINAL) over (m, n)."""

    form: str
    weight: Expr
    merged: tuple[tuple[str, Expr], ...] = ()

    def text(self) -> str:
        """The canonical text (kept: kernel caches key on the merge at every decode call)."""
        if "_text" not in self.__dict__:
            lines = [f"form {self.form}", f"weight = {to_text(self.weight)}"]
            lines += [f"merged.{n} = {to_text(e)}" for n, e in self.merged]
            object.__setattr__(self, "_text", "\n".join(lines))
        return self.__dict__["_text"]

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TracedMerge) and self.text() == other.text()

    def __hash__(self) -> int:
        return hash(self.text())


def _defines(of: OnlineFunc, name: str) -> bool:
    return callable(getattr(type(of), name, None))


def _check(hook: str, what: str, value, axes: set[str], leaf_op: str) -> Expr:
    e = as_expr(hook, what, value)
    if not set(e.axes) <= axes:
        raise TraceError(f"{hook}: {what} varies along {e.axes}; expected at most "
                         f"{tuple(sorted(axes))} (reduce over the splits with get_reduce)")
    for node in topo([e]):
        if not node.args and node.op not in (leaf_op, "const"):
            raise TraceError(f"{hook}: {what} reads '{node.op}'; a merge sees only the row "
                             "scales")
    return e


def _trace_online(of: OnlineFunc) -> TracedMerge:
    names = list(of.online_rowscales)
    rs = {n: leaf("rowscale", ("m", "n"), n) for n in names}
    res = tuple_result("combine_online", call_hook("combine_online", of.combine_online,
                                                    (dict(rs),)), 2, "o_scale, merged rowscales")
    weight = _check("combine_online", "o_scale", res[0], {"m", "n"}, "rowscale")
    merged = dict_result("combine_online", "merged rowscales", res[1], names)
    return TracedMerge(ONLINE, weight, tuple(
        (n, _check("combine_online", f"row scale {n!r}", merged[n], {"m"}, "rowscale"))
        for n in names))


def _trace_final(of: OnlineFunc) -> TracedMerge:
    fl = {n: leaf("final", ("m", "n"), n) for n in of.final_rowscales}
    weight = call_hook("combine", of.combine, (dict(fl),))
    return TracedMerge(FINAL, _check("combine", "o_scale", weight, {"m", "n"}, "final"))


_PREDEFINED = (OnlineSoftmax, OnlineRetention, OnlineIdentity)


def _online_text(spec: TracedSpec) -> str:
    """The parts of a spec its normaliser decides (not score_mod, mask or customs)."""
    return "\n".join([repr(spec.online_init), to_text(spec.online_p), to_text(spec.o_scale),
                      *(f"{n}={to_text(e)}" for n, e in spec.online_updates),
                      to_text(spec.epilogue_o)])


def trace_merge(of: OnlineFunc, spec: TracedSpec | None = None) -> TracedMerge | None:
    """The merge rule of `of` (None: it has none). With `spec` (traced from `of`), a normaliser
    without a merge of its own whose online step and epilogue trace exactly as a predefined
    one's (a user's copy of softmax, as in the seeds) takes the predefined merge."""
    if _defines(of, "combine_online"):
        return _trace_online(of)
    if _defines(of, "combine"):
        return _trace_final(of)
    if spec is None:
        return None
    text = _online_text(spec)
    for cls in _PREDEFINED:
        known = cls()
        if _online_text(trace_spec(None, None, known)) == text:
            return _trace_online(known)
    return None
