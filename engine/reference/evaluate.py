"""Evaluate IR expressions with torch ops (any device, any float dtype).

Layout: score tiles are [B, H, M, N], row values [B, H, M, 1], the output tile [B, H, M, Dv];
index leaves are aranges shaped to broadcast (b: [B,1,1,1], h: [1,H,1,1], q: [1,1,M,1],
kv: [1,1,1,N]). Everything here is differentiable by torch autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.dsl.expr import MATH_OPS, ROUNDING_OPS, Expr, to_text, topo

_NEUTRAL = {"max": float("-inf"), "min": float("inf"), "sum": 0.0, "abssum": 0.0}


@dataclass
class Env:
    """Values of the leaves for one evaluation."""

    dtype: torch.dtype
    device: torch.device
    leaves: dict[str, torch.Tensor] = field(default_factory=dict)  # score, o, dp, p, doosum, tensor
    rowscale: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    index: dict[str, torch.Tensor] = field(default_factory=dict)  # b, h, q, kv
    customs: dict[str, torch.Tensor] = field(default_factory=dict)
    mask: torch.Tensor | None = None  # bool tile: masked entries are neutral in reductions
    # Where custom reads index a dim other than at the position (decode: the q position is
    # absolute in the cache, a "seq_len" custom holds one entry per new token).
    custom_at: dict[str, torch.Tensor] = field(default_factory=dict)
    # Index leaves that are whole aranges from 0 along one axis of the layout: (that axis, its
    # length), and the layout's rank. A custom read at them is a strided view of the tensor
    # (custom_view), not a gather.
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    rank: int = 4


def index_tensors(
    B: int, H: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    return {
        "b": torch.arange(B, device=device).view(B, 1, 1, 1),
        "h": torch.arange(H, device=device).view(1, H, 1, 1),
        "q": q_idx.to(device).view(1, 1, -1, 1) if q_idx.dim() == 1 else q_idx.to(device),
        "kv": kv_idx.to(device).view(1, 1, 1, -1),
    }


def custom_index(index: tuple, env: Env, device: torch.device) -> list[torch.Tensor]:
    """Index tensors of a custom read at the symbolic `index` (entries "b", "h", "q", "kv" or
    0), broadcasting over [b, h, q, kv]."""
    return [env.custom_at.get(i, env.index[i]) if isinstance(i, str)
            else torch.zeros((), dtype=torch.long, device=device) for i in index]


def custom_value(t: torch.Tensor, index: tuple, env: Env) -> torch.Tensor:
    """Read custom tensor `t` at the symbolic `index` (entries "b", "h", "q", "kv" or 0)."""
    view = custom_view(t, index, env)
    if view is not None:
        return view
    return _as_tile(t[tuple(custom_index(index, env, t.device))])


def custom_view(t: torch.Tensor, index: tuple, env: Env) -> torch.Tensor | None:
    """The read of custom_value as a view of `t` where every named entry is a whole arange
    (Env.ranges), each at most once and within t's extent; else None. The same values as the
    gather, without one: no index kernel, and its gradient is a sum rather than a scatter
    (a 0-dim index tensor also costs CUDA indexing a host synchronisation)."""
    names = [i for i in index if isinstance(i, str)]
    if (len(set(names)) < len(names) or len(index) != t.dim()
            or any(n not in env.ranges or n in env.custom_at for n in names)):
        return None
    y = t
    for dim in reversed(range(len(index))):  # entries 0 select the first element
        if not isinstance(index[dim], str):
            y = y.select(dim, 0)
    axes = [env.ranges[n][0] for n in names]
    lengths = [env.ranges[n][1] for n in names]
    if any(y.shape[d] < n for d, n in enumerate(lengths)):
        return None  # the gather raises its IndexError
    for d, n in enumerate(lengths):
        if y.shape[d] > n:
            y = y.narrow(d, 0, n)
    order = sorted(range(len(names)), key=lambda d: axes[d])
    shape = [1] * env.rank
    for d in order:
        shape[axes[d]] = lengths[d]
    if order != list(range(len(order))):
        y = y.permute(order)
    return y.reshape(shape)


def _as_tile(val: torch.Tensor) -> torch.Tensor:
    while val.dim() < 4:
        val = val.unsqueeze(0)
    return val


def gather_index(node: Expr, index: list[torch.Tensor], env: Env) -> list[torch.Tensor]:
    """The index tensors of table lookup `node` (its evaluated args), checked against the
    custom tensor's extents: an index outside it is an IndexError naming the input."""
    name = node.attr[0]
    t = env.customs[name]
    out = []
    for dim, (i, n) in enumerate(zip(index, t.shape, strict=True)):
        i = i.to(device=t.device, dtype=torch.long)
        lo, hi = int(i.min()), int(i.max())
        if lo < 0 or hi >= n:
            raise IndexError(f"custom input {name!r}: index {to_text(node.args[dim])} takes "
                             f"values {lo}..{hi}, outside dim {dim} of size {n}")
        out.append(i)
    return out


def read_index(node: Expr, env: Env) -> list[torch.Tensor]:
    """Index tensors of a custom read or a table lookup (broadcasting over [b, h, q, kv])."""
    if node.op == "gather":
        return gather_index(node, evaluate(list(node.args), env), env)
    return custom_index(node.attr[2], env, env.customs[node.attr[0]].device)


# Topological orders by the roots' identities (with the roots, so that an id is not reused
# while its entry lives): a module's mods are evaluated on every call.
_ORDERS: dict[tuple[int, ...], tuple[list[Expr], list[Expr]]] = {}


def _order(roots: list[Expr]) -> list[Expr]:
    key = tuple(map(id, roots))
    hit = _ORDERS.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], roots, strict=True)):
        if len(_ORDERS) >= 4096:
            _ORDERS.clear()
        hit = _ORDERS[key] = (list(roots), topo(roots))
    return hit[1]


def evaluate(roots: list[Expr], env: Env) -> list[torch.Tensor]:
    vals: dict[tuple, torch.Tensor] = {}
    for node in _order(roots):
        vals[node.key] = _eval_node(node, [vals[a.key] for a in node.args], env)
    return [vals[r.key] for r in roots]


def _const(node: Expr, env: Env) -> torch.Tensor:
    # torch.full, not torch.tensor: on a GPU the latter copies from the host, which waits
    # for every kernel queued before it (the key gate's fwd+bwd: 3.17 against 2.12 ms).
    dt = {"bool": torch.bool, "int": torch.int64}.get(node.dtype, env.dtype)
    return torch.full((), node.attr, dtype=dt, device=env.device)


# Elementwise functions of a float tensor, by DSL op: torch's of the same name (round halves
# to even, as the kernels' nearbyint).
_TORCH_MATH = {op: getattr(torch, op) for op in (*MATH_OPS, *ROUNDING_OPS)}


def _eval_node(node: Expr, a: list[torch.Tensor], env: Env) -> torch.Tensor:
    op = node.op
    if op == "const":
        return _const(node, env)
    if op == "idx":
        return env.index[node.attr]
    if op == "custom":
        name, _, index = node.attr
        return custom_value(env.customs[name], index, env).to(env.dtype)
    if op == "gather":
        t = env.customs[node.attr[0]]
        return _as_tile(t[tuple(gather_index(node, a, env))]).to(env.dtype)
    if op == "rowscale":
        return env.rowscale[node.attr]
    if op == "final":
        return env.final[node.attr]
    if op in ("score", "o", "dp", "p", "doosum", "tensor"):
        return env.leaves[op]
    f = lambda t: t.to(env.dtype) if not t.is_floating_point() else t  # noqa: E731
    if op == "neg":
        return -a[0]
    if op in _TORCH_MATH:
        return _TORCH_MATH[op](f(a[0]))
    if op == "toint":
        return a[0].to(torch.int64)  # truncation towards zero, as torch's .long()
    if op == "floordiv":
        return torch.div(a[0], a[1], rounding_mode="floor")
    if op == "mod":
        return torch.remainder(a[0], a[1])  # floor semantics: the sign of the divisor
    if op == "abs":
        return torch.abs(a[0])
    if op == "not":
        return ~a[0]
    if op == "pow":
        return torch.pow(f(a[0]), node.attr)
    if op in ("add", "sub", "mul", "div"):
        x, y = _scalar_operands(node, a)
        if op == "add":
            return x + y
        if op == "sub":
            return x - y
        return x * y if op == "mul" else (f(x) if isinstance(x, torch.Tensor) else x) / y
    if op == "max":
        x, y = torch.broadcast_tensors(*_promote(a))
        return torch.maximum(x, y)
    if op == "min":
        x, y = torch.broadcast_tensors(*_promote(a))
        return torch.minimum(x, y)
    if op in ("ge", "gt", "le", "lt", "eq", "ne"):
        return getattr(torch, op)(*_promote(a))
    if op == "and":
        return a[0] & a[1]
    if op == "or":
        return a[0] | a[1]
    if op == "where":
        x, y = _promote(a[1:])
        return torch.where(a[0], x, y)
    if op == "reduce":
        x = a[0]
        if env.mask is not None:
            x = torch.where(
                env.mask, x, torch.full((), _NEUTRAL[node.attr], dtype=x.dtype, device=x.device)
            )
        if node.attr == "max":
            return x.amax(dim=-1, keepdim=True)
        if node.attr == "min":
            return x.amin(dim=-1, keepdim=True)
        if node.attr == "sum":
            return x.sum(dim=-1, keepdim=True)
        return x.abs().sum(dim=-1, keepdim=True)
    raise ValueError(f"evaluate: unknown op {op!r}")  # pragma: no cover


def _scalar_operands(node: Expr, a: list[torch.Tensor]) -> list:
    """The two operands of an arithmetic node, a constant one as a Python number when the other
    is not a constant. Same values and dtypes (a Python scalar, like a 0-dim tensor, does not
    promote the other operand), but TensorIterator runs its vectorised kernel for a scalar,
    while a 0-dim CUDA tensor takes the non-vectorised broadcast path: a bf16 q scale in a mod
    pre-pass ran at about 1.1 TB/s on the H200 (results/NOTES.md 66)."""
    const = [n.op == "const" and type(n.attr) in (int, float) for n in node.args]
    # only beside a float tensor: with an integer one a Python float would give torch's
    # default dtype where the constant's tensor gives the environment's (float64, say)
    if const[0] == const[1] or not a[const.index(False)].is_floating_point():
        return a
    return [n.attr if c else t for n, c, t in zip(node.args, const, a, strict=True)]


def _promote(ts) -> list[torch.Tensor]:
    ts = list(ts)
    if any(t.is_floating_point() for t in ts):
        dt = next(t.dtype for t in ts if t.is_floating_point())
        ts = [t if t.is_floating_point() else t.to(dt) for t in ts]
    return ts
