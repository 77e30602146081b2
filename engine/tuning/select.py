"""A request's tuned kernel config: its tune-file entry for (kind, spec, dtype, mode, GPU,
shape), the nearest tuned shape when the exact one is missing (see tune_file.lookup)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.dtypes import short_dtype_name
from engine.plan.config import KernelConfig
from engine.problem import Problem
from engine.tuning import tune_file

if TYPE_CHECKING:
    from engine.kernels.registry import KernelKind
    from engine.plan.request import KernelRequest


def gpu_name() -> str:
    """What tune files call this machine's GPU ("none" without one)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def problem_shape(problem: Problem) -> dict[str, int]:
    """A problem's sizes as tune files key them."""
    return problem.sizes()


def dtype_tag(dtype: torch.dtype) -> str:
    return short_dtype_name(dtype)


def tuned_entry(req: KernelRequest, kind: KernelKind, gpu: str | None = None
                ) -> tuple[KernelConfig, dict] | None:
    """(config, entry metadata with `exact`) from the request's tune file, or None."""
    return tune_file.lookup(req.options.tune_file, template=kind.name, spec_hash=req.spec.hash,
                            dtype=dtype_tag(req.dtype), mode=kind.mode, gpu=gpu or gpu_name(),
                            shape=problem_shape(req.problem))


def tuned_config(req: KernelRequest, kind: KernelKind) -> KernelConfig | None:
    hit = tuned_entry(req, kind)
    return hit[0] if hit is not None else None
