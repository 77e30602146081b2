"""Tracing: call the user's hooks once with symbolic leaves and validate what they return."""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.dsl.expr import CUSTOM_READS, DSLError, Expr, index_leaf, leaf, topo
from engine.dsl.io import CustomIO
from engine.dsl.online import OnlineFunc, check_online_func
from engine.ir.spec import TracedSpec, spec_hash


class TraceError(ValueError):
    """A user hook is malformed; the message names the hook and the fault."""


# Leaves each hook may read.
_ALLOWED = {
    "score_mod": {"score", "idx", "custom", "const"},
    "mask_mod": {"idx", "custom", "const"},
    "online_fwd": {"score", "rowscale", "idx", "custom", "const"},
    "online_fwd_epilogue": {"o", "rowscale", "idx", "custom", "const"},
    "forward": {"score", "final", "idx", "custom", "const"},
    "backward": {"dp", "p", "final", "doosum", "idx", "custom", "const"},
    # q/k/v mods (engine.ir.tensor_mods): one element of their tensor, its indices, customs
    "query_mod": {"tensor", "idx", "custom", "const"},
    "key_mod": {"tensor", "idx", "custom", "const"},
    "value_mod": {"tensor", "idx", "custom", "const"},
    # LinearAttentionEngine's mods (its scripts' names; query_mod etc. are accepted too)
    "q_mod": {"tensor", "idx", "custom", "const"},
    "k_mod": {"tensor", "idx", "custom", "const"},
    "v_mod": {"tensor", "idx", "custom", "const"},
    "decay_mod": {"tensor", "idx", "custom", "const"},
}
# Names the seeds use for the backward's row sum of dO*O; resolved even when the parameter is
# called something else (seed 000 names the parameter `doosum` but reads `doosum_rowscales`).
_DOOSUM_ALIASES = ("doosum", "doosum_rowscales", "dppsum")


class _AliasGlobals(dict):
    def __init__(self, base: dict, aliases: dict[str, Any]):
        super().__init__(base)
        self._aliases = aliases

    def __missing__(self, key: str) -> Any:
        if key in self._aliases:
            return self._aliases[key]
        raise KeyError(key)


def _with_aliases(fn: Callable, aliases: dict[str, Any]) -> Callable:
    if not isinstance(fn, types.FunctionType):
        return fn
    aliases = {k: v for k, v in aliases.items() if k not in fn.__globals__}
    if not aliases:
        return fn
    return types.FunctionType(
        fn.__code__,
        _AliasGlobals(fn.__globals__, aliases),
        fn.__name__,
        fn.__defaults__,
        fn.__closure__,
    )


def call_hook(hook: str, fn: Callable, args: tuple, aliases: dict[str, Any] | None = None
              ) -> Any:
    """`fn(*args)` with symbolic arguments; a fault becomes a TraceError naming the hook, the
    fault and the line of the user's code where it happened."""
    if aliases:
        fn = _with_aliases(fn, aliases)
    try:
        return fn(*args)
    except (DSLError, AttributeError, NameError) as exc:
        raise TraceError(f"{hook}: {exc}{_user_line(exc)}") from None
    except TypeError as exc:
        raise TraceError(
            f"{hook}: {exc}{_user_line(exc)} (hooks receive symbolic values: use the DSL's "
            "operators and methods such as .exp(), .max(x), get_reduce())"
        ) from None

# The engine's own frames and torch's (its __torch_function__ dispatch) are not the user's.
_LIBRARY_DIRS = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))


def _user_line(exc: BaseException) -> str:
    """' (at FILE:LINE)' of the innermost frame of the user's code in the traceback, or ''."""
    where = ""
    tb = exc.__traceback__
    while tb is not None:
        path = str(Path(tb.tb_frame.f_code.co_filename).resolve())
        if not path.startswith(_LIBRARY_DIRS):
            where = f" (at {Path(path).name}:{tb.tb_lineno})"
        tb = tb.tb_next
    return where


def positional_arity(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def as_expr(hook: str, what: str, value: Any) -> Expr:
    try:
        return Expr.wrap(value)
    except DSLError as exc:
        raise TraceError(f"{hook}: {what}: {exc}") from None


def check_result(
    hook: str,
    what: str,
    value: Any,
    axes: set[str],
    customs: CustomIO,
    allow_reduce: bool = False,
    dtype: str = "float",
) -> Expr:
    """`value` (a hook's return value) as an Expr, checked for axes, dtype, reductions and
    the leaves and CustomIO inputs the hook may read."""
    e = as_expr(hook, what, value)
    if not set(e.axes) <= axes:
        raise TraceError(
            f"{hook}: {what} varies along {e.axes} but may only vary along {tuple(sorted(axes))}"
            + (
                " (a row scale must be the same for every key: reduce it with get_reduce)"
                if "n" in e.axes and "n" not in axes
                else ""
            )
        )
    if dtype == "bool" and e.dtype != "bool":
        raise TraceError(
            f"{hook}: must return a boolean expression (e.g. q_idx >= kv_idx), got a {e.dtype} value"
        )
    if dtype == "float" and e.dtype == "bool":
        raise TraceError(f"{hook}: {what} is boolean; expected a number (use where(cond, a, b))")
    for node in topo([e]):
        if node.op == "reduce" and not allow_reduce:
            raise TraceError(
                f"{hook}: {what} uses get_reduce({node.attr!r}); reductions are only allowed in online_fwd"
            )
        if not node.args and node.op not in _ALLOWED[hook]:
            raise TraceError(f"{hook}: {what} reads '{node.op}', which this hook cannot see")
        if node.op == "gather" and hook not in ("score_mod", "mask_mod"):
            raise TraceError(f"{hook}: reads CustomIO input {node.attr[0]!r} at computed "
                             "indices; table lookups are for score_mod and mask_mod")
        if node.op in CUSTOM_READS and node.attr[0] not in customs.decls:
            raise TraceError(
                f"{hook}: reads CustomIO input {node.attr[0]!r}, which is not "
                f"declared in custom_fwd_inputs ({sorted(customs.decls) or 'none'})"
            )
    return e


def dict_result(hook: str, what: str, value: Any, expected: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TraceError(f"{hook}: {what} must be a dict, got {type(value).__name__}")
    if sorted(value) != sorted(expected):
        raise TraceError(f"{hook}: {what} has keys {sorted(value)}; expected {sorted(expected)}")
    return value


def tuple_result(hook: str, value: Any, n: int, names: str) -> tuple:
    if not isinstance(value, tuple) or len(value) != n:
        got = f"a {len(value)}-tuple" if isinstance(value, tuple) else type(value).__name__
        raise TraceError(f"{hook}: must return {n} values ({names}), got {got}")
    return value


def identity_score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
    return score


def trace_mask(mask_mod: Callable, customs: CustomIO | None = None) -> Expr:
    """Trace `mask_mod(b, h, q_idx, kv_idx)` into a boolean expression (raises TraceError)."""
    customs = customs if customs is not None else CustomIO({})
    if not callable(mask_mod):
        raise TraceError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    if positional_arity(mask_mod) not in (None, 4):
        raise TraceError("mask_mod must take (b, h, q_idx, kv_idx)")
    b, h, q, kv = (index_leaf(n) for n in ("b", "h", "q", "kv"))
    mval = call_hook("mask_mod", mask_mod, (b, h, q, kv))
    if isinstance(mval, bool):
        raise TraceError(
            "mask_mod: returned a Python bool; it must return a comparison of "
            "its index arguments (e.g. q_idx >= kv_idx)"
        )
    return check_result("mask_mod", "the result", mval, {"m", "n"}, customs, dtype="bool")


def trace_spec(
    score_mod: Callable | None,
    mask_mod: Callable | None,
    online_func: OnlineFunc,
    custom_fwd_inputs: CustomIO | None = None,
) -> TracedSpec:
    """Trace the user's hooks into a TracedSpec (raises TraceError on malformed hooks)."""
    customs = custom_fwd_inputs if custom_fwd_inputs is not None else CustomIO({})
    if not isinstance(customs, CustomIO):
        raise TraceError(f"custom_fwd_inputs must be a CustomIO, got {type(customs).__name__}")
    try:
        of = check_online_func(online_func)
    except DSLError as exc:
        raise TraceError(str(exc)) from None
    s_mod = _trace_score_mod(score_mod, customs)
    mask = trace_mask(mask_mod, customs) if mask_mod is not None else None
    p, updates, o_scale = _trace_online_fwd(of, customs)
    epi_o, finals = _trace_epilogue(of, customs)
    recompute, bwd = _trace_rules(of, customs)
    online_names, final_names = list(of.online_rowscales), list(of.final_rowscales)
    spec = TracedSpec(
        score_mod=s_mod,
        mask=mask,
        online_init=tuple((n, of.online_rowscales[n].init.value) for n in online_names),
        online_p=p,
        online_updates=updates,
        o_scale=o_scale,
        epilogue_o=epi_o,
        epilogue_final=finals,
        fwd_recompute=recompute,
        bwd=bwd,
        customs=tuple((n, d) for n, d in customs.decls.items()),
        final_init=tuple((n, of.final_rowscales[n].init.value) for n in final_names),
        online_name=type(of).__name__,
    )
    return dataclasses.replace(spec, hash=spec_hash(spec.canonical_text()))


def _indices() -> tuple[Expr, Expr, Expr, Expr]:
    return index_leaf("b"), index_leaf("h"), index_leaf("q"), index_leaf("kv")


def _trace_score_mod(score_mod: Callable | None, customs: CustomIO) -> Expr:
    """score_mod in the seed form (score, custom, b, h, q_idx, kv_idx) or the flex form
    (score, b, h, q, kv)."""
    b, h, q, kv = _indices()
    sm = score_mod or identity_score_mod
    if not callable(sm):
        raise TraceError(f"score_mod must be callable, got {type(sm).__name__}")
    raw = leaf("score", ("m", "n"))
    arity = positional_arity(sm)
    args = (raw, b, h, q, kv) if arity == 5 else (raw, customs, b, h, q, kv)
    if arity not in (None, 5, 6):
        raise TraceError(
            f"score_mod takes {arity} positional parameters; expected "
            "(score, custom_fwd_inputs, b, h, q_idx, kv_idx) or (score, b, h, q_idx, kv_idx)"
        )
    return check_result("score_mod", "the result", call_hook("score_mod", sm, args), {"m", "n"}, customs)


def _trace_online_fwd(of: OnlineFunc, customs: CustomIO
                      ) -> tuple[Expr, tuple[tuple[str, Expr], ...], Expr]:
    """online_fwd: (the scores p, the new online row scales, o_scale)."""
    b, h, q, _ = _indices()
    online_names = list(of.online_rowscales)
    rs = {n: leaf("rowscale", ("m",), n) for n in online_names}
    score = leaf("score", ("m", "n"))
    res = tuple_result(
        "online_fwd",
        call_hook("online_fwd", of.online_fwd, (score, dict(rs), b, h, q)),
        3,
        "scores, new_online_rowscales, o_scale",
    )
    p = check_result("online_fwd", "the returned scores", res[0], {"m", "n"}, customs,
               allow_reduce=True)
    upd = dict_result("online_fwd", "new_online_rowscales", res[1], online_names)
    updates = tuple(
        (n, check_result("online_fwd", f"row scale {n!r}", upd[n], {"m"}, customs, allow_reduce=True))
        for n in online_names
    )
    o_scale = check_result("online_fwd", "o_scale", res[2], {"m"}, customs, allow_reduce=True)
    return p, updates, o_scale


def _trace_epilogue(of: OnlineFunc, customs: CustomIO
                    ) -> tuple[Expr, tuple[tuple[str, Expr], ...]]:
    """online_fwd_epilogue: (o, the final row scales)."""
    b, h, q, _ = _indices()
    rs = {n: leaf("rowscale", ("m",), n) for n in of.online_rowscales}
    final_names = list(of.final_rowscales)
    o = leaf("o", ("m", "d"))
    res = tuple_result(
        "online_fwd_epilogue",
        call_hook("online_fwd_epilogue", of.online_fwd_epilogue, (o, dict(rs), b, h, q)),
        2,
        "o, final_rowscales",
    )
    epi_o = check_result("online_fwd_epilogue", "o", res[0], {"m", "d"}, customs)
    fin = dict_result("online_fwd_epilogue", "final_rowscales", res[1], final_names)
    finals = tuple(
        (n, check_result("online_fwd_epilogue", f"final row scale {n!r}", fin[n], {"m"}, customs))
        for n in final_names
    )
    return epi_o, finals


def _trace_rules(of: OnlineFunc, customs: CustomIO) -> tuple[Expr, Expr]:
    """The backward's rules: `forward` (P recomputed from the final row scales) and
    `backward` (d score from dP, P, the finals and doosum)."""
    b, h, q, kv = _indices()
    fl = {n: leaf("final", ("m",), n) for n in of.final_rowscales}
    score = leaf("score", ("m", "n"))
    recompute = check_result(
        "forward",
        "the result",
        call_hook("forward", of.forward, (score, dict(fl), b, h, q, kv)),
        {"m", "n"},
        customs,
    )
    dp, pp, doosum = leaf("dp", ("m", "n")), leaf("p", ("m", "n")), leaf("doosum", ("m",))
    bwd_val = call_hook(
        "backward",
        of.backward,
        (dp, pp, dict(fl), doosum, b, h, q, kv),
        aliases={a: doosum for a in _DOOSUM_ALIASES},
    )
    return recompute, check_result("backward", "the result", bwd_val, {"m", "n"}, customs)
