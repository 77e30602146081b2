"""q/k/v mods: user functions applied elementwise to the query, key and value tensors (seed
001: `scores = query_mod(query) @ key_mod(key)`, `o = p @ value_mod(value)`).

Each mod is traced once into an expression of one element of its tensor (the leaf `tensor`,
axes (position, "d")), the indices b, h and the position, constants and CustomIO reads. The
mods are not part of the TracedSpec: engines apply them before the attention as a pre-pass of
torch ops (engine.reference.tensor_mods), so the kernels are the same with or without them.
Nothing here is specific to softmax attention: any engine whose inputs are [B, S, H, D]
tensors (a linear attention's q/k/v mods too) traces its mods with `trace_tensor_mod`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.dsl.expr import Expr, custom_names, index_leaf, leaf, leaves, to_text
from engine.dsl.io import CustomIO
from engine.ir.spec import TracedSpec
from engine.ir.trace import TraceError, as_expr, call_hook, check_result, positional_arity

TENSOR_LEAF = "tensor"  # the leaf op of the modded tensor's element (engine.reference.evaluate)
# A mod's accepted forms by positional arity: AttentionEngine takes (x) and the seeds' five
# parameters; LinearAttentionEngine's scripts also write (x, custom_io).
_FORMS = {1: "(x)", 2: "(x, custom_io)", 5: "(x, custom_fwd_inputs, b, h, pos)"}
# A mod's position index ("q" or "kv"): the tile axis it varies along and its name in errors.
_POSITIONS = {"q": ("m", "query position"), "kv": ("n", "key position")}
_AXIS_NAMES = {"m": "query position (q_idx)", "n": "key position (kv_idx)"}


@dataclass(frozen=True, eq=False)  # eq=False: Expr's == builds an expression
class TensorMod:
    """One traced mod, `hook` its name: `expr` reads the leaf `tensor`, b, h and the index
    `pos` ("q": the tensor's rows are query positions; "kv": key positions)."""

    hook: str
    expr: Expr
    pos: str

    def describe(self) -> str:
        return f"{self.hook} = {to_text(self.expr)}"


@dataclass(frozen=True, eq=False)
class QKVMods:
    """The traced query, key and value mods of an attention (None: the identity)."""

    query: TensorMod | None
    key: TensorMod | None
    value: TensorMod | None

    def present(self) -> list[TensorMod]:
        return [m for m in (self.query, self.key, self.value) if m is not None]

    def custom_reads(self) -> set[str]:
        return custom_names(m.expr for m in self.present())

    def describe(self) -> str:
        return "\n".join(m.describe() for m in self.present())


def trace_tensor_mod(hook: str, fn: Callable | None, pos: str, customs: CustomIO, *,
                     arities: tuple[int, ...] = (1, 5), features: bool = True
                     ) -> TensorMod | None:
    """Trace `fn`, the mod named `hook`, of a tensor whose rows are indexed by `pos` ("q" or
    "kv"): called with the positional arity it declares among `arities` (forms in _FORMS),
    elementwise in x. `features`: the tensor has a feature axis "d" (a decay [B, H, T] has
    none). None for None (the identity); a malformed mod raises a TraceError naming `hook`."""
    if fn is None:
        return None
    texts = [_FORMS[a] for a in arities]
    forms = " or ".join([", ".join(texts[:-1]), texts[-1]] if len(texts) > 1 else texts)
    if not callable(fn):
        raise TraceError(f"{hook}: expected a callable {forms}, got {type(fn).__name__}")
    arity = positional_arity(fn)
    if arity is not None and arity not in arities:  # None (*args, a builtin): called as fn(x)
        raise TraceError(f"{hook} takes {arity} positional parameters; expected {forms}")
    axis, position = _POSITIONS[pos]
    axes = (axis, "d") if features else (axis,)
    x = leaf(TENSOR_LEAF, axes)
    args = {2: (x, customs),
            5: (x, customs, index_leaf("b"), index_leaf("h"), index_leaf(pos))}.get(arity, (x,))
    result = as_expr(hook, "the result", call_hook(hook, fn, args))
    other = set(result.axes) - set(axes)
    if other:
        raise TraceError(
            f"{hook}: the result varies along the {_AXIS_NAMES[other.pop()]}, but {hook} sees "
            f"one {position} (pos): read CustomIO inputs at pos explicitly, e.g. "
            "custom_fwd_inputs[name][b, pos]"
        )
    return TensorMod(hook, check_result(hook, "the result", result, set(axes), customs), pos)


def trace_qkv_mods(query_mod: Callable | None, key_mod: Callable | None,
                   value_mod: Callable | None, customs: CustomIO) -> QKVMods | None:
    """The traced mods of an attention's q (rows: query positions), k and v (key positions);
    None when all three are None."""
    mods = QKVMods(trace_tensor_mod("query_mod", query_mod, "q", customs),
                   trace_tensor_mod("key_mod", key_mod, "kv", customs),
                   trace_tensor_mod("value_mod", value_mod, "kv", customs))
    return mods if mods.present() else None


def mod_only_customs(mods: QKVMods, spec: TracedSpec) -> frozenset[str]:
    """CustomIO names the mods read and the attention's differentiable hooks do not (score_mod
    and the online functions; the mask has no gradient). Engines give these to the attention
    detached: their gradient comes from the mods' torch ops, and the attention's backward is
    not asked for a zero gradient (which sends the backward kernels to the reference rules)."""
    attention = custom_names([spec.score_mod]) | spec.online_custom_reads()
    return frozenset(mods.custom_reads() - attention)


def constant_scale(mod: TensorMod | None) -> float | None:
    """c when `mod` is x * c, c * x or x / c with c a constant (a scale a linear kernel can
    fold into its output: no pass over the tensor), else None."""
    if mod is None or mod.expr.op not in ("mul", "div"):
        return None
    a, b = mod.expr.args
    if mod.expr.op == "mul" and a.op == "const":
        a, b = b, a
    if a.op != TENSOR_LEAF or b.op != "const" or type(b.attr) not in (int, float):
        return None
    c = float(b.attr)
    if mod.expr.op == "div":
        return 1.0 / c if c != 0.0 else None
    return c


def position_factor(mod: TensorMod | None) -> Expr | None:
    """E when `mod` is x * E or E * x with E free of x, else None. A mod sees b, h and the
    position but no feature index, so E is one factor per (b, h, position): a linear kernel
    folds it into the position's decay factors instead of a pass over the tensor."""
    if mod is None or mod.expr.op != "mul":
        return None
    a, b = mod.expr.args
    if b.op == TENSOR_LEAF:
        a, b = b, a
    if a.op != TENSOR_LEAF or any(n.op == TENSOR_LEAF for n in leaves([b])):
        return None
    return b
