"""Block tables of a mask on the device, cached: an index-only mask's classified once on the
host; a mask that reads tensors (document ids) classified on the device from its data, per
tensor identity and version (an in-place change of the data bumps `_version` and rebuilds
them), with no copy from the host and no read back, so no sync.

On a GPU a data mask's classification is one function compiled by TorchInductor
(engine.runtime.fused: a few fused kernels, where running engine.mask.analysis op by op
launched about 60 small ones), compiled on its first call. A CUDA graph replays its kernels
without the Python that looks tables up, so inside a capture (torch.cuda.graph, torch.compile's
mode="reduce-overhead") nothing is looked up: the graph records the classification itself,
and each replay builds the tables from the data it reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, Protocol

import torch

from engine.dsl.expr import Expr
from engine.logs import log_once
from engine.mask.analysis import BlockClasses, classify, reads_data
from engine.plan.shape import KernelShape
from engine.runtime.fused import fuse, signature
from engine.runtime.persistent import capturing, kept

# Bounded: a stream of fresh id tensors must not grow memory.
MAX_DATA_ENTRIES = 8
CPU = torch.device("cpu")

Tables = tuple[torch.Tensor, ...]


class ExtraTable(Protocol):
    """A table of its own shape built from the layout's tables by name (the persistent
    walk's): once on the host for an index-only mask, with torch ops where the tables are
    (no read back) for a data mask."""

    def on_host(self, tables: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def on_device(self, tables: dict[str, torch.Tensor]) -> torch.Tensor: ...


@dataclass
class MaskTables:
    """`layout` turns the classification into the kernel's tables (e.g. loop bounds and the
    class table), the kernel's parameters `names` (the extra table's last); each is expanded
    to the shape's leading (mask_batch, mask_heads) dims."""

    mask: Expr | None
    shape: KernelShape
    block_M: int
    block_N: int
    layout: Callable[[BlockClasses], Tables]
    names: tuple[str, ...]
    stride: int = 1  # a folded kernel's (row i of residue r is position i * stride + r)
    extra: ExtraTable | None = None
    _cache: dict[Any, Tables] = field(default_factory=dict)
    # a data mask's tables on a GPU, compiled per signature of its tensors
    _fused: dict[tuple, Callable[[dict[str, torch.Tensor]], Tables]] = field(
        default_factory=dict)

    @cached_property
    def data_dependent(self) -> bool:
        # once: walking the mask's expression per call was a third of the forward's host time
        return reads_data(self.mask)

    def get(self, customs: dict[str, torch.Tensor], device: torch.device) -> Tables:
        if not self.data_dependent:
            if device not in self._cache:  # the device as key: its text per call cost host time
                self._cache[device] = kept(lambda: self._host_tables(device), device)
            return self._cache[device]
        if capturing(device):
            return self._device_tables(customs, device)  # recorded: not kept
        key = (device, *((n, t.data_ptr(), t._version, tuple(t.shape))
                         for n, t in sorted(customs.items())))
        if key not in self._cache:
            if len(self._cache) >= MAX_DATA_ENTRIES:
                self._cache.clear()
            self._cache[key] = kept(lambda: self._device_tables(customs, device), device)
        return self._cache[key]

    def named(self, customs: dict[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
        """The tables by the names of the kernel parameters they bind to."""
        return dict(zip(self.names, self.get(customs, device), strict=True))

    def _host_tables(self, device: torch.device) -> Tables:
        """An index-only mask's tables, classified on the host."""
        layout = self._layout({}, CPU)
        extra = [self.extra.on_host(self._by_name(layout))] if self.extra else []
        # a blocking copy: the tables are on the device before the caller's kernels read them
        return tuple(t.to(device) for t in (*layout, *extra))

    def _device_tables(self, customs: dict[str, torch.Tensor], device: torch.device) -> Tables:
        """A data mask's tables, classified on `device` from its tensors; on a GPU by the
        function compiled on the first call outside a capture (its first run loads its
        kernels, which a capture may not). Op by op for a dynamic-shape module: its lengths
        change from call to call, and a compile per length (1-3 s) would stall the caller."""
        if device.type != "cuda" or self.shape.dynamic:
            return self._classified(customs, device)
        key = signature(customs)
        if key not in self._fused:
            if capturing(device):  # no call came before the capture: op by op
                return self._classified(customs, device)
            self._fused[key] = self._fuse(customs, device)
        return self._fused[key](customs)

    def _fuse(self, customs: dict[str, torch.Tensor], device: torch.device
              ) -> Callable[[dict[str, torch.Tensor]], Tables]:
        """The classification compiled, or op by op where the compiler fails on it (the same
        tables, more kernels)."""
        op_by_op = partial(self._classified, device=device)
        try:
            return fuse(op_by_op, customs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the tables stay right
            log_once(f"a data mask's block classification did not compile, so it runs op by op "
                     f"(more kernels a call): {type(exc).__name__}: {str(exc)[:200]}")
            return op_by_op

    def _classified(self, customs: dict[str, torch.Tensor], device: torch.device) -> Tables:
        layout = self._layout(customs, device)
        return (*layout, *([self.extra.on_device(self._by_name(layout))] if self.extra else []))

    def _layout(self, customs: dict[str, torch.Tensor], device: torch.device) -> Tables:
        """The layout's tables, classified on `device`, each expanded to the shape's leading
        (mask_batch, mask_heads) dims."""
        s = self.shape
        bc = classify(self.mask, s.batch, s.heads_q, s.seqlen_q, s.seqlen_kv, self.block_M,
                      self.block_N, customs if self.data_dependent else None, self.stride,
                      device=device)
        return tuple(t.expand(s.mask_batch, s.mask_heads, *t.shape[2:]).contiguous()
                     for t in self.layout(bc))

    def _by_name(self, layout: Tables) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, layout, strict=False))


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
