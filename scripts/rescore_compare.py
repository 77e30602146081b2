"""Re-score a finished grid-vs-Optuna comparison from its Optuna storage (no GPU): rebuilds
both studies' results and writes the record with the current scoring (attnbench.tune.compare).

Usage: python scripts/rescore_compare.py STORAGE_URL GRID_STUDY OPTUNA_STUDY OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import optuna

from attnbench.tune.compare import comparison_record, format_record
from attnbench.tune.runner import summarize
from engine.tuning import tune_file


def main(storage: str, grid_name: str, tpe_name: str, out: str) -> int:
    grid_study = optuna.load_study(study_name=grid_name, storage=storage)
    tpe_study = optuna.load_study(study_name=tpe_name, storage=storage)
    grid = summarize(grid_study, grid_name, storage, "", 0, True, 0)
    # The grid evaluates every valid config once: its size is the space's valid count.
    grid.n_valid = grid.target = grid.evaluated
    tpe = summarize(tpe_study, tpe_name, storage, "", grid.n_valid, False, 0)
    tpe.target = tpe.evaluated
    gpu = grid_study.user_attrs.get("gpu") or grid_name.split(":")[6]
    grid.gpu = tpe.gpu = gpu
    rec = comparison_record(grid, tpe)
    rec["rescored_from"] = {"storage": storage.rsplit("/", 1)[-1], "grid": grid_name,
                            "optuna": tpe_name}
    tune_file.atomic_write_json(Path(out), rec)
    print(format_record(rec))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
