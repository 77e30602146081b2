"""A module's tuned kernel config: its tune-file entry for (kind, spec, dtype, mode, GPU,
shape), the nearest tuned shape when the exact one is missing (see tune_file.lookup)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.plan.config import KernelConfig
from engine.plan.shape import KERNEL_DTYPES
from engine.tuning import tune_file

if TYPE_CHECKING:
    from engine.kernels.registry import KernelKind


def gpu_name() -> str:
    """What tune files call this machine's GPU ("none" without one)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def problem_shape(mod) -> dict[str, int]:
    p = mod.problem
    return dict(batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, seqlen_q=p.seqlen_q,
                seqlen_kv=p.seqlen_kv, head_dim=p.head_dim, head_dim_v=p.head_dim_v)


def dtype_tag(mod) -> str:
    return tune_file.normalize_dtype(KERNEL_DTYPES.get(mod.dtype, str(mod.dtype)))


def tuned_entry(mod, kind: KernelKind, gpu: str | None = None
                ) -> tuple[KernelConfig, dict] | None:
    """(config, entry metadata with `exact`) from the module's tune file, or None."""
    return tune_file.lookup(mod.tune_file, template=kind.name, spec_hash=mod.spec_hash,
                            dtype=dtype_tag(mod), mode=kind.mode, gpu=gpu or gpu_name(),
                            shape=problem_shape(mod))


def tuned_config(mod, kind: KernelKind) -> KernelConfig | None:
    hit = tuned_entry(mod, kind)
    return hit[0] if hit is not None else None
