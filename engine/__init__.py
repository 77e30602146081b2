"""The attention engine: trace a variant written in Python, generate TileLang kernels for
Hopper, and run them behind torch autograd (see README.md and the seed API)."""

from engine.api import AttentionEngine
from engine.dsl.expr import (
    DSLError,
    Expr,
    ceil,
    cos,
    erf,
    exp,
    exp2,
    expm1,
    floor,
    log,
    log1p,
    log2,
    maximum,
    minimum,
    rsqrt,
    sigmoid,
    sin,
    softplus,
    sqrt,
    square,
    tan,
    tanh,
    where,
)
from engine.dsl.expr import round_ as round  # the DSL's round (halves to even)
from engine.dsl.io import CustomIO, meta_tensor
from engine.dsl.online import (
    OnlineFunc,
    OnlineIdentity,
    OnlineRetention,
    OnlineSoftmax,
    SymbolScalar,
    Var,
)
from engine.flex import flex_attention
from engine.ir.trace import TraceError
from engine.linear_api import LinearAttentionEngine
from engine.mask.block_mask import BlockMask, create_block_mask
from engine.plan.config import ConfigError, KernelConfig
from engine.runtime.tilelang_backend import kernel_backward_enabled

__all__ = [
    "AttentionEngine",
    "BlockMask",
    "ConfigError",
    "CustomIO",
    "DSLError",
    "Expr",
    "KernelConfig",
    "LinearAttentionEngine",
    "OnlineFunc",
    "OnlineIdentity",
    "OnlineRetention",
    "OnlineSoftmax",
    "SymbolScalar",
    "TraceError",
    "Var",
    "ceil",
    "cos",
    "create_block_mask",
    "erf",
    "exp",
    "exp2",
    "expm1",
    "flex_attention",
    "floor",
    "kernel_backward_enabled",
    "log",
    "log1p",
    "log2",
    "maximum",
    "meta_tensor",
    "minimum",
    "round",
    "rsqrt",
    "sigmoid",
    "sin",
    "softplus",
    "sqrt",
    "square",
    "tan",
    "tanh",
    "where",
]
