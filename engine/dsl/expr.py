"""Symbolic expressions of the attention DSL.

User hooks (`score_mod`, `mask_mod`, the `OnlineFunc` methods) are called once with symbolic
leaves instead of tensors; every operation they perform builds an `Expr` node. The resulting
DAG is the IR: the reference executor evaluates it with torch ops and the code generator emits
it as TileLang.

Shapes are tracked as *axes*: "m" (query rows of a tile), "n" (key columns), "d" (the value
dim of the output tile in the epilogue). A row scale has axes ("m",), a score tile ("m", "n"),
b and h have none. Broadcasting is the union of axes, in canonical order.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterable
from typing import Any

AXIS_ORDER = ("m", "n", "d")

# Smooth elementwise functions of a float (each with its derivative in engine.ir.diff).
MATH_OPS = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sin", "cos", "tan", "sqrt",
            "rsqrt", "log1p", "expm1", "erf")
# Piecewise constant: float -> float (an int is left as it is), and the cast to an integer.
ROUNDING_OPS = ("floor", "ceil", "round")
UNARY_OPS = ("neg", *MATH_OPS, *ROUNDING_OPS, "abs", "toint", "not")
BINARY_OPS = ("add", "sub", "mul", "div", "max", "min", "floordiv", "mod")
COMPARE_OPS = ("ge", "gt", "le", "lt", "eq", "ne")
LOGIC_OPS = ("and", "or")
REDUCE_KINDS = ("max", "sum", "abssum", "min")
# Leaves: const, score, o, rowscale, final, dp, p, doosum, idx, custom. A custom input read at
# integer expressions of the indices (a table lookup) is the node "gather" (name, dims) whose
# args are the index per dim.
LEAF_OPS = ("const", "score", "o", "rowscale", "final", "dp", "p", "doosum", "idx", "custom")
INDEX_NAMES = ("b", "h", "q", "kv")
_INDEX_AXES = {"b": (), "h": (), "q": ("m",), "kv": ("n",)}


class DSLError(TypeError):
    """A user function used the DSL in a way it does not support."""


# While a FlexAttention-style function is traced (engine.flex), the tensors it captures from
# its scope become custom inputs: this holds the object that turns them into custom reads.
TENSOR_CAPTURE: contextvars.ContextVar[Any] = contextvars.ContextVar("tensor_capture",
                                                                     default=None)


_TORCH_FUNCTIONS: Any = None


def set_torch_functions(handler: Any) -> None:
    """Give expressions the meaning of torch functions (`handler(func, args, kwargs)`)."""
    global _TORCH_FUNCTIONS
    _TORCH_FUNCTIONS = handler


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dim")


def _axes(*groups: Iterable[str]) -> tuple[str, ...]:
    present = set()
    for g in groups:
        present.update(g)
    return tuple(a for a in AXIS_ORDER if a in present)


def _result_dtype(op: str, args: tuple[Expr, ...]) -> str:
    if op in COMPARE_OPS or op in LOGIC_OPS or op == "not":
        return "bool"
    if op == "where":
        kinds = {a.dtype for a in args[1:]}
        return "float" if "float" in kinds else ("int" if "int" in kinds else "bool")
    kinds = {a.dtype for a in args}
    if op in ("add", "sub", "mul", "max", "min", "neg", "abs", "floordiv", "mod") \
            and kinds <= {"int"}:
        return "int"
    return "float"


class Expr:
    """One node of the expression DAG. Immutable; structurally keyed by `key`."""

    __slots__ = ("op", "args", "attr", "axes", "dtype", "key", "_hash")

    def __init__(
        self,
        op: str,
        args: tuple[Expr, ...] = (),
        attr: Any = None,
        axes: tuple[str, ...] | None = None,
        dtype: str | None = None,
    ):
        self.op = op
        self.args = args
        self.attr = attr
        self.axes = axes if axes is not None else _axes(*(a.axes for a in args))
        self.dtype = dtype if dtype is not None else _result_dtype(op, args)
        self.key = (op, attr, tuple(a.key for a in args))
        self._hash = hash(self.key)

    # ----------------------------------------------------------------- construction
    @staticmethod
    def wrap(x: Any) -> Expr:
        if isinstance(x, Expr):
            return x
        if isinstance(x, bool):
            return Expr("const", attr=bool(x), axes=(), dtype="bool")
        if isinstance(x, int):
            return Expr("const", attr=int(x), axes=(), dtype="int")
        if isinstance(x, float):
            return Expr("const", attr=float(x), axes=(), dtype="float")
        capture = TENSOR_CAPTURE.get()
        if capture is not None and _is_tensor(x):
            return capture.whole(x)
        raise DSLError(
            f"cannot use a {type(x).__name__} in an attention expression; expected a DSL "
            "expression or a Python number (tensors enter through CustomIO)"
        )

    def _bin(self, op: str, other: Any, swap: bool = False) -> Expr:
        o = Expr.wrap(other)
        a, b = (o, self) if swap else (self, o)
        if op in ("and", "or") and not (a.dtype == "bool" and b.dtype == "bool"):
            raise DSLError(f"'{'&' if op == 'and' else '|'}' needs boolean operands (comparisons)")
        if op not in ("and", "or") and "bool" in (a.dtype, b.dtype) and op not in COMPARE_OPS:
            raise DSLError(f"arithmetic '{op}' on a boolean; use where(cond, a, b) instead")
        return Expr(op, (a, b))

    def _un(self, op: str) -> Expr:
        if op == "not":
            if self.dtype != "bool":
                raise DSLError("'~' needs a boolean operand (a comparison)")
        elif op == "toint":
            return self if self.dtype == "int" else Expr(op, (self,), dtype="int")
        elif op in ROUNDING_OPS and self.dtype == "int":
            return self
        elif self.dtype == "bool":
            raise DSLError(f"'{op}' on a boolean; use where(cond, a, b) instead")
        return Expr(op, (self,))

    __add__ = lambda s, o: s._bin("add", o)  # noqa: E731
    __radd__ = lambda s, o: s._bin("add", o, True)  # noqa: E731
    __sub__ = lambda s, o: s._bin("sub", o)  # noqa: E731
    __rsub__ = lambda s, o: s._bin("sub", o, True)  # noqa: E731
    __mul__ = lambda s, o: s._bin("mul", o)  # noqa: E731
    __rmul__ = lambda s, o: s._bin("mul", o, True)  # noqa: E731
    __truediv__ = lambda s, o: s._bin("div", o)  # noqa: E731
    __rtruediv__ = lambda s, o: s._bin("div", o, True)  # noqa: E731
    __floordiv__ = lambda s, o: s._by_constant("floordiv", "//", o)  # noqa: E731
    __mod__ = lambda s, o: s._by_constant("mod", "%", o)  # noqa: E731
    __rfloordiv__ = lambda s, o: s._by_constant("floordiv", "//", s, swap=True)  # noqa: E731
    __rmod__ = lambda s, o: s._by_constant("mod", "%", s, swap=True)  # noqa: E731
    __ge__ = lambda s, o: s._bin("ge", o)  # noqa: E731
    __gt__ = lambda s, o: s._bin("gt", o)  # noqa: E731
    __le__ = lambda s, o: s._bin("le", o)  # noqa: E731
    __lt__ = lambda s, o: s._bin("lt", o)  # noqa: E731
    __and__ = lambda s, o: s._bin("and", o)  # noqa: E731
    __rand__ = lambda s, o: s._bin("and", o, True)  # noqa: E731
    __or__ = lambda s, o: s._bin("or", o)  # noqa: E731
    __ror__ = lambda s, o: s._bin("or", o, True)  # noqa: E731

    def __eq__(self, other: Any) -> Expr:  # type: ignore[override]
        return self._bin("eq", other)

    def __ne__(self, other: Any) -> Expr:  # type: ignore[override]
        return self._bin("ne", other)

    def __hash__(self) -> int:
        return self._hash

    def _by_constant(self, op: str, sign: str, divisor: Any, swap: bool = False) -> Expr:
        """`x // c` and `x % c` (floor semantics, as Python and torch): c a nonzero constant."""
        d = divisor.attr if isinstance(divisor, Expr) and divisor.op == "const" else divisor
        if swap or isinstance(d, bool) or not isinstance(d, (int, float)) or d == 0:
            raise DSLError(f"'{sign}' takes a nonzero constant divisor (a Python number), "
                           f"as in q_idx {sign} 64")
        if self.dtype == "bool":
            raise DSLError(f"arithmetic '{sign}' on a boolean; use where(cond, a, b) instead")
        return Expr(op, (self, Expr.wrap(d)))

    def __neg__(self) -> Expr:
        return self._un("neg")

    def __invert__(self) -> Expr:
        return self._un("not")

    def __abs__(self) -> Expr:
        return self._un("abs")

    def __pow__(self, exponent: Any) -> Expr:
        return self.pow(exponent)

    def __rpow__(self, base: Any) -> Expr:
        # c ** x == exp(x * ln c): keeps `pow` limited to constant exponents.
        if not isinstance(base, (int, float)) or base <= 0:
            raise DSLError("x ** y with a symbolic exponent needs a positive constant base")
        return (self * math.log(base)).exp()

    def __floor__(self) -> Expr:
        return self._un("floor")

    def __ceil__(self) -> Expr:
        return self._un("ceil")

    def __round__(self, ndigits: Any = None) -> Expr:
        if ndigits is not None:
            raise DSLError("round(x, ndigits) is not supported; round(x) rounds to an integer")
        return self._un("round")

    def __bool__(self) -> bool:
        raise DSLError(
            "a symbolic expression has no truth value while tracing: use & | ~ instead of "
            "and/or/not, and where(cond, a, b) instead of if/else"
        )

    def __float__(self) -> float:
        raise DSLError("a symbolic expression cannot be converted to a Python float")

    def __getitem__(self, index: Any) -> Expr:
        if self.op != "custom":
            raise DSLError("only CustomIO tensors can be indexed")
        return self.attr_index(index)

    def __iter__(self):
        raise DSLError("a symbolic expression cannot be iterated")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.tanh(x), torch.where(...), tensor[b, h] and the like: engine.dsl.torch_funcs
        # (registered when the engine package is imported)
        if _TORCH_FUNCTIONS is None:
            raise DSLError(f"torch function {func} on a symbolic expression")
        return _TORCH_FUNCTIONS(func, args, kwargs or {})

    # ----------------------------------------------------------------- methods of the DSL
    def exp(self) -> Expr:
        return self._un("exp")

    def exp2(self) -> Expr:
        return self._un("exp2")

    def log(self) -> Expr:
        return self._un("log")

    def log2(self) -> Expr:
        return self._un("log2")

    def tanh(self) -> Expr:
        return self._un("tanh")

    def sigmoid(self) -> Expr:
        return self._un("sigmoid")

    def sin(self) -> Expr:
        return self._un("sin")

    def cos(self) -> Expr:
        return self._un("cos")

    def tan(self) -> Expr:
        return self._un("tan")

    def sqrt(self) -> Expr:
        return self._un("sqrt")

    def rsqrt(self) -> Expr:
        return self._un("rsqrt")

    def log1p(self) -> Expr:
        return self._un("log1p")

    def expm1(self) -> Expr:
        return self._un("expm1")

    def erf(self) -> Expr:
        return self._un("erf")

    def floor(self) -> Expr:
        return self._un("floor")

    def ceil(self) -> Expr:
        return self._un("ceil")

    def round(self) -> Expr:
        """To the nearest integer, halves to even (torch.round), as a float."""
        return self._un("round")

    def long(self) -> Expr:
        """An integer (truncated towards zero, as torch's .long()), for index arithmetic."""
        return self._un("toint")

    int = long

    def float(self) -> Expr:
        """A float (an integer, or a boolean as 0/1); floats are left as they are."""
        if self.dtype == "bool":
            return where(self, 1.0, 0.0)
        return self if self.dtype == "float" else self * 1.0

    def softplus(self) -> Expr:
        """log(1 + exp(x)), in the form that neither overflows nor loses small values."""
        return self.max(0.0) + (-self.abs()).exp().log1p()

    def square(self) -> Expr:
        return self.pow(2)

    def abs(self) -> Expr:
        return self._un("abs")

    def max(self, other: Any) -> Expr:
        return self._bin("max", other)

    def min(self, other: Any) -> Expr:
        return self._bin("min", other)

    def pow(self, exponent: Any) -> Expr:
        if isinstance(exponent, Expr):
            if exponent.op == "const":
                exponent = exponent.attr
            else:
                raise DSLError("pow takes a constant exponent (a Python number)")
        if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
            raise DSLError("pow takes a constant exponent (a Python number)")
        if self.dtype == "bool":
            raise DSLError("pow on a boolean")
        return Expr("pow", (self,), attr=float(exponent))

    def get_reduce(self, kind: str) -> Expr:
        if kind not in REDUCE_KINDS:
            raise DSLError(f"get_reduce({kind!r}): expected one of {REDUCE_KINDS}")
        if "n" not in self.axes:
            raise DSLError("get_reduce needs a score tile (something that varies along keys)")
        return Expr(
            "reduce",
            (self,),
            attr=kind,
            axes=tuple(a for a in self.axes if a != "n"),
            dtype="float",
        )

    # ----------------------------------------------------------------- custom inputs
    def attr_index(self, index: Any) -> Expr:
        """The custom input read at `index`: b, h, q_idx, kv_idx or 0 per dim (a plain read,
        staged by the kernels), or integer expressions of them (a table lookup, `gather`)."""
        name, dims, _ = self.attr
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) != len(dims):
            raise DSLError(
                f"CustomIO '{name}' has {len(dims)} dims {dims}; indexed with {len(idx)}"
            )
        entries = [Expr.wrap(i) for i in idx]
        if all(e.op == "idx" or (e.op == "const" and e.dtype == "int" and e.attr == 0)
               for e in entries):
            return custom_leaf(name, dims, tuple(e.attr if e.op == "idx" else 0 for e in entries))
        for dim, e in zip(dims, entries, strict=True):
            if e.dtype != "int":
                raise DSLError(
                    f"CustomIO '{name}' dim {dim!r}: index with an integer expression of b, h, "
                    f"q_idx, kv_idx (got a {e.dtype} value; round a float with .long())"
                )
        return Expr("gather", tuple(entries), attr=(name, tuple(dims)), dtype="float")

    def __repr__(self) -> str:
        return f"Expr({to_text(self)})"


# --------------------------------------------------------------------------- leaves
def const(value: float | int | bool) -> Expr:
    return Expr.wrap(value)


def leaf(op: str, axes: tuple[str, ...], attr: Any = None, dtype: str = "float") -> Expr:
    return Expr(op, (), attr=attr, axes=axes, dtype=dtype)


def index_leaf(name: str) -> Expr:
    return Expr("idx", (), attr=name, axes=_INDEX_AXES[name], dtype="int")


_DEFAULT_INDEX = {"batch": "b", "heads": "h", "seq_len": "q", "seq_len_kv": "kv"}


def custom_leaf(name: str, dims: tuple, index: tuple | None = None) -> Expr:
    """A read of CustomIO tensor `name` (declared `dims`) at `index` (one entry per dim:
    one of "b", "h", "q", "kv" or 0)."""
    if index is None:
        index = tuple(_DEFAULT_INDEX.get(d, 0) if isinstance(d, str) else 0 for d in dims)
    axes = _axes(*(_INDEX_AXES[i] for i in index if isinstance(i, str)))
    return Expr("custom", (), attr=(name, tuple(dims), tuple(index)), axes=axes, dtype="float")


def where(cond: Any, a: Any, b: Any) -> Expr:
    """Select `a` where `cond` holds, else `b` (elementwise)."""
    c, x, y = Expr.wrap(cond), Expr.wrap(a), Expr.wrap(b)
    if c.dtype != "bool":
        raise DSLError("where(cond, a, b): cond must be boolean (a comparison)")
    return Expr("where", (c, x, y))


def _fn(name: str):
    def f(x: Any) -> Expr:
        return getattr(Expr.wrap(x), name)()

    f.__name__ = name
    f.__doc__ = f"Elementwise {name} of a DSL expression."
    return f


exp, exp2, log, log2, tanh, sigmoid = (
    _fn(n) for n in ("exp", "exp2", "log", "log2", "tanh", "sigmoid")
)
sin, cos, tan, sqrt, rsqrt, log1p, expm1, erf = (
    _fn(n) for n in ("sin", "cos", "tan", "sqrt", "rsqrt", "log1p", "expm1", "erf")
)
floor, ceil, softplus, square = (_fn(n) for n in ("floor", "ceil", "softplus", "square"))
round_ = _fn("round")
round_.__name__ = "round"


def maximum(a: Any, b: Any) -> Expr:
    return Expr.wrap(a).max(b)


def minimum(a: Any, b: Any) -> Expr:
    return Expr.wrap(a).min(b)


# --------------------------------------------------------------------------- traversal
def topo(roots: Iterable[Expr]) -> list[Expr]:
    """Unique nodes reachable from `roots`, children before parents (structural dedup)."""
    seen: dict[tuple, Expr] = {}
    order: list[Expr] = []
    stack: list[tuple[Expr, bool]] = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, done = stack.pop()
        if node.key in seen and not done:
            continue
        if done:
            if node.key not in seen:
                seen[node.key] = node
                order.append(node)
            continue
        stack.append((node, True))
        for a in reversed(node.args):
            if a.key not in seen:
                stack.append((a, False))
    return order


# Nodes that read a CustomIO tensor: a plain read and a table lookup (attr[0]: the name).
CUSTOM_READS = ("custom", "gather")


def custom_names(roots: Iterable[Expr]) -> set[str]:
    """The CustomIO names the expressions read (plain reads and table lookups)."""
    return {n.attr[0] for n in topo(roots) if n.op in CUSTOM_READS}


def leaves(roots: Iterable[Expr]) -> list[Expr]:
    return [n for n in topo(roots) if not n.args]


def to_text(root: Expr) -> str:
    """A canonical, readable rendering (used in errors and hashes)."""
    if root.op == "const":
        return repr(root.attr)
    if root.op == "idx":
        return {"q": "q_idx", "kv": "kv_idx"}.get(root.attr, root.attr)
    if root.op == "custom":
        name, _, index = root.attr
        return f"{name}[{', '.join(str(i) for i in index)}]"
    if root.op == "gather":
        return f"{root.attr[0]}[{', '.join(to_text(a) for a in root.args)}]"
    if root.op in ("rowscale", "final"):
        return f"{root.op}.{root.attr}"
    if not root.args:
        return root.op
    inner = ", ".join(to_text(a) for a in root.args)
    if root.op == "reduce":
        return f"reduce_{root.attr}({inner})"
    if root.op == "pow":
        return f"pow({inner}, {root.attr!r})"
    return f"{root.op}({inner})"


def _missing_attr(self: Expr, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise DSLError(
        f"the DSL has no operation '{name}'; available: + - * / unary -, // and % by a "
        "constant, exp, exp2, log, log2, log1p, expm1, tanh, sigmoid, softplus, sin, cos, tan, "
        "sqrt, rsqrt, square, erf, abs, floor, ceil, round, long/int, max, min, "
        "pow (constant exponent), where(cond, a, b), comparisons with & | ~, "
        "get_reduce('max'|'sum'|'abssum'|'min')"
    )


Expr.__getattr__ = _missing_attr  # type: ignore[attr-defined]
