"""The attention engine: trace a variant written in Python, generate TileLang kernels for
Hopper, and run them behind torch autograd (see README.md and the seed API)."""

from __future__ import annotations

import importlib
from typing import Any

# Registered on `import engine`, as before: torch functions on symbolic expressions (a
# score_mod written with torch.clamp, say) and the custom ops (a graph saved with them, an
# exported program, loads in a process that imported the package).
import engine.dsl.torch_funcs  # noqa: F401
import engine.runtime.ops  # noqa: F401

# Each public name and where it lives, imported on first use: a process that needs one
# submodule (a tuner's spawned worker) then skips the rest (torch._dynamo by way of the flex
# front door, TileLang by way of the runtime): the tuner's objective imports in 2.7 s, not 4.8.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "engine.api": ("AttentionEngine",),
    "engine.dsl.expr": (
        "DSLError", "Expr", "ceil", "cos", "erf", "exp", "exp2", "expm1", "floor", "log", "log1p",
        "log2", "maximum", "minimum", "rsqrt", "sigmoid", "sin", "softplus", "sqrt", "square",
        "tan", "tanh", "where",
    ),
    "engine.dsl.io": ("CustomIO", "meta_tensor"),
    "engine.dsl.online": (
        "OnlineFunc", "OnlineIdentity", "OnlineRetention", "OnlineSoftmax", "SymbolScalar", "Var",
    ),
    "engine.flex": ("flex_attention",),
    "engine.ir.trace": ("TraceError",),
    "engine.linear_api": ("LinearAttentionEngine",),
    "engine.mask.block_mask": ("BlockMask", "create_block_mask"),
    "engine.plan.config": ("ConfigError", "KernelConfig"),
    "engine.runtime.tilelang_backend": ("kernel_backward_enabled",),
}
_PUBLIC: dict[str, tuple[str, str]] = {
    **{name: (module, name) for module, names in _EXPORTS.items() for name in names},
    "round": ("engine.dsl.expr", "round_"),  # the DSL's round (halves to even)
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
