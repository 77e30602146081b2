"""Load result CSVs and refuse the ones that do not follow `schema.py`.

A reader that guessed at missing columns would let a stale or truncated file slip into the gate
unnoticed, so every problem raises `ResultFileError` naming the file and the column.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from attnbench.results.schema import (
    COLUMNS,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    STATUSES,
    V2_COLUMNS,
    V3_COLUMNS,
    columns_of,
)

KEY: tuple[str, ...] = ("suite", "case", "impl", "mode")


class ResultFileError(ValueError):
    """A result file that cannot be used: names the file and, when known, the column."""

    def __init__(self, path: Path | str, column: str | None, problem: str) -> None:
        self.path = Path(path)
        self.column = column
        where = f"{self.path}" + (f", column {column!r}" if column else "")
        super().__init__(f"{where}: {problem}")


def read_results(path: Path | str) -> pd.DataFrame:
    """Read one result CSV, check its schema version and columns, and return it typed.

    The returned frame has exactly the schema's columns in schema order (extra columns from a
    newer writer of the same version are dropped) plus `source`, the file it came from. A
    version-1 file gets the columns version 2 added: `attempts` 1 for ok rows and 0 for the
    others (version 1 measured once and never re-measured), the NVML columns NaN; version-1 and
    version-2 files get version 3's traffic columns as NaN (their rows never recorded it).
    """
    path = Path(path)
    if not path.is_file():
        raise ResultFileError(path, None, "no such result file")
    try:
        # Everything as text first: pandas' own inference would turn "nan" case names or empty
        # strings into floats before we can check anything.
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise ResultFileError(path, None, "file is empty (expected a CSV header)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ResultFileError(path, None, f"not a readable CSV: {exc}") from None

    version = _file_version(raw, path)
    for name in columns_of(version):
        if name not in raw.columns:
            raise ResultFileError(path, name, "missing column (required by the result schema "
                                  f"version {version})")

    frame = pd.DataFrame(index=raw.index)
    for name, dtype in COLUMNS:
        if name in columns_of(version):
            frame[name] = _convert(raw[name], dtype, path, name)
    bad_status = sorted(set(frame["status"].dropna()) - set(STATUSES))
    if bad_status:
        raise ResultFileError(
            path, "status", f"unknown status {bad_status[0]!r} (expected {'|'.join(STATUSES)})"
        )
    frame = _fill_missing(frame, version)
    frame["source"] = pd.Series(str(path), index=frame.index, dtype="string")
    return frame


def _file_version(raw: pd.DataFrame, path: Path) -> int:
    """The one schema version of a file's rows (from the header alone when it has no rows)."""
    if "schema_version" not in raw.columns:
        raise ResultFileError(path, "schema_version",
                              "missing column (required by the result schema)")
    versions = sorted(set(raw["schema_version"].str.strip()))
    if not versions:  # header only: the header says which version wrote it
        if any(c in raw.columns for c in V3_COLUMNS):
            return SCHEMA_VERSION
        return 2 if any(c in raw.columns for c in V2_COLUMNS) else 1
    readable = [str(v) for v in READABLE_VERSIONS]
    bad = [v for v in versions if v not in readable]
    if bad:
        raise ResultFileError(
            path, "schema_version",
            f"schema version {', '.join(bad)} is not a supported version "
            f"({', '.join(readable)}; this attnbench writes {SCHEMA_VERSION})",
        )
    if len(versions) > 1:
        raise ResultFileError(path, "schema_version",
                              f"rows of several schema versions ({', '.join(versions)})")
    return int(versions[0])


def _fill_missing(frame: pd.DataFrame, version: int) -> pd.DataFrame:
    """The columns later versions added, as an older row means them (see `read_results`)."""
    have = set(columns_of(version))
    for name, dtype in COLUMNS:
        if name in have:
            continue
        if name == "attempts":
            frame[name] = (frame["status"] == "ok").fillna(False).astype("int64")
        else:  # every other added column is a float measurement the old row lacks
            frame[name] = pd.Series(float("nan"), index=frame.index, dtype=dtype)
    return frame[[name for name, _ in COLUMNS]]


def _convert(col: pd.Series, dtype: str, path: Path, name: str) -> pd.Series:
    text = col.str.strip()
    if dtype == "string":
        return text.replace("", pd.NA).astype("string")
    if dtype == "float64":
        values = pd.to_numeric(text.replace("", "nan"), errors="coerce")
        # "nan"/"" are legitimate (a skipped row has no latency); anything else is corruption.
        garbage = values.isna() & ~text.str.lower().isin(["", "nan", "none", "null"])
        if garbage.any():
            raise ResultFileError(path, name, f"not a number: {text[garbage].iloc[0]!r}")
        return values.astype("float64")
    if dtype == "int64":
        values = pd.to_numeric(text, errors="coerce")
        bad = values.isna() | (values != values.round())
        if bad.any():
            raise ResultFileError(path, name, f"not an integer: {text[bad].iloc[0]!r}")
        return values.astype("int64")
    if dtype == "boolean":
        lowered = text.str.lower()
        mapping = {"true": True, "1": True, "false": False, "0": False}
        bad = ~lowered.isin([*mapping, ""])
        if bad.any():
            raise ResultFileError(path, name, f"not a boolean: {text[bad].iloc[0]!r}")
        return lowered.map(lambda v: mapping.get(v, pd.NA)).astype("boolean")
    raise AssertionError(f"schema dtype {dtype!r} of column {name!r} has no converter")


def read_many(paths: Iterable[Path | str]) -> pd.DataFrame:
    """Read and concatenate result files; an empty iterable gives an empty, typed frame."""
    frames = [read_results(p) for p in paths]
    if not frames:
        return empty_frame()
    return pd.concat(frames, ignore_index=True)


def empty_frame() -> pd.DataFrame:
    frame = pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in COLUMNS})
    frame["source"] = pd.Series(dtype="string")
    return frame


def run_files(runs_dir: Path | str) -> list[Path]:
    """The result files of a runs folder, sorted by name (the name starts with the date)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    return sorted(p for p in runs_dir.glob("*.csv") if p.is_file())


def dedupe_latest(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (suite, case, impl, mode): the latest by timestamp, then by file order.

    A runs file can gather several runs of one day; the last measurement is the one that counts.
    """
    if frame.empty:
        return frame
    order = frame.assign(_pos=range(len(frame))).sort_values(
        ["timestamp", "_pos"], na_position="first", kind="stable"
    )
    latest = order.drop_duplicates(list(KEY), keep="last")
    return latest.drop(columns="_pos").sort_index()
