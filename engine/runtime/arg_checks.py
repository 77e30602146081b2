"""Argument checks both front ends share (AttentionEngine, LinearAttentionEngine): the meta
tensors' common rules, one runtime tensor's type, dtype, device and stride, and the binding
of CustomIO tensors given positionally or by name. Each error names the argument."""

from __future__ import annotations

from typing import Any

import torch

from engine.dsl.io import CustomIO

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_meta_tensors(qkv_meta: Any, order: str) -> torch.dtype:
    """The common dtype of the three meta tensors (q, k, v), each 4-d in `order` (e.g.
    "B, H, S, D"); ValueError naming qkv_meta otherwise."""
    if not isinstance(qkv_meta, (tuple, list)) or len(qkv_meta) != 3:
        raise ValueError(
            f"qkv_meta: expected a tuple of 3 meta tensors (q, k, v) made with meta_tensor({order})"
        )
    for name, t in zip("qkv", qkv_meta, strict=True):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"qkv_meta[{name}]: expected a 4-d tensor ({order}) from meta_tensor, got {t!r:.80}"
            )
    qm, km, vm = qkv_meta
    if len({qm.dtype, km.dtype, vm.dtype}) != 1:
        raise ValueError(f"qkv_meta: q, k, v dtypes differ: {qm.dtype}, {km.dtype}, {vm.dtype}")
    if qm.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"qkv_meta: dtype {qm.dtype} not supported; expected one of {SUPPORTED_DTYPES}"
        )
    return qm.dtype


def expect_tensor(name: str, t: Any, what: str = "") -> torch.Tensor:
    """`t` if it is a tensor; TypeError naming `name` (prefixed by `what`) otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_placement(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device
                    ) -> None:
    """q, k or v: the module's dtype, the device of q, a unit last-dim stride (the kernels
    load rows of D contiguous elements)."""
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype}; expected {dtype} (from qkv_meta)")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}; expected {device} (the device of q)")
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: last-dim stride {t.stride(-1)}; expected 1 (call .contiguous())"
        )


def bind_customs(custom_io: CustomIO, args: tuple, kwargs: dict, sizes: dict[str, int],
                 device: torch.device) -> list[torch.Tensor]:
    """The CustomIO tensors, given positionally (declaration order) or by name, in declaration
    order, each checked against its declared dims at `sizes` (the named dims' sizes)."""
    names = custom_io.names()
    if len(args) > len(names):
        raise TypeError(
            f"got {len(args)} positional custom inputs; declared: {names or 'none'}"
        )
    given = dict(zip(names, args, strict=False))
    for key, val in kwargs.items():
        if key not in names:
            raise TypeError(
                f"unexpected input {key!r}; declared CustomIO inputs: {names or 'none'}"
            )
        if key in given:
            raise TypeError(f"custom input {key!r} given twice")
        given[key] = val
    out = []
    for n in names:
        if n not in given:
            raise TypeError(f"missing custom input {n!r} (declared dims {custom_io.decls[n]})")
        t = expect_tensor(repr(n), given[n], "custom input ")
        want = custom_io.expected_shape(n, sizes)
        if tuple(t.shape) != want:
            raise ValueError(
                f"custom input {n!r}: shape {tuple(t.shape)}; expected {want} "
                f"(dims {custom_io.decls[n]})"
            )
        if t.device != device:
            raise ValueError(f"custom input {n!r}: on {t.device}; expected {device}")
        out.append(t)
    return out
