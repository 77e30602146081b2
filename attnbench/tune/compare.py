"""Grid vs Optuna: does TPE reach within 3% of the grid's best with <= 30% of its trials?

Runs (or resumes) the grid study (every valid config once) and a fresh TPE study (its own
name, so earlier tuning does not help it) with a budget of 30% of the grid's size, then writes a
JSON record under results/tune/<gpu>/ and returns it.

Search quality is read off the grid: each config Optuna tried is scored by the grid's latency
for that config, so the verdict compares choices, not two timings of one kernel taken minutes
apart (those differ by a few percent on the H100). The record also keeps Optuna's own measured
best and the spread between the two studies' timings of the same configs.

Time budget under --timeout: the grid gets GRID_TIME_SHARE (70%) of it and Optuna the rest
(at least 30%, more if the grid finished early): Optuna evaluates 30% of the grid's trials, so
it needs about 30% of the grid's time. The record is written whatever happens (timeout, Ctrl-C,
an error in a phase): with what was measured so far and `complete: false` plus the reason.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import math
import time
from pathlib import Path

from attnbench.tune.objective import Objective
from attnbench.tune.result import TuneResult
from attnbench.tune.runner import TuneOptions, run_study
from attnbench.tune.space import SearchSpace
from engine.tuning import tune_file

log = logging.getLogger(__name__)

WITHIN = 0.03
BUDGET_FRACTION = 0.30
GRID_TIME_SHARE = 0.70


def compare_grid(
    objective: Objective, space: SearchSpace, opts: TuneOptions, out_dir: Path | None = None
) -> dict:
    start = time.monotonic()
    grid = tpe = None
    reasons: list[str] = []
    interrupt: BaseException | None = None
    try:
        grid_timeout = opts.timeout_s * GRID_TIME_SHARE if opts.timeout_s else None
        grid = run_study(objective, space, dataclasses.replace(
            opts, search="grid", kind="grid", timeout_s=grid_timeout))
        if grid.interrupted:
            reasons.append(f"grid stopped by the time limit after {grid.evaluated}/{grid.target}")
        budget = max(1, math.floor(BUDGET_FRACTION * grid.n_valid))
        left = opts.timeout_s - (time.monotonic() - start) if opts.timeout_s else None
        if left is not None and left <= 0:
            reasons.append("no time left for the Optuna study")
        else:
            tpe = run_study(objective, space, dataclasses.replace(
                opts, search="tpe", kind=f"cmp-s{opts.seed}", trials=budget,
                write_tune_file=False, timeout_s=left))
            if tpe.interrupted:
                reasons.append(
                    f"Optuna stopped by the time limit after {tpe.evaluated}/{tpe.target}")
    except BaseException as exc:  # Ctrl-C or a failed phase: record, then re-raise
        interrupt = exc
        reasons.append(f"interrupted: {type(exc).__name__}: {exc}"[:500])
    record = comparison_record(grid, tpe, reasons)
    p = objective.problem
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    gpu = (grid or tpe).gpu if (grid or tpe) else "unknown-gpu"
    out = (out_dir or tune_file.default_dir() / tune_file.gpu_slug(gpu)) / (
        f"compare-{p.template}-{p.variant}-{tune_file.shape_tag(p.shape())}-{p.dtype}-{stamp}.json"
    )
    tune_file.atomic_write_json(out, record)
    record["path"] = str(out)
    if interrupt is not None:
        log.warning("comparison interrupted; partial record written to %s", out)
        raise interrupt
    return record


def comparison_record(
    grid: TuneResult | None, tpe: TuneResult | None, incomplete: list[str] | None = None
) -> dict:
    reasons = list(incomplete or [])
    if grid is None or grid.best_latency_ms is None:
        reasons.append("the grid measured no config successfully")
    if tpe is None:
        reasons.append("the Optuna study did not run")
    grid_best = grid.best_latency_ms if grid else None
    reached_at, gap, measured_gap, used, spread = None, None, None, None, None
    if grid_best is not None and tpe is not None:
        table = latencies_by_key(grid)
        goal = grid_best * (1 + WITHIN)
        running = math.inf
        for i, key in enumerate(tpe.history_keys, start=1):
            running = min(running, table.get(key, math.inf))
            if reached_at is None and running <= goal:
                reached_at = i
        gap = running / grid_best - 1 if math.isfinite(running) else None
        if tpe.best_latency_ms:
            measured_gap = tpe.best_latency_ms / grid_best - 1
        used = tpe.evaluated / grid.n_valid if grid.n_valid else None
        spread = remeasure_spread(table, latencies_by_key(tpe))
    complete = not reasons
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": (grid or tpe).gpu if (grid or tpe) else None,
        "tilelang_version": tune_file.tilelang_version(),
        "grid": _side(grid) if grid else None,
        "optuna": _side(tpe) if tpe else None,
        # The grid's latency of the best config Optuna tried, relative to the grid's best.
        "optuna_gap_vs_grid_best": gap,
        # Optuna's own timing of its best config against the grid's best timing.
        "optuna_measured_gap_vs_grid_best": measured_gap,
        # Median |t_optuna / t_grid - 1| over the configs both studies timed: the noise.
        "remeasure_spread": spread,
        "optuna_trials_fraction_of_grid": used,
        "optuna_trials_to_within_3pct": reached_at,
        "criterion": f"gap <= {WITHIN:.0%} using <= {BUDGET_FRACTION:.0%} of the grid's trials",
        "complete": complete,
        "incomplete_reasons": reasons,
        # Only a complete grid gives a true optimum; a partial record never passes.
        "pass": bool(complete and gap is not None and gap <= WITHIN and used is not None
                     and used <= BUDGET_FRACTION + 1e-9),
    }


def latencies_by_key(r: TuneResult) -> dict[str, float]:
    """Config key -> latency (ms) of every successfully measured trial of a study."""
    return {k: v for k, v in zip(r.history_keys, r.history, strict=True) if math.isfinite(v)}


def remeasure_spread(a: dict[str, float], b: dict[str, float]) -> float | None:
    ratios = sorted(abs(b[k] / a[k] - 1) for k in a.keys() & b.keys())
    return ratios[len(ratios) // 2] if ratios else None


def _side(r: TuneResult) -> dict:
    return {
        "study": r.study_name,
        "trials": r.evaluated,
        "failed": r.failed,
        "best_latency_ms": r.best_latency_ms,
        "best_tflops": r.best_tflops,
        "best_config": r.best_config,
        "best_trial": r.best_trial,
        "target": r.target,
        "n_valid": r.n_valid,
        "baseline_latency_ms": r.baseline_latency_ms,
        "interrupted": r.interrupted,
    }


def format_record(rec: dict) -> str:
    g, o = rec["grid"], rec["optuna"]
    gap = rec["optuna_gap_vs_grid_best"]

    def side(name: str, d: dict | None) -> str:
        if not d:
            return f"{name} not run"
        best = (f"{d['best_latency_ms']:.4g} ms ({d['best_tflops'] or 0:.0f} TFLOP/s) "
                f"{d['best_config']}" if d["best_latency_ms"] else "-")
        return f"{name} {d['trials']} trials, best {best}"

    measured, spread = rec.get("optuna_measured_gap_vs_grid_best"), rec.get("remeasure_spread")
    lines = [side("grid:  ", g), side("optuna:", o),
             (f"gap {gap:+.2%} (grid latency of Optuna's best pick)" if gap is not None
              else "gap -")
             + (f"; measured {measured:+.2%}" if measured is not None else "")
             + (f"; re-measure spread {spread:.2%}" if spread is not None else ""),
             f"within 3% after {rec['optuna_trials_to_within_3pct']} trials; "
             f"{rec['criterion']}: {'PASS' if rec['pass'] else 'FAIL'}"]
    if not rec["complete"]:
        lines.append("INCOMPLETE: " + "; ".join(rec["incomplete_reasons"]))
    return "\n".join(lines)
