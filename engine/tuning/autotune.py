"""`AttentionEngine(tune=True)`: tune the forward kernel of a module whose shape has no exact
tune-file entry, on the first call, with the inputs of that call.

The engine does not tune by itself: a tuner does, found through the entry point group
`attnbench.engine_tuner` (the attnbench harness registers its Optuna study there) or given
with `register_tuner`. A tuner writes its best config to the request's tune file; the module
then loads the new entry like any other. With no tuner installed, `tune=True` says so in one
line and uses the tune file or the defaults.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol

import torch

from engine.kernels.registry import ATTENTION_FWD, KernelKind
from engine.plan.request import KernelRequest
from engine.runtime.kernel_cache import recorded_forward_default
from engine.tuning import tune_file
from engine.tuning.select import is_current, problem_shape, tuned_entry

log = logging.getLogger("engine")

ENTRY_POINT_GROUP = "attnbench.engine_tuner"


@dataclass(frozen=True)
class TuneBudget:
    """How much one `tune=True` study may spend (the issue's target: 5 minutes per shape)."""

    trials: int = 40
    timeout_s: float = 300.0

    @classmethod
    def from_env(cls) -> TuneBudget:
        """The default budget, or ATTNBENCH_TUNE_TRIALS / ATTNBENCH_TUNE_SECONDS where set."""
        return cls(trials=_env_number("ATTNBENCH_TUNE_TRIALS", cls.trials, int),
                   timeout_s=_env_number("ATTNBENCH_TUNE_SECONDS", cls.timeout_s, float))


def _env_number(name: str, default, kind):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value != value:
        raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}")
    return value


DEFAULT_BUDGET = TuneBudget()


@dataclass(frozen=True)
class TuneRequest:
    """What tune=True asks a tuner for: the best config of `kind` for `kernels` (spec,
    problem, dtype, options: its tune_file is where the result goes) on `gpu`, timed on
    `inputs` (q, k, v and the CustomIO tensors by name, as the user passed them)."""

    kernels: KernelRequest
    kind: KernelKind
    gpu: str
    inputs: dict[str, torch.Tensor]
    budget: TuneBudget = DEFAULT_BUDGET
    progress: bool = True


class Tuner(Protocol):
    def tune(self, request: TuneRequest) -> dict | None:
        """Tune and write the tune file; returns a summary (None: nothing was written).
        Failures are the tuner's to report; they must not raise into the user's call."""


_registered: Tuner | None = None


def register_tuner(tuner: Tuner | None) -> None:
    """Use `tuner` for tune=True in this process (None: back to the entry points)."""
    global _registered
    _registered = tuner


def find_tuner() -> Tuner | None:
    """The registered tuner, else the first entry point of ENTRY_POINT_GROUP (a factory
    called with no arguments), else None."""
    if _registered is not None:
        return _registered
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            return ep.load()()
        except Exception as exc:  # a broken tuner must not take down the user's call
            warnings.warn(f"tune=True: the tuner {ep.value!r} failed to load ({exc})",
                          stacklevel=2)
    return None


def has_exact_entry(req: KernelRequest, gpu: str) -> bool:
    """Whether the tune file holds this shape's forward, and it is current (a stale entry is
    tuned again)."""
    hit = tuned_entry(req, ATTENTION_FWD, gpu)
    return hit is not None and bool(hit[1].get("exact")) and is_current(
        hit[1], recorded_forward_default(req)(hit[1]["shape"]))


def ensure_tuned(
    req: KernelRequest,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    customs: list[torch.Tensor],
    *,
    gpu: str | None = None,
    budget: TuneBudget | None = None,
    tuner: Tuner | None = None,
    progress: bool = True,
) -> Any:
    """Tune the request's forward unless its tune file has an exact entry; returns the
    tuner's summary, or None when nothing was tuned. `tuner` defaults to find_tuner();
    `gpu` to the name of q's GPU; `budget` to TuneBudget.from_env()."""
    budget = budget or TuneBudget.from_env()
    gpu = gpu or torch.cuda.get_device_name(q.device)
    if has_exact_entry(req, gpu):
        return None
    tuner = tuner or find_tuner()
    if tuner is None:
        warnings.warn(f"tune=True: no tuner is installed (the attnbench harness registers one "
                      f"under the entry point group {ENTRY_POINT_GROUP!r}); using the tune file "
                      "or the defaults", stacklevel=3)
        return None
    log.warning("engine: tune=True: tuning spec %s at %s (at most %d trials or %.0f s)",
                req.spec.hash, tune_file.shape_tag(problem_shape(req.problem)), budget.trials,
                budget.timeout_s)
    inputs = {"q": q, "k": k, "v": v, **dict(zip(req.spec.custom_names, customs, strict=True))}
    result = tuner.tune(TuneRequest(req, ATTENTION_FWD, gpu, inputs, budget, progress))
    if result is not None:
        log.warning("engine: tune=True: %s", result.get("tune_file_note") or "done")
    return result
