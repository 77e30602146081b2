"""The row normaliser API of the seeds: `OnlineFunc`, `SymbolScalar`, `Var`, and the
predefined normalisers (softmax, retention, identity)."""

from __future__ import annotations

import math
from typing import Any

from engine.dsl.expr import DSLError, Expr, where


class Var:
    """An initial value of a row scale: a number or one of the strings "-inf", "inf", "0.0"."""

    def __init__(self, value: str | float | int):
        if isinstance(value, str):
            try:
                value_f = float(value)
            except ValueError as exc:
                raise DSLError(f"Var({value!r}): expected a number or '-inf'/'inf'") from exc
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value_f = float(value)
        else:
            raise DSLError(f"Var({value!r}): expected a number or '-inf'/'inf'")
        if math.isnan(value_f):
            raise DSLError("Var: NaN is not a valid initial value")
        self.value = value_f

    def __repr__(self) -> str:
        return f"Var({self.value!r})"


class SymbolScalar:
    """A named per-row scalar (an online or final row scale) with its initial value."""

    def __init__(self, name: str, init: Var | float | int | str = 0.0):
        if not isinstance(name, str) or not name.isidentifier():
            raise DSLError(f"SymbolScalar name {name!r}: expected an identifier")
        self.name = name
        self.init = init if isinstance(init, Var) else Var(init)

    def __repr__(self) -> str:
        return f"SymbolScalar({self.name!r}, {self.init!r})"


def _check_rowscales(arg: str, scales: Any) -> dict[str, SymbolScalar]:
    if not isinstance(scales, dict):
        raise DSLError(
            f"OnlineFunc: {arg} must be a dict name -> SymbolScalar, got {type(scales).__name__}"
        )
    out = {}
    for key, val in scales.items():
        if not isinstance(val, SymbolScalar):
            raise DSLError(
                f"OnlineFunc: {arg}[{key!r}] must be a SymbolScalar, got {type(val).__name__}"
            )
        if val.name != key:
            raise DSLError(
                f"OnlineFunc: {arg}[{key!r}] holds SymbolScalar named {val.name!r}; names must match keys"
            )
        out[key] = val
    return out


class OnlineFunc:
    """Base class of a row-online normaliser (see the seeds): subclasses define

    - `online_fwd(scores, online_rowscales, b, h, q_idx) -> (scores, new_online_rowscales, o_scale)`
    - `online_fwd_epilogue(o, online_rowscales, b, h, q_idx) -> (o, final_rowscales)`
    - `forward(scores, final_rowscales, b, h, q_idx, kv_idx) -> p` (recomputation in backward)
    - `backward(dp, p, final_rowscales, doosum, b, h, q_idx, kv_idx) -> dscores`

    and, for decode's split-KV (several thread blocks share one row's keys and their partial
    results merge), optionally one of:

    - `combine_online(online_rowscales) -> (o_scale, merged_online_rowscales)`: each row scale
      holds one value per split (get_reduce reduces over the splits); the splits' unnormalised
      outputs are weighted by o_scale and summed, then `online_fwd_epilogue` runs once on the
      merged row scales (the predefined normalisers define this one);
    - `combine(final_rowscales) -> o_scale` (AttentionEngine's inference scripts): each split's
      output after the epilogue is weighted by o_scale and summed.

    Without either, decode runs one split per (batch, kv head) unless online_fwd and the
    epilogue trace to a predefined normaliser's, whose merge then applies.

    Hooks are called positionally; parameter names do not matter.
    """

    def __init__(
        self, online_rowscales: dict, final_rowscales: dict, external_fwd_inputs: Any = None
    ):
        self.online_rowscales = _check_rowscales("online_rowscales", online_rowscales)
        self.final_rowscales = _check_rowscales("final_rowscales", final_rowscales)
        self.external_fwd_inputs = external_fwd_inputs

    @staticmethod
    def online_fwd(scores, online_rowscales, b, h, q_idx):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def online_fwd_epilogue(o, online_rowscales, b, h, q_idx):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def forward(scores, final_rowscales, b, h, q_idx, kv_idx):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):  # pragma: no cover
        raise NotImplementedError


class OnlineSoftmax(OnlineFunc):
    """Softmax: running max m and running sum r; final row scale lse = log r + m."""

    def __init__(self):
        super().__init__(
            {"m": SymbolScalar("m", Var("-inf")), "r": SymbolScalar("r", Var("0.0"))},
            {"lse": SymbolScalar("lse", Var("0.0"))},
        )

    @staticmethod
    def online_fwd(scores, online_rowscales, b, h, q_idx):
        m, r = online_rowscales["m"], online_rowscales["r"]
        m_new = m.max(scores.get_reduce("max"))
        scale = (m - m_new).exp()
        p = (scores - m_new).exp()
        return p, {"m": m_new, "r": r * scale + p.get_reduce("sum")}, scale

    @staticmethod
    def online_fwd_epilogue(o, online_rowscales, b, h, q_idx):
        r, m = online_rowscales["r"], online_rowscales["m"]
        return o / r, {"lse": r.log() + m}

    @staticmethod
    def combine_online(online_rowscales):
        m, r = online_rowscales["m"], online_rowscales["r"]
        m_all = m.get_reduce("max")
        scale = (m - m_all).exp()
        return scale, {"m": m_all, "r": (r * scale).get_reduce("sum")}

    @staticmethod
    def forward(scores, final_rowscales, b, h, q_idx, kv_idx):
        return (scores - final_rowscales["lse"]).exp()

    @staticmethod
    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):
        return (dp - doosum) * scores


class OnlineRetention(OnlineFunc):
    """RetNet's normaliser: o = (P V) / max(sum_j |s_ij|, 1); final row scale r."""

    def __init__(self):
        super().__init__(
            {"r": SymbolScalar("r", Var("0.0"))},
            {"r": SymbolScalar("r", Var("1.0"))},
        )

    @staticmethod
    def online_fwd(scores, online_rowscales, b, h, q_idx):
        return scores, {"r": online_rowscales["r"] + scores.get_reduce("abssum")}, 1.0

    @staticmethod
    def online_fwd_epilogue(o, online_rowscales, b, h, q_idx):
        r = online_rowscales["r"].max(1.0)
        return o / r, {"r": r}

    @staticmethod
    def combine_online(online_rowscales):
        return 1.0, {"r": online_rowscales["r"].get_reduce("sum")}

    @staticmethod
    def forward(scores, final_rowscales, b, h, q_idx, kv_idx):
        return scores / final_rowscales["r"]

    @staticmethod
    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):
        # p = s / r with r = max(sum |s|, 1): ds = (dp - [r > 1] * sign(s) * rowsum(dp*p)) / r,
        # and rowsum(dp * p) = rowsum(dO * O) = doosum.
        r = final_rowscales["r"]
        sign = where(scores > 0, 1.0, where(scores < 0, -1.0, 0.0))
        return (dp - where(r > 1.0, doosum * sign, 0.0)) / r


class OnlineIdentity(OnlineFunc):
    """No normalisation: p = scores (sigmoid and ReLU attention put their function in score_mod)."""

    def __init__(self):
        super().__init__({}, {})

    @staticmethod
    def online_fwd(scores, online_rowscales, b, h, q_idx):
        return scores, {}, 1.0

    @staticmethod
    def online_fwd_epilogue(o, online_rowscales, b, h, q_idx):
        return o, {}

    @staticmethod
    def combine_online(online_rowscales):
        return 1.0, {}

    @staticmethod
    def forward(scores, final_rowscales, b, h, q_idx, kv_idx):
        return scores

    @staticmethod
    def backward(dp, scores, final_rowscales, doosum, b, h, q_idx, kv_idx):
        return dp


def check_online_func(obj: Any) -> OnlineFunc:
    if not isinstance(obj, OnlineFunc):
        raise DSLError(
            f"online_func must be an OnlineFunc instance (e.g. OnlineSoftmax()), got {type(obj).__name__}"
        )
    for name in ("online_fwd", "online_fwd_epilogue", "forward", "backward"):
        if getattr(type(obj), name) is getattr(OnlineFunc, name):
            raise DSLError(f"online_func {type(obj).__name__} does not define {name}()")
    return obj


__all__ = [
    "Expr",
    "OnlineFunc",
    "OnlineIdentity",
    "OnlineRetention",
    "OnlineSoftmax",
    "SymbolScalar",
    "Var",
    "check_online_func",
]
