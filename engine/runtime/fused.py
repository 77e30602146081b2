"""A function of named tensors traced once and compiled by TorchInductor: the few fused
kernels of its graph in place of the many small ones that running it op by op launches.

Used where such a function runs on every call inside a CUDA graph (a data mask's block
classification): there each small kernel is a graph node paid on every replay. Compiled from
the traced graph directly (torch._inductor.compile), not through torch.compile's frame
evaluation, so there are no guards to fail and recompile later, possibly inside a capture."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

Tensors = tuple[torch.Tensor, ...]


def fuse(fn: Callable[[dict[str, torch.Tensor]], Tensors], example: dict[str, torch.Tensor]
         ) -> Callable[[dict[str, torch.Tensor]], Tensors]:
    """fn compiled for tensors of the example's shapes, dtypes, strides and device (the
    caller keys what it keeps by them); fn must not branch on tensor values."""
    names = sorted(example)

    def positional(*tensors: torch.Tensor) -> Tensors:
        return tuple(fn(dict(zip(names, tensors, strict=True))))

    inputs = [example[n].detach() for n in names]
    compiled = torch._inductor.compile(make_fx(positional)(*inputs), inputs)

    def call(tensors: dict[str, torch.Tensor]) -> Tensors:
        return tuple(compiled(*[tensors[n].detach() for n in names]))

    return call


def signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """What a function compiled by `fuse` was specialised to (its cache key)."""
    return tuple((n, t.device, t.dtype, tuple(t.shape), t.stride())
                 for n, t in sorted(tensors.items()))


def untraced():
    """A context where tensors are made outside any trace `fuse` runs: the compiled function
    reads them as constants."""
    return disable_proxy_modes_tracing()
