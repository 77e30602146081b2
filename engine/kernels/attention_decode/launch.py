"""Build and launch the decode kernels: the split kernel, and the merge kernel when the keys
are split. The splits' workspace is allocated once per kernel set and device and reused, so a
call allocates only its output (a decode step can be captured in a CUDA graph and replayed
with new cache lengths). Calls that share a kernel set must therefore not run concurrently on
different streams."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.ir.merge import TracedMerge
from engine.ir.spec import TracedSpec
from engine.kernels.attention_decode.codegen import generate_split
from engine.kernels.attention_decode.merge import generate_merge
from engine.kernels.attention_decode.plan import (
    DecodeConfig,
    DecodePlan,
    DecodeShape,
    plan_decode,
)
from engine.plan.config import H100_SMS
from engine.runtime.kernel import Kernel
from engine.runtime.persistent import kept


@dataclass
class DecodeKernels:
    shape: DecodeShape
    config: DecodeConfig
    plan: DecodePlan
    split: Kernel
    merge: Kernel | None
    online_names: tuple[str, ...]
    workspace: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)

    def sources(self) -> list[str]:
        return [self.split.source] + ([self.merge.source] if self.merge is not None else [])

    def compile(self) -> None:
        self.split.compiled()
        if self.merge is not None:
            self.merge.compiled()

    def buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The splits' outputs and row scales on `device` (allocated on first use)."""
        if self.merge is None:
            return {}
        if device not in self.workspace:
            self.workspace[device] = kept(lambda: self._allocate(device), device)
        return self.workspace[device]

    def _allocate(self, device: torch.device) -> dict[str, torch.Tensor]:
        s, n = self.shape, self.plan.splits
        lead = (n, s.batch, s.heads_kv, s.rows)
        ws = {"Wo": torch.empty(*lead, s.head_dim_v, dtype=torch.float32, device=device)}
        ws.update({f"W_{name}": torch.empty(lead, dtype=torch.float32, device=device)
                   for name in self.online_names})
        return ws


def build_decode(spec: TracedSpec, shape: DecodeShape, cfg: DecodeConfig,
                 merge: TracedMerge | None = None, sm_count: int = H100_SMS) -> DecodeKernels:
    """The decode kernels of `spec` at `shape` and `cfg`, generated (not compiled)."""
    plan = plan_decode(spec, shape, cfg, merge, sm_count)
    split = Kernel(generate_split(spec, shape, plan))
    merge_k = Kernel(generate_merge(spec, shape, plan)) if plan.merge is not None else None
    return DecodeKernels(shape, cfg, plan, split, merge_k, tuple(spec.online_names))


def launch_decode(dk: DecodeKernels, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, custom: dict[str, torch.Tensor],
                  cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """o [B, Sq, Hq, Dv] of the decode kernels (inputs checked by the caller). The kernels
    launch with positional tensors picked by name (a decode step is host-bound at short
    caches: binding keyword arguments cost a few us a launch)."""
    s = dk.shape
    o = torch.empty(s.batch, s.seqlen_q, s.heads_q, s.head_dim_v, dtype=q.dtype, device=q.device)
    named = {"Q": q, "K": k_cache, "V": v_cache, "Lens": cache_seqlens, "BT": block_table,
             "O": o}
    for n, t in custom.items():
        named[f"C_{n}"] = t.detach().float().contiguous()
    named.update(dk.buffers(q.device))  # the splits' workspace ({} without a merge)
    dk.split.launch(*dk.split.pick(named))
    if dk.merge is not None:
        dk.merge.launch(*dk.merge.pick(named))
    return o
