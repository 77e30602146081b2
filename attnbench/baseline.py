"""The designated regression baseline per GPU: `results/baseline/<gpu>.csv`.

A baseline file is an ordinary result CSV (same schema), so it is read and validated like any run.
It holds, for each suite, the rows of the run last promoted for that suite: promoting a run of
suite "softmax" replaces the softmax rows and keeps the other suites'. Promotion is always an
explicit command (`attnbench baseline promote RUN`); nothing promotes implicitly.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from attnbench.results.read import (
    dedupe_latest,
    empty_frame,
    gpu_slug,
    read_many,
    read_results,
    run_files,
)
from attnbench.results.schema import COLUMN_NAMES
from engine.fsutil import atomic_write_text

DEFAULT_RESULTS = Path("results")


def baseline_path(gpu: str, results_dir: Path | str = DEFAULT_RESULTS) -> Path:
    """Where the baseline of a GPU lives; `gpu` is a slug ("h100") or a full device name."""
    return Path(results_dir) / "baseline" / f"{gpu_slug(gpu)}.csv"


def run_gpu(frame: pd.DataFrame, source: Path | str) -> str:
    """The one GPU slug of a run's rows; a run mixing GPUs cannot be a baseline."""
    slugs = sorted({gpu_slug(g) for g in frame["gpu"].tolist()})
    if len(slugs) != 1:
        raise ValueError(
            f"{source}: column 'gpu' must name one GPU to pick a baseline, found "
            f"{', '.join(slugs) or 'none'}"
        )
    return slugs[0]


def load_baseline(gpu: str, results_dir: Path | str = DEFAULT_RESULTS) -> pd.DataFrame | None:
    """The baseline rows of a GPU, or None when none has been promoted yet."""
    path = baseline_path(gpu, results_dir)
    return read_results(path) if path.exists() else None


def promote(
    run: Path | str, results_dir: Path | str = DEFAULT_RESULTS, gpu: str | None = None
) -> tuple[Path, pd.DataFrame]:
    """Make a run file the baseline of its GPU for the suites it covers; returns (path, rows)."""
    rows = dedupe_latest(read_results(run))
    if rows.empty:
        raise ValueError(f"run: {run} has no rows to promote")
    slug = gpu_slug(gpu) if gpu else run_gpu(rows, run)
    path = baseline_path(slug, results_dir)
    current = read_results(path) if path.exists() else empty_frame()
    kept = current[~current["suite"].isin(set(rows["suite"]))]
    merged = pd.concat([kept, rows], ignore_index=True) if not kept.empty else rows
    merged = merged.sort_values(["suite", "case", "impl", "mode"], kind="stable")
    write_csv(merged, path)
    return path, merged


def newest_runs(runs_dir: Path | str, gpu: str) -> tuple[pd.DataFrame, list[Path]]:
    """For each suite, the rows of the newest run file of a GPU (newest by timestamp).

    Returns the concatenated rows (latest measurement per key) and the files they came from; an
    empty frame and [] when the GPU has no run.
    """
    want = gpu_slug(gpu)
    frame = read_many(run_files(runs_dir))
    if frame.empty:
        return frame, []
    frame = frame[frame["gpu"].map(gpu_slug) == want]
    chosen = []
    for _suite, rows in frame.groupby("suite", sort=True):
        # newest file = the one with the latest timestamp; ties broken by file name (date first)
        per_file = rows.groupby("source")["timestamp"].max().fillna("")
        best = max(per_file.index, key=lambda s: (per_file[s], Path(s).name))
        chosen.append(rows[rows["source"] == best])
    if not chosen:
        return empty_frame(), []
    picked = pd.concat(chosen, ignore_index=True)
    return dedupe_latest(picked), sorted({Path(s) for s in picked["source"]})


def write_csv(frame: pd.DataFrame, path: Path | str) -> Path:
    """Write rows in schema column order, atomically (temp file in the folder, fsync, rename)."""
    return atomic_write_text(path, frame.loc[:, list(COLUMN_NAMES)].to_csv(index=False))

