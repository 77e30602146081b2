"""Result files: CSV under `results/runs/<YYYY-MM-DD>-<gpu>-<suite>.csv`, one row per
(case, implementation, mode), columns as in `attnbench.results.schema`.

Atomicity: `append_rows` never writes into the live file. It copies the current file's bytes
plus the new rows into a temporary file in the same folder, fsyncs it, `os.replace`s it over
the old one (atomic on POSIX) and fsyncs the folder. A crash at any point leaves either the
old file or the new one, never a half-written row. The cost is a rewrite per call (a run calls
it once per case), which is fine for files of a few thousand rows. Reading (with schema
checks) is `attnbench.results.read.read_results`.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from attnbench.results.read import gpu_slug
from attnbench.results.schema import COLUMN_NAMES, SCHEMA_VERSION, STATUSES
from engine.fsutil import atomic_write_text


def result_path(out_dir: Path | str, suite: str, gpu: str, date: str | None = None) -> Path:
    date = date or datetime.now(UTC).strftime("%Y-%m-%d")
    return Path(out_dir) / f"{date}-{gpu_slug(gpu)}-{suite}.csv"


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def _check_row(row: Mapping[str, object]) -> None:
    missing = [c for c in COLUMN_NAMES if c not in row]
    extra = [c for c in row if c not in COLUMN_NAMES]
    if missing or extra:
        raise ValueError(f"result row: missing columns {missing}, unknown columns {extra}")
    if row["status"] not in STATUSES:
        raise ValueError(f"result row: status must be one of {STATUSES}, got {row['status']!r}")


def _header_line() -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(COLUMN_NAMES)
    return buf.getvalue()


def append_rows(path: Path | str, rows: Iterable[Mapping[str, object]]) -> int:
    """Append whole rows to the CSV at `path` atomically (see the module docstring)."""
    rows = list(rows)
    for row in rows:
        _check_row(row)
    if not rows:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    if old:
        first = old.split("\n", 1)[0] + "\n"
        if first != _header_line():
            raise ValueError(f"{path}: header does not match schema version {SCHEMA_VERSION}; "
                             "write to another file")
        if not old.endswith("\n"):
            raise ValueError(f"{path}: last line is incomplete (not written by this store)")
    buf = io.StringIO()
    buf.write(old or _header_line())
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow([_format(row[c]) for c in COLUMN_NAMES])
    atomic_write_text(path, buf.getvalue())
    return len(rows)
