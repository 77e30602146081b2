"""The day file a run appends to: another schema refused, a cut-off last line repaired, the
results folder proven writable; all before anything is measured."""

from __future__ import annotations

import csv
import io
import math
import os

import pytest

from attnbench.results.read import ResultFileError, read_results
from attnbench.results.schema import COLUMN_NAMES, SCHEMA_VERSION, columns_of
from attnbench.results.store import (
    OutputDirError,
    append_rows,
    check_day_file,
    check_out_dir,
)


def row(i: int, **over) -> dict:
    r = {c: "" for c in COLUMN_NAMES}
    r.update(schema_version=SCHEMA_VERSION, suite="s", case=f"c{i}", variant="softmax",
             shape="x", batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim=32,
             head_dim_v=32, dtype="float32", causal=False, mask="none", mode="fwd", impl="a",
             baseline="a", latency_ms=0.5 + i, latency_spread_ms=0.01, repeats=30,
             flops=1e9, tflops=2.0, mfu=math.nan, speedup=1.0, rel_err=1e-6,
             max_abs_err=1e-5, peak_mem_mb=math.nan, compile_s=math.nan, status="ok",
             reason="", device="cpu", seed=0, attempts=1, sm_clock_mhz=math.nan,
             mem_clock_mhz=math.nan, gpu_temp_c=math.nan, gpu_power_w=math.nan,
             timestamp=f"2026-11-24T10:00:{i:02d}+00:00")
    r.update(over)
    return r


@pytest.fixture
def day(tmp_path):
    path = tmp_path / "2026-11-24-cpu-s.csv"
    append_rows(path, [row(1), row(2), row(3)])
    return path


def test_other_header_is_refused_with_the_file_name(tmp_path):
    path = tmp_path / "old.csv"
    v1_header = ",".join(columns_of(1)) + "\n"
    path.write_text(v1_header + "1," + ",".join("x" * (len(columns_of(1)) - 1)) + "\n")
    before = path.read_bytes()
    for call in (lambda: check_day_file(path), lambda: append_rows(path, [row(1)])):
        with pytest.raises(ResultFileError, match="header is not the result schema") as err:
            call()
        assert str(path) in str(err.value)
    assert path.read_bytes() == before


@pytest.mark.parametrize("cut", [7, 40, -3])
def test_half_written_last_line_is_dropped_and_whole_rows_kept(day, cut):
    whole = day.read_text()
    partial = whole + whole.splitlines(keepends=True)[1][:cut]
    day.write_text(partial)
    note = check_day_file(day)
    assert note is not None and str(day) in note and "3 whole rows are kept" in note
    assert note.count("\n") == 0
    assert day.read_text() == whole
    assert check_day_file(day) is None  # repaired once
    assert read_results(day)["case"].tolist() == ["c1", "c2", "c3"]


def test_last_row_whole_but_without_newline_is_kept(day):
    day.write_text(day.read_text().rstrip("\n"))
    assert "missing newline" in check_day_file(day)
    assert read_results(day)["case"].tolist() == ["c1", "c2", "c3"]


def test_append_repairs_a_line_cut_after_the_check(day):
    day.write_text(day.read_text() + "2,s,c9,softm")
    with pytest.warns(UserWarning, match="half-written last line"):
        append_rows(day, [row(4)])
    assert read_results(day)["case"].tolist() == ["c1", "c2", "c3", "c4"]


def test_cut_inside_a_quoted_multi_line_field_is_refused(day):
    text = day.read_text()
    buf = io.StringIO()
    values = [str(v) for v in row(5, reason="line one\nline two").values()]
    csv.writer(buf, lineterminator="\n").writerow(values)
    day.write_text(text + buf.getvalue()[:-30])  # cut after the embedded newline
    with pytest.raises(ResultFileError, match="incomplete") as err:
        check_day_file(day)
    assert str(day) in str(err.value)


def test_empty_or_missing_day_file_is_fine(tmp_path):
    assert check_day_file(tmp_path / "none.csv") is None
    (tmp_path / "empty.csv").write_text("")
    assert check_day_file(tmp_path / "empty.csv") is None
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(ResultFileError, match="not a file"):
        check_day_file(tmp_path / "dir.csv")


def test_out_dir_is_created_and_probed(tmp_path):
    made = check_out_dir(tmp_path / "a" / "b")
    assert made.is_dir() and list(made.iterdir()) == []  # the probe is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match="is not a folder"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(OutputDirError, match="cannot write result files in"):
        check_out_dir(tmp_path / "f" / "sub")
    with pytest.raises(OutputDirError, match="cannot write result files in /proc/nope"):
        check_out_dir("/proc/nope")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_out_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(OutputDirError, match="cannot write"):
        check_out_dir(ro)
