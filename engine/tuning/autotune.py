"""`AttentionEngine(tune=True)`: tune the forward kernel of a module whose shape has no exact
tune-file entry, on the first call, with the inputs of that call.

It runs the same study as `attnbench tune` (attnbench.tune: Optuna, worker processes, the
tune-file rule that never writes a config slower than the default) with a trial and time
budget, then the module loads the new entry like any other. The engine never needs attnbench
otherwise: without it, `tune=True` warns once and uses the tune file or the defaults.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from engine.dsl.io import CustomIO
from engine.kernels.registry import ATTENTION_FWD
from engine.plan.request import KernelRequest
from engine.tuning import tune_file
from engine.tuning.select import dtype_tag, problem_shape, tuned_entry

log = logging.getLogger("engine")


@dataclass(frozen=True)
class TuneBudget:
    """How much one `tune=True` study may spend (the issue's target: 5 minutes per shape)."""

    trials: int = 40
    timeout_s: float = 300.0


DEFAULT_BUDGET = TuneBudget()


def has_exact_entry(req: KernelRequest, gpu: str) -> bool:
    hit = tuned_entry(req, ATTENTION_FWD, gpu)
    return hit is not None and bool(hit[1].get("exact"))


def ensure_tuned(
    req: KernelRequest,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    customs: list[torch.Tensor],
    *,
    gpu: str | None = None,
    budget: TuneBudget = DEFAULT_BUDGET,
    make_objective: Any = None,
    progress: bool = True,
) -> Any:
    """Tune the request's forward unless its tune file has an exact entry; returns the study's
    TuneResult as a dict, or None when nothing was tuned. `make_objective(problem, inputs_path)` replaces
    the real objective (tests use attnbench's fake one); `gpu` the detected GPU name."""
    gpu = gpu or torch.cuda.get_device_name(q.device)
    if has_exact_entry(req, gpu):
        return None
    try:
        from attnbench.tune.problem import Problem
        from attnbench.tune.runner import TuneOptions
        from attnbench.tune.spec_objective import SpecObjective
    except ImportError as exc:
        warnings.warn(
            f"tune=True needs the attnbench package ({exc}); using the tune file or defaults",
            stacklevel=3,
        )
        return None
    problem = Problem(variant="custom", dtype=dtype_tag(req.dtype), mode="fwd",
                      **problem_shape(req.problem))
    names = list(req.spec.custom_names)
    log.warning("engine: tune=True: tuning spec %s at %s (at most %d trials or %.0f s)",
                req.spec.hash, tune_file.shape_tag(problem.shape()), budget.trials,
                budget.timeout_s)
    with tempfile.TemporaryDirectory(prefix="attnbench-tune-") as tmp:
        inputs_path = os.path.join(tmp, "inputs.pt")
        tensors = {"q": q, "k": k, "v": v, **dict(zip(names, customs, strict=True))}
        torch.save({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, inputs_path)
        if make_objective is not None:
            objective = make_objective(problem, inputs_path)
        else:
            objective = SpecObjective(problem, req.spec, CustomIO(dict(req.spec.customs)),
                                      inputs_path)
        opts = TuneOptions(
            trials=budget.trials, timeout_s=budget.timeout_s, devices=(_device_index(q),),
            tune_file=req.options.tune_file, progress=progress,
        )
        job, out = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.json")
        with open(job, "wb") as fh:
            pickle.dump({"objective": objective, "options": opts}, fh)
        # A child process, not this one: see attnbench.tune.spec_job.
        done = subprocess.run([sys.executable, "-m", "attnbench.tune.spec_job", job, out],
                              check=False)
        if done.returncode != 0 or not os.path.exists(out):
            warnings.warn(
                f"tune=True: the tuning process failed (exit code {done.returncode}; its "
                "output is above); using the tune file or defaults",
                stacklevel=3,
            )
            return None
        with open(out) as fh:
            result = json.load(fh)
    log.warning("engine: tune=True: %s", result.get("tune_file_note") or "done")
    return result


def _device_index(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None
