"""The tuner behind `AttentionEngine(tune=True)`: the engine's tuner protocol
(engine.tuning.autotune.Tuner), registered under the entry point group `attnbench.engine_tuner`
in pyproject.toml.

It runs the same study as `attnbench tune` (Optuna, worker processes, the tune-file rule that
never writes a config slower than the default) on the inputs of the call that asked, with the
request's trial and time budget, in a child process (see attnbench.tune.spec_job).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

from attnbench.tune.problem import Problem
from attnbench.tune.runner import TuneOptions
from attnbench.tune.spec_objective import SpecObjective
from engine import CustomIO
from engine.dtypes import short_dtype_name
from engine.tuning.autotune import TuneRequest


class EngineTuner:
    """`make_objective(problem, inputs_path)` replaces the real objective (tests use the fake
    one: the whole study then runs on a CPU)."""

    def __init__(self, make_objective: Callable[[Problem, str], Any] | None = None):
        self.make_objective = make_objective

    def tune(self, request: TuneRequest) -> dict | None:
        kernels = request.kernels
        problem = Problem(variant="custom", dtype=short_dtype_name(kernels.dtype),
                          mode=request.kind.mode, family=request.kind.family,
                          **kernels.problem.sizes())
        q = request.inputs["q"]
        with tempfile.TemporaryDirectory(prefix="attnbench-tune-") as tmp:
            inputs_path = os.path.join(tmp, "inputs.pt")
            torch.save({n: t.detach().cpu().contiguous() for n, t in request.inputs.items()},
                       inputs_path)
            if self.make_objective is not None:
                objective = self.make_objective(problem, inputs_path)
            else:
                objective = SpecObjective(problem, kernels.spec, CustomIO(dict(kernels.spec.customs)),
                                          inputs_path)
            opts = TuneOptions(
                trials=request.budget.trials, timeout_s=request.budget.timeout_s,
                devices=(q.device.index if q.device.type == "cuda" else None,),
                tune_file=kernels.options.tune_file, progress=request.progress,
            )
            return _run_job(objective, opts, tmp)


def _run_job(objective, opts: TuneOptions, tmp: str) -> dict | None:
    """The study in a child process, not this one: see attnbench.tune.spec_job."""
    job, out = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "result.json")
    with open(job, "wb") as fh:
        pickle.dump({"objective": objective, "options": opts}, fh)
    done = subprocess.run([sys.executable, "-m", "attnbench.tune.spec_job", job, out], check=False)
    if done.returncode != 0 or not os.path.exists(out):
        warnings.warn(f"tune=True: the tuning process failed (exit code {done.returncode}; its "
                      "output is above); using the tune file or defaults", stacklevel=4)
        return None
    with open(out) as fh:
        return json.load(fh)
