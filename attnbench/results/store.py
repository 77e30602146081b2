"""Result files: CSV under `results/runs/<YYYY-MM-DD>-<gpu>-<suite>.csv` (CPU runs:
`results/local/`), one row per (case, implementation, mode), columns as in
`attnbench.results.schema`.

Atomicity: `append_rows` never writes into the live file. It copies the current file's bytes
plus the new rows into a temporary file in the same folder, fsyncs it, `os.replace`s it over
the old one (atomic on POSIX) and fsyncs the folder. A crash at any point leaves either the
old file or the new one, never a half-written row. The cost is a rewrite per call (a run calls
it once per case), which is fine for files of a few thousand rows. Reading (with schema
checks) is `attnbench.results.read.read_results`.

A day file (the file a run appends to) is checked before a run measures anything
(`check_out_dir`, `check_day_file`): one with another header (another schema version, or not a
result file) is refused with its name; one whose last line was cut off by a crash of some other
writer is repaired: the partial line is dropped and every whole row kept.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from attnbench.results.read import ResultFileError
from attnbench.results.schema import COLUMN_NAMES, SCHEMA_VERSION, STATUSES
from engine.fsutil import atomic_write_text
from engine.gpus import gpu_model

assert COLUMN_NAMES[-1] == "timestamp", "_whole_row relies on the timestamp being last"
# as the runner writes it: datetime.now(UTC).isoformat(timespec="seconds")
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")


def result_path(out_dir: Path | str, suite: str, gpu: str, date: str | None = None) -> Path:
    date = date or datetime.now(UTC).strftime("%Y-%m-%d")
    return Path(out_dir) / f"{date}-{gpu_model(gpu)}-{suite}.csv"


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


class OutputDirError(ValueError):
    """A results folder that cannot be created or written."""


def check_out_dir(out_dir: Path | str) -> Path:
    """Create `out_dir` if needed and prove it writable (a probe file made and removed)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"{out_dir} exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".attnbench-probe.", dir=out_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputDirError(f"cannot write result files in {out_dir}: "
                             f"{exc.strerror or exc}") from None
    return out_dir


def _whole_text(path: Path) -> tuple[str, str | None]:
    """The file's text up to its last whole row, and a note when a partial line was dropped.

    Raises ResultFileError when the header is not this schema's, or when the text before the
    cut-off line does not parse into whole rows (then nothing is dropped: it is refused).
    """
    try:
        old = path.read_text() if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultFileError(path, None, f"cannot read the day file: {exc}") from None
    if not old:
        return "", None
    if old.split("\n", 1)[0] + "\n" != _header_line():
        raise ResultFileError(path, None, f"header is not the result schema version "
                              f"{SCHEMA_VERSION}'s; move the file away or pass another --out")
    if old.endswith("\n"):
        return old, None
    if _whole_row(old.rpartition("\n")[2]):  # a whole row that only lacks its newline
        return old + "\n", f"{path}: added the missing newline after its last row"
    keep, _, cut = old.rpartition("\n")
    keep += "\n"
    try:
        records = list(csv.reader(io.StringIO(keep)))
    except csv.Error:
        records = []
    if {len(r) for r in records} != {len(COLUMN_NAMES)}:  # the cut is not in the last row
        raise ResultFileError(path, None, "last line is incomplete and the rows before it do "
                              "not parse whole; repair or move the file")
    return keep, (f"{path}: dropped a half-written last line ({len(cut)} characters, left by "
                  f"a crashed writer); its {len(records) - 1} whole rows are kept")


def _whole_row(line: str) -> bool:
    """All columns, the last (timestamp) complete: `_row` always writes it in full."""
    try:
        fields = next(csv.reader([line]), [])
    except csv.Error:
        return False
    return len(fields) == len(COLUMN_NAMES) and bool(_TIMESTAMP.fullmatch(fields[-1]))


def check_day_file(path: Path | str) -> str | None:
    """Refuse a day file of another schema; repair a cut-off last line (returns what was done).

    Both raise/return before anything is measured, so a run never dies on its file later.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ResultFileError(path, None, "exists and is not a file")
    text, note = _whole_text(path)
    if note:
        atomic_write_text(path, text)
    return note


def append_rows(path: Path | str, rows: Iterable[Mapping[str, object]], *,
                on_repair: Callable[[str], None] | None = None) -> int:
    """Append whole rows to the CSV at `path` atomically (see the module docstring).

    A cut-off last line (another writer crashed since `check_day_file`) is dropped and said
    through `on_repair` (default: a warning); a file with another header is refused
    (ResultFileError, a ValueError).
    """
    rows = list(rows)
    for row in rows:
        _check_row(row)
    if not rows:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old, note = _whole_text(path)
    if note:
        if on_repair is None:
            warnings.warn(note, stacklevel=2)
        else:
            on_repair(note)
    buf = io.StringIO()
    buf.write(old or _header_line())
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow([_format(row[c]) for c in COLUMN_NAMES])
    atomic_write_text(path, buf.getvalue())
    return len(rows)
