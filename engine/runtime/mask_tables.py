"""Block tables of a mask on the device, cached: computed once for index-only masks, and per
tensor identity and version for masks that read tensors (an in-place change of the data bumps
`_version` and recomputes them).

A CUDA graph replays its kernels without the Python that looks the tables up, so a mask that
reads tensors, captured (torch.cuda.graph, torch.compile's mode="reduce-overhead") with the
tables of the data it was recorded with, would skip or trust the wrong blocks once the data
changes. Captured, such a mask is classified inside the graph instead (engine.mask.analysis
runs on the device with no host copy or read back): each replay builds the tables from the
data it reads. The persistent walk's deal of tiles to blocks is made on the host; in a graph
it is the deal for any data (the mask's tensors unknown), made before the capture: any deal
covers every tile, so only the balance differs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from engine.dsl.expr import Expr
from engine.mask.analysis import BlockClasses, classify, reads_data
from engine.plan.shape import KernelShape
from engine.runtime.fused import fuse, signature
from engine.runtime.persistent import capturing, kept

# Bounded: a stream of fresh id tensors must not grow memory.
MAX_DATA_ENTRIES = 8


@dataclass
class MaskTables:
    """`layout` turns the classification into the kernel's tables (e.g. loop bounds and the
    class table), the kernel's parameters `names`; each is expanded to the shape's leading
    (mask_batch, mask_heads) dims."""

    mask: Expr | None
    shape: KernelShape
    block_M: int
    block_N: int
    layout: Callable[[BlockClasses], tuple[torch.Tensor, ...]]
    names: tuple[str, ...]
    stride: int = 1  # a folded kernel's (row i of residue r is position i * stride + r)
    # a table of its own shape after the expanded ones (the persistent walk's), named last,
    # built from the layout's tables by name
    extra: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    _cache: dict[Any, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # per device: the persistent walk's deal for any data, what a capture binds
    _any_data_walk: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    # a data mask's classification on a GPU, compiled per signature of its tensors
    _fused: dict[tuple, Callable] = field(default_factory=dict)

    @cached_property
    def data_dependent(self) -> bool:
        # once: walking the mask's expression per call was a third of the forward's host time
        return reads_data(self.mask)

    def get(self, customs: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
        key: Any = device  # hashable; its text per call cost host time
        if self.data_dependent:
            self._prepare_capture(customs, device)
            if capturing(device):
                return self._build(customs, device, in_graph=True)  # not kept: per replay
            key = (device, *((n, t.data_ptr(), t._version, tuple(t.shape))
                             for n, t in sorted(customs.items())))
        if key in self._cache:
            return self._cache[key]
        out = kept(lambda: self._build(customs, device), device)
        if self.data_dependent and len(self._cache) >= MAX_DATA_ENTRIES:
            self._cache.clear()
        self._cache[key] = out
        return out

    def _prepare_capture(self, customs: dict[str, torch.Tensor], device: torch.device) -> None:
        """What a capture of a data mask binds or calls, made on a call before it (a capture's
        first call would copy from the host or compile: a warm-up makes it)."""
        if self.extra is not None and device not in self._any_data_walk:
            # ({}: the mask's tensors unknown; the walk is the last table)
            self._any_data_walk[device] = kept(lambda: self._build({}, device)[-1], device)
        if device.type == "cuda" and not capturing(device) \
                and (key := signature(customs)) not in self._fused:
            fused = kept(lambda: fuse(lambda cs: self._layout(cs, device), customs), device)
            kept(lambda: fused(customs), device)  # loads its kernels: a capture may not
            self._fused[key] = fused

    def _build(self, customs: dict[str, torch.Tensor], device: torch.device,
               in_graph: bool = False) -> tuple[torch.Tensor, ...]:
        """The tables, classified on the host, or (`in_graph`) on `device` inside a capture."""
        layout = self._fused_layout(customs, device) if in_graph \
            else self._layout(customs, torch.device("cpu"))
        tables = list(layout)
        if self.extra is not None:
            tables.append(self._any_data_walk[device] if in_graph
                          else self.extra(dict(zip(self.names, layout, strict=False))))
        # a blocking copy: the tables are on the device before the caller's kernels read them
        return tuple(t.to(device) for t in tables)

    def _fused_layout(self, customs: dict[str, torch.Tensor], device: torch.device
                      ) -> tuple[torch.Tensor, ...]:
        """_layout on `device`, on a GPU by one compiled function (a few fused kernels: each
        small kernel is a node a graph replays), compiled by _prepare_capture."""
        if device.type != "cuda":
            return self._layout(customs, device)
        fused = self._fused.get(signature(customs))
        # op by op where no call came before the capture
        return fused(customs) if fused else self._layout(customs, device)

    def _layout(self, customs: dict[str, torch.Tensor], device: torch.device
                ) -> tuple[torch.Tensor, ...]:
        """The layout's tables (all but the walk), classified on `device`, each expanded to
        the shape's leading (mask_batch, mask_heads) dims."""
        s = self.shape
        bc = classify(self.mask, s.batch, s.heads_q, s.seqlen_q, s.seqlen_kv, self.block_M,
                      self.block_N, customs if self.data_dependent else None, self.stride,
                      device=device)
        return tuple(t.expand(s.mask_batch, s.mask_heads, *t.shape[2:]).contiguous()
                     for t in self.layout(bc))

    def named(self, customs: dict[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
        """The tables by the names of the kernel parameters they bind to."""
        return dict(zip(self.names, self.get(customs, device), strict=True))


FORWARD_TABLES = ("Lo", "Hi", "Cls")


def forward_layout(bc: BlockClasses) -> tuple[torch.Tensor, ...]:
    """Per query block: first and one-past-last non-empty key block, and the class table
    (kernel parameters FORWARD_TABLES)."""
    lo, hi = bc.loop_bounds()
    return lo, hi, bc.classes


# The warp-specialised forward's tables: also each query block's longest run of full key
# blocks [Fs, Fe), walked first by a loop without the per-block class branch.
WS_FORWARD_TABLES = (*FORWARD_TABLES, "Fs", "Fe")


def ws_forward_layout(bc: BlockClasses) -> tuple[torch.Tensor, ...]:
    """forward_layout's tables and the full runs (kernel parameters WS_FORWARD_TABLES)."""
    lo, hi = bc.loop_bounds()
    return lo, hi, bc.classes, *bc.full_run(lo)
