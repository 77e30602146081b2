"""Apply traced q/k/v mods (engine.ir.tensor_mods) to runtime [B, S, H, D] tensors.

A pre-pass of torch ops: each modded tensor is read and written once more before the attention
runs, and the kernels then load it as any q, k or v (the mods are not fused into their tile
loads). Autograd differentiates these ops (q, k, v and CustomIO tensors that require grad) on
every backend, and torch.compile traces them as ordinary ops.
"""

from __future__ import annotations

import torch

from engine.ir.tensor_mods import TENSOR_LEAF, QKVMods, TensorMod
from engine.reference.evaluate import Env, evaluate


class _LayoutIndex(dict):
    """Index tensors b, the position and h broadcasting over the runtime layout [B, S, H, D],
    each built when first read (most mods read none: their custom reads are views)."""

    def __init__(self, ranges: dict[str, tuple[int, int]], device: torch.device) -> None:
        super().__init__()
        self.ranges, self.device = ranges, device

    def __missing__(self, name: str) -> torch.Tensor:
        axis, n = self.ranges[name]
        shape = [1, 1, 1, 1]
        shape[axis] = n
        t = self[name] = torch.arange(n, device=self.device).view(shape)
        return t


def _layout_ranges(B: int, S: int, H: int, pos: str) -> dict[str, tuple[int, int]]:
    """Each index of the layout [B, S, H, D]: (its axis, its length)."""
    return {"b": (0, B), pos: (1, S), "h": (2, H)}


def _layout_index(B: int, S: int, H: int, pos: str, device: torch.device) -> _LayoutIndex:
    """Index tensors b, `pos`, h broadcasting over the runtime layout [B, S, H, D]. Custom
    reads index with these as they are, so they broadcast over the same layout."""
    return _LayoutIndex(_layout_ranges(B, S, H, pos), device)


def apply_tensor_mod(mod: TensorMod, x: torch.Tensor, customs: dict[str, torch.Tensor],
                     upcast: bool = True) -> torch.Tensor:
    """`mod` of `x` [B, S, H, D] (S indexed by mod.pos, H the heads of x), computed in float32
    (float64 stays float64), in x's dtype and shape; `customs` the CustomIO tensors by name.
    upcast=False reads x as it is: each torch op still computes in float32 and rounds once,
    and a mod of one op (a scale) costs one read and one write of x instead of five passes."""
    B, S, H, _ = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    index = _layout_index(B, S, H, mod.pos, x.device)
    env = Env(dtype=dtype, device=x.device, leaves={TENSOR_LEAF: x.to(dtype) if upcast else x},
              index=index, customs=customs, ranges=index.ranges)
    (y,) = evaluate([mod.expr], env)
    y = y.to(x.dtype)
    # a result constant along some dims (e.g. a mod that ignores x) is broadcast; the kernels
    # need a unit last-dim stride, which an expanded view lacks
    return y if y.shape == x.shape else y.expand(x.shape).contiguous()


def apply_qkv_mods(mods: QKVMods, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   customs: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v through their mods (a tensor without one is returned as it is)."""
    q, k, v = (x if m is None else apply_tensor_mod(m, x, customs)
               for m, x in ((mods.query, q), (mods.key, k), (mods.value, v)))
    return q, k, v
