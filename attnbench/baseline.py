"""The designated regression baseline per GPU: `results/baseline/<gpu>.csv`.

A baseline file is an ordinary result CSV (same schema), so it is read and validated like any run.
It holds, for each suite, the rows of the run last promoted for that suite: promoting a run of
suite "softmax" replaces the softmax rows and keeps the other suites'. Promotion is always an
explicit command (`attnbench baseline promote RUN`); nothing promotes implicitly.

A `noisy` row (the runner could not measure it tightly) is never promoted: the baseline keeps
its previous row for that key, or none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from attnbench.compare import Comparison, GateRule, compare
from attnbench.results.read import (
    KEY,
    dedupe_latest,
    empty_frame,
    read_many,
    read_results,
    run_files,
)
from attnbench.results.schema import COLUMN_NAMES, SCHEMA_VERSION
from engine.fsutil import atomic_write_text
from engine.gpus import gpu_model

DEFAULT_RESULTS = Path("results")


def baseline_path(gpu: str, results_dir: Path | str = DEFAULT_RESULTS) -> Path:
    """Where the baseline of a GPU lives; `gpu` is a slug ("h100") or a full device name."""
    return Path(results_dir) / "baseline" / f"{gpu_model(gpu)}.csv"


def run_gpu(frame: pd.DataFrame, source: Path | str) -> str:
    """The one GPU slug of a run's rows; a run mixing GPUs cannot be a baseline."""
    slugs = sorted({gpu_model(g) for g in frame["gpu"].tolist()})
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


@dataclass(frozen=True)
class Promotion:
    path: Path
    rows: pd.DataFrame  # the whole baseline after promotion
    promoted: int  # rows taken from the run
    noisy: int  # noisy rows of the run left out
    kept: int  # of those, keys whose previous baseline row was kept


def promote(
    run: Path | str, results_dir: Path | str = DEFAULT_RESULTS, gpu: str | None = None
) -> Promotion:
    """Make a run file the baseline of its GPU for the suites it covers, noisy rows excepted."""
    rows = dedupe_latest(read_results(run))
    if rows.empty:
        raise ValueError(f"run: {run} has no rows to promote")
    slug = gpu_model(gpu) if gpu else run_gpu(rows, run)
    path = baseline_path(slug, results_dir)
    current = read_results(path) if path.exists() else empty_frame()
    merged, noisy, kept = merge_run(current, rows)
    if noisy == len(rows):
        raise ValueError(f"run: every row of {run} is noisy ({noisy}); nothing to promote")
    # One file, one schema: rows read from older versions carry the columns they lacked
    # (filled by the reader), so the whole baseline is written as the current version.
    write_csv(merged.assign(schema_version=SCHEMA_VERSION), path)
    return Promotion(path, merged, len(rows) - noisy, noisy, kept)


def merge_run(current: pd.DataFrame, run: pd.DataFrame) -> tuple[pd.DataFrame, int, int]:
    """The baseline `current` with the suites of `run` replaced by the run's rows.

    A noisy row of the run is left out and the baseline's previous row for its key, if any, is
    kept. Returns (merged rows, noisy rows left out, previous rows kept for them).
    """
    noisy = run["status"].astype(str) == "noisy"
    noisy_keys = set(_key_tuples(run[noisy]))
    in_suites = current["suite"].isin(set(run["suite"]))
    kept = current[in_suites & pd.Series(
        [k in noisy_keys for k in _key_tuples(current)], index=current.index, dtype=bool)]
    parts = [f for f in (current[~in_suites], kept, run[~noisy]) if not f.empty]
    merged = pd.concat(parts, ignore_index=True) if parts else empty_frame()
    merged = merged.sort_values(list(KEY), kind="stable")
    return merged, int(noisy.sum()), len(kept)


def _key_tuples(frame: pd.DataFrame) -> list[tuple[str, ...]]:
    return [tuple(str(v) for v in k) for k in frame.loc[:, list(KEY)].itertuples(index=False)]


def newest_runs(runs_dir: Path | str, gpu: str) -> tuple[pd.DataFrame, list[Path]]:
    """For each suite, the rows of the newest run file of a GPU (newest by timestamp).

    Returns the concatenated rows (latest measurement per key) and the files they came from; an
    empty frame and [] when the GPU has no run.
    """
    want = gpu_model(gpu)
    frame = read_many(run_files(runs_dir))
    return newest_per_suite(frame[frame["gpu"].map(gpu_model) == want])


def newest_per_suite(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[Path]]:
    """For each suite of `frame` (rows of one GPU), the rows of its newest source file.

    A file is one GPU's runs of one suite on one day, so the newest file is the newest run, with
    the cases that run finished; older files never fill in for cases it lacks.
    """
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


def empty_run_files(runs_dir: Path | str, gpu: str) -> list[Path]:
    """Run files named for this GPU (`<date>-<gpu>-<suite>.csv`) that hold no row."""
    name = re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}-{re.escape(gpu_model(gpu))}-.+\.csv")
    return [p for p in run_files(runs_dir)
            if name.fullmatch(p.name) and read_results(p).empty]


@dataclass(frozen=True)
class GateInputs:
    """What `compare --against-baseline` gates for one GPU, read from a results folder."""

    base: pd.DataFrame | None  # the baseline's rows of the new run's suites; None: no baseline
    base_label: str
    new: pd.DataFrame  # the new run: a file, or the newest committed run of each suite
    new_label: str
    empty_files: tuple[Path, ...] = ()  # new run files with no row: an empty run
    unrun_suites: tuple[str, ...] = ()  # baseline suites without any committed run

    @property
    def nothing_to_gate(self) -> str:
        """Why there is nothing to gate ("" when there is): no run, or no baseline yet.

        An empty run file is something to gate (it fails), never "nothing to gate".
        """
        if self.new.empty and not self.empty_files:
            return self.new_label
        if self.base is None:
            return (f"no baseline yet ({self.base_label}); promote one with "
                    "`attnbench baseline promote RUN`")
        return ""


def against_baseline(
    results_dir: Path | str, gpu: str, new_file: Path | str | None = None
) -> GateInputs:
    """The baseline of a GPU against a run file (whose rows name the GPU), or against the
    GPU's newest committed run of each suite under results_dir/runs."""
    results_dir = Path(results_dir)
    if new_file is not None:
        new = dedupe_latest(read_results(new_file))
        gpu = run_gpu(new, new_file) if not new.empty else gpu
        empty = (Path(new_file),) if new.empty else ()
        new_label = str(new_file)
    else:
        runs = results_dir / "runs"
        new, sources = newest_runs(runs, gpu)
        empty = tuple(empty_run_files(runs, gpu))
        new_label = (", ".join(s.name for s in sources)
                     or f"no committed {gpu} run under {runs}")
    path = baseline_path(gpu, results_dir)
    base = read_results(path) if path.exists() else None
    unrun: tuple[str, ...] = ()
    if base is not None:
        # The baseline covers many suites; gate only the suites the new run measured.
        measured = base["suite"].isin(set(new["suite"]))
        if new_file is None:
            unrun = tuple(sorted(set(base.loc[~measured, "suite"])))
        base = base[measured]
    return GateInputs(base, str(path), new, new_label, empty, unrun)


def gate(inputs: GateInputs, rule: GateRule | None = None) -> Comparison:
    """Compare; an empty run file fails the gate as an empty run (no baseline: the run alone)."""
    base = inputs.base if inputs.base is not None else empty_frame()
    cmp = compare(base, inputs.new, rule)
    empty = tuple(f"{p}: an empty run (no rows)" for p in inputs.empty_files)
    notes = tuple(f"baseline suite {s} has no committed run: not gated"
                  for s in inputs.unrun_suites)
    return replace(cmp, empty=cmp.empty + empty, notes=cmp.notes + notes)


def write_csv(frame: pd.DataFrame, path: Path | str) -> Path:
    """Write rows in schema column order, atomically (temp file in the folder, fsync, rename)."""
    return atomic_write_text(path, frame.loc[:, list(COLUMN_NAMES)].to_csv(index=False))

