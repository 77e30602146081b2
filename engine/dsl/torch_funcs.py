"""torch functions on DSL expressions, and tensors captured from a hook's scope.

Hooks written for FlexAttention call torch: `torch.tanh(score / 50)`, `torch.where(c, s, -inf)`,
`bias[h]`, `doc_ids[b, q_idx] == doc_ids[b, kv_idx]`. An `Expr` takes part in torch's
`__torch_function__` protocol, so each such call arrives here and becomes the DSL operation of
the same meaning; a torch function without one is a `DSLError` naming it.

Captured tensors (only while `TensorCapture.active()`, as engine.flex does): a tensor indexed by
`b`, `h`, `q_idx`, `kv_idx` (or a constant, which selects) becomes a custom input read at those
positions; one indexed by integer expressions of them (`bias[h, q_idx - kv_idx + S]`)
becomes a table input read by a lookup; a one-element tensor used whole becomes a scalar
input. Each distinct tensor is one custom input, named in order of first use (`captured0`,
`captured1`, ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.dsl.expr import (
    CUSTOM_READS,
    TENSOR_CAPTURE,
    DSLError,
    Expr,
    custom_leaf,
    set_torch_functions,
    where,
)

# torch function -> the Expr method of the same meaning (one argument)
_UNARY = {
    torch.exp: "exp", torch.exp2: "exp2", torch.log: "log", torch.log2: "log2",
    torch.log1p: "log1p", torch.expm1: "expm1", torch.tanh: "tanh", torch.sigmoid: "sigmoid",
    torch.sin: "sin", torch.cos: "cos", torch.tan: "tan", torch.sqrt: "sqrt",
    torch.rsqrt: "rsqrt", torch.erf: "erf", torch.abs: "abs", torch.floor: "floor",
    torch.ceil: "ceil", torch.round: "round", torch.square: "square", torch.neg: "__neg__",
    F.softplus: "softplus", torch.special.expit: "sigmoid", torch.special.erf: "erf",
}
# tensor operators with a tensor first and an Expr second: the Expr's reflected operator
_REFLECTED = {
    "add": "__radd__", "__add__": "__radd__", "__radd__": "__add__",
    "sub": "__rsub__", "__sub__": "__rsub__", "__rsub__": "__sub__",
    "mul": "__rmul__", "__mul__": "__rmul__", "__rmul__": "__mul__",
    "div": "__rtruediv__", "__truediv__": "__rtruediv__", "__rtruediv__": "__truediv__",
    "eq": "__eq__", "__eq__": "__eq__", "ne": "__ne__", "__ne__": "__ne__",
    "ge": "__le__", "__ge__": "__le__", "gt": "__lt__", "__gt__": "__lt__",
    "le": "__ge__", "__le__": "__ge__", "lt": "__gt__", "__lt__": "__gt__",
    "__and__": "__rand__", "__or__": "__ror__", "__pow__": "__rpow__",
}
_INDEX_DIMS = {"b": "batch", "h": "heads", "q": "seq_len", "kv": "seq_len_kv"}


def torch_function(func: Any, args: tuple, kwargs: dict) -> Expr:
    """The DSL meaning of `func(*args, **kwargs)`, where some argument is an Expr."""
    name = getattr(func, "__name__", str(func))
    if func is torch.Tensor.__getitem__ or name == "__getitem__":
        return _capture().index(args[0], args[1])
    if func in _UNARY and len(args) == 1 and _plain(func, kwargs):
        return getattr(Expr.wrap(args[0]), _UNARY[func])()
    if func in (torch.where,) and len(args) == 3:
        return where(*args)
    if func in (torch.maximum, torch.max, torch.minimum, torch.min) and len(args) == 2:
        op = "max" if func in (torch.maximum, torch.max) else "min"
        return getattr(Expr.wrap(args[0]), op)(args[1])
    if func in (torch.clamp, torch.clip):
        return _clamp(*args, **kwargs)
    if func in (torch.relu, F.relu) and len(args) == 1:
        return Expr.wrap(args[0]).max(0.0)
    if func is torch.pow and len(args) == 2:
        return Expr.wrap(args[0]) ** args[1]
    if name in _REFLECTED and len(args) == 2 and not kwargs and isinstance(args[1], Expr):
        return getattr(args[1], _REFLECTED[name])(Expr.wrap(args[0]))
    if name in ("add", "sub", "mul", "div") and len(args) == 2 and isinstance(args[0], Expr):
        return getattr(args[0], f"__{'truediv' if name == 'div' else name}__")(args[1])
    raise DSLError(f"torch function {_qualified(func)} has no DSL equivalent here; see the "
                   "DSL's operations (README) or write it with them")


set_torch_functions(torch_function)


def _plain(func: Any, kwargs: dict) -> bool:
    """softplus only with its defaults (beta 1; its threshold only changes rounding)."""
    return not kwargs or (func is F.softplus and kwargs.get("beta", 1) == 1)


def _clamp(x: Any, min: Any = None, max: Any = None) -> Expr:  # noqa: A002 - torch's names
    e = Expr.wrap(x)
    if min is not None:
        e = e.max(min)
    if max is not None:
        e = e.min(max)
    return e


def _qualified(func: Any) -> str:
    """The name a user wrote: torch.softmax, torch.Tensor.cumsum, torch.nn.functional.gelu."""
    name = getattr(func, "__name__", str(func))
    qual = getattr(func, "__qualname__", name)
    if qual.startswith(("TensorBase.", "Tensor.")):
        return f"torch.Tensor.{name}"
    mod = getattr(func, "__module__", None)
    return f"{mod}.{name}" if mod and mod != "torch" else f"torch.{name}"


def _capture() -> TensorCapture:
    cap = TENSOR_CAPTURE.get()
    if cap is None:
        raise DSLError("a tensor is read here, but only engine.flex_attention's functions may "
                       "capture tensors; with AttentionEngine declare it in CustomIO")
    return cap


class TensorCapture:
    """The tensors a hook captured, as custom inputs: name -> (tensor, dims)."""

    def __init__(self) -> None:
        self.inputs: dict[str, tuple[torch.Tensor, tuple]] = {}
        # name -> (the tensor the function read, the constant indices that selected from it,
        # whether it was used whole): how to get the input again from the same tensor
        self.sources: dict[str, tuple[torch.Tensor, tuple, bool]] = {}
        self._names: dict[tuple, str] = {}
        self._integer: set[str] = set()  # inputs made of integer tensors (usable as indices)

    @contextlib.contextmanager
    def active(self) -> Iterator[TensorCapture]:
        token = TENSOR_CAPTURE.set(self)
        try:
            yield self
        finally:
            TENSOR_CAPTURE.reset(token)

    def whole(self, t: torch.Tensor) -> Expr:
        """A one-element tensor used as a number: a scalar input."""
        if t.numel() != 1:
            raise DSLError(f"a captured tensor of shape {tuple(t.shape)} is used whole; index "
                           "it with b, h, q_idx or kv_idx (only one-element tensors are numbers)")
        name = self._name(t.reshape(1), (1,), key=(id(t), "whole"), source=(t, (), True))
        return custom_leaf(name, (1,), (0,))

    def index(self, t: Any, index: Any) -> Expr:
        if not isinstance(t, torch.Tensor):
            raise DSLError(f"cannot index a {type(t).__name__} with symbolic indices")
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) != t.dim():
            raise DSLError(f"a captured tensor of shape {tuple(t.shape)} is indexed with "
                           f"{len(idx)} indices; give one per dimension")
        syms = [Expr.wrap(i) for i in idx if not isinstance(i, int)]
        if any(e.op != "idx" for e in syms):
            return self._table(t, idx)
        picks = tuple((d, i) for d, i in enumerate(idx) if isinstance(i, int))
        sel = derive(t, picks, whole=False)
        kinds = tuple(e.attr for e in syms)
        name = self._name(sel, tuple(_INDEX_DIMS[k] for k in kinds), key=(id(t), picks),
                          source=(t, picks, False))
        dims = self.inputs[name][1]
        return custom_leaf(name, dims, kinds)

    def _table(self, t: torch.Tensor, idx: tuple) -> Expr:
        """A tensor indexed by expressions (bias[h, q_idx - kv_idx], or table[h, ids[q_idx,
        kv_idx]] with an integer tensor `ids`): the whole tensor is one input with integer
        dims, read by a table lookup."""
        dims = tuple(int(n) for n in t.shape)
        name = self._name(t, dims, key=(id(t), "table"), source=(t, (), False))
        # custom inputs reach the kernels as fp32: exact for integers below 2 ** 24
        idx = tuple(i.long() if isinstance(i, Expr) and i.dtype == "float" and i.op in
                    CUSTOM_READS and i.attr[0] in self._integer else i for i in idx)
        return custom_leaf(name, dims, (0,) * len(dims)).attr_index(idx)

    def release(self) -> None:
        """Forget the captured tensors (a cached module must not keep them alive)."""
        self.inputs.clear()
        self.sources.clear()
        self._names.clear()
        self._integer.clear()

    def _name(self, t: torch.Tensor, dims: tuple, key: tuple, source: tuple) -> str:
        if key not in self._names:
            name = f"captured{len(self.inputs)}"
            self._names[key] = name
            if not t.is_floating_point() and t.dtype != torch.bool:
                self._integer.add(name)
            self.inputs[name] = (t, dims)
            self.sources[name] = source
        return self._names[key]


def derive(t: torch.Tensor, picks: tuple, whole: bool) -> torch.Tensor:
    """The custom input a capture made of tensor `t` (see TensorCapture.sources)."""
    for d, i in reversed(picks):
        t = t.select(d, i)
    return t.reshape(1) if whole else t

