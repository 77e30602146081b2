"""A request's tuned kernel config: its tune-file entry for (kind, spec, dtype, mode, GPU,
shape), the nearest tuned shape when the exact one is missing (see tune_file.lookup)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.dtypes import short_dtype_name
from engine.problem import Problem
from engine.tuning import tune_file

log = logging.getLogger("engine")

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
                 shape: Mapping[str, int] | None = None,
                 default_at: Callable[[Mapping[str, int]], Any] | None = None) -> Any:
    """The request's tuned config of `kind` as the engine runs it (for_shape), or None; with
    `default_at` (the kind's default at an entry's shape, as the tuner records it), None too
    where the entry is stale (`is_current`)."""
    hit = tuned_entry(req, kind, shape=shape)
    if hit is None:
        return None
    if default_at is not None and not is_current(hit[1], default_at(hit[1]["shape"])):
        return None
    return for_shape(hit[0], bool(hit[1].get("exact")))


_told: set[tuple[str, str]] = set()


def is_current(meta: Mapping[str, Any], default: Any) -> bool:
    """Whether a tune entry still holds: it records the engine's default when it was tuned
    (`engine_default`; older entries: `default_config`, the baseline it was confirmed
    against), and a winner measured against a default the engine no longer runs says
    nothing about the current one (results/NOTES.md 115-117: entries of 2026-11-22 kept the
    causal forward on the automatic pipeline after the warp-specialised default came).
    Entries without that record hold, as do those whose tuner knew no spec (`engine_default`
    None). A stale one is announced once per entry."""
    recorded = meta["engine_default"] if "engine_default" in meta else meta.get("default_config")
    if recorded is None:
        return True
    try:
        current = type(default).from_dict(dict(recorded)) == default
    except (TypeError, ValueError):
        current = False
    key = (str(meta.get("study", "")), str(meta.get("shape", "")))
    if not current and key not in _told:
        _told.add(key)
        log.warning("tune entry of %s at %s was confirmed against the default %s; the "
                    "engine's default is now %s, which runs instead (re-tune with "
                    "`attnbench tune` to compare them)", meta.get("study", "?"),
                    shape_text(meta.get("shape")), recorded, default.key())
    return current


def shape_text(shape: Any) -> str:
    return tune_file.shape_tag(shape) if isinstance(shape, Mapping) else str(shape)
