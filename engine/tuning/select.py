"""A request's tuned kernel config: its tune-file entry for (kind, spec, dtype, mode, GPU,
shape), the nearest tuned shape when the exact one is missing (see tune_file.lookup)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.dtypes import short_dtype_name
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


def decode_shape(sizes: Mapping[str, int], page_size: int) -> dict[str, int]:
    """A decode problem's sizes as tune files key them: the seven sizes (seqlen_q: the new
    tokens, seqlen_kv: the cache's capacity) and the page size (0: a contiguous cache)."""
    return {**{k: sizes[k] for k in tune_file.SHAPE_KEYS}, "page_size": int(page_size)}


# Config fields that size a kernel's grid for the tuned shape rather than its tiles: an entry
# of another shape (the nearest tuned one) leaves them to the plan (0: chosen from the shape).
# Decode's split count: 16 splits measured 2.74 TB/s at B 64, 4k where one split ran 3.00
# (engine/kernels/attention_decode/plan.py), so a count tuned at B 1, 128k must not carry over.
GRID_FIELDS = ("num_splits",)


def for_shape(cfg: Any, exact: bool) -> Any:
    """`cfg` of a tune-file entry as the engine runs it: as tuned for its own shape, with its
    GRID_FIELDS set to 0 (auto) for another shape."""
    grid = [f.name for f in dataclasses.fields(cfg) if f.name in GRID_FIELDS]
    return cfg if exact or not grid else dataclasses.replace(cfg, **dict.fromkeys(grid, 0))


def tuned_entry(req: KernelRequest, kind: KernelKind, gpu: str | None = None,
                shape: Mapping[str, int] | None = None) -> tuple[Any, dict] | None:
    """(config, entry metadata with `exact`) from the request's tune file, or None. `shape`:
    the sizes the entry is keyed by (default: the request's problem; decode: decode_shape)."""
    return tune_file.lookup(req.options.tune_file, template=kind.name, spec_hash=req.spec.hash,
                            dtype=dtype_tag(req.dtype), mode=kind.mode, gpu=gpu or gpu_name(),
                            shape=dict(shape or problem_shape(req.problem)),
                            config_type=kind.config_type)


def tuned_config(req: KernelRequest, kind: KernelKind,
                 shape: Mapping[str, int] | None = None) -> Any:
    """The request's tuned config of `kind` as the engine runs it (for_shape), or None."""
    hit = tuned_entry(req, kind, shape=shape)
    return for_shape(hit[0], bool(hit[1].get("exact"))) if hit is not None else None
