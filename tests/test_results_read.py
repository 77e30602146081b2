"""Result CSV loading: typed round trip, and clear errors for foreign or broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnbench.report.sample import SampleSpec, sample_rows, write_csv
from attnbench.results.read import (
    ResultFileError,
    dedupe_latest,
    read_many,
    read_results,
)
from attnbench.results.schema import (
    COLUMN_NAMES,
    COLUMNS,
    SCHEMA_VERSION,
    V2_COLUMNS,
    V3_COLUMNS,
    columns_of,
)


@pytest.fixture
def rows() -> pd.DataFrame:
    return sample_rows(np.random.default_rng(11), SampleSpec(seqlens=(1024, 4096)))


def test_round_trip_keeps_values_and_dtypes(tmp_path, rows):
    path = write_csv(rows, tmp_path / "2026-11-22-h100-softmax.csv")
    back = read_results(path)
    assert list(back.columns) == [*COLUMN_NAMES, "source"]
    for name, dtype in COLUMNS:
        assert str(back[name].dtype) == dtype, name
    np.testing.assert_allclose(back["latency_ms"], rows["latency_ms"], rtol=1e-12)
    np.testing.assert_allclose(back["rel_err"], rows["rel_err"], rtol=1e-12)
    assert back["latency_ms"].isna().sum() == (rows["status"] != "ok").sum() > 0
    assert back["causal"].tolist() == rows["causal"].tolist()
    assert set(back["source"]) == {str(path)}


@pytest.mark.parametrize("column", ["schema_version", "case", "latency_spread_ms", "timestamp"])
def test_missing_column_names_file_and_column(tmp_path, rows, column):
    path = tmp_path / "old.csv"
    rows.drop(columns=[column]).to_csv(path, index=False)
    with pytest.raises(ResultFileError) as err:
        read_results(path)
    assert str(path) in str(err.value) and repr(column) in str(err.value)
    assert err.value.column == column


def test_other_schema_version_is_refused(tmp_path, rows):
    path = tmp_path / "future.csv"
    write_csv(rows.assign(schema_version=SCHEMA_VERSION + 1), path)
    with pytest.raises(ResultFileError, match="schema_version") as err:
        read_results(path)
    assert str(path) in str(err.value) and str(SCHEMA_VERSION + 1) in str(err.value)


def test_garbage_number_names_the_column(tmp_path, rows):
    path = tmp_path / "bad.csv"
    bad = rows.astype({"latency_ms": "object"})
    bad.loc[3, "latency_ms"] = "fast"
    write_csv(bad, path)
    with pytest.raises(ResultFileError, match="latency_ms") as err:
        read_results(path)
    assert "'fast'" in str(err.value)


def test_unknown_status_and_empty_and_missing_file(tmp_path, rows):
    path = tmp_path / "status.csv"
    write_csv(rows.assign(status="maybe"), path)
    with pytest.raises(ResultFileError, match="status"):
        read_results(path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ResultFileError, match="empty"):
        read_results(empty)
    with pytest.raises(ResultFileError, match="no such"):
        read_results(tmp_path / "absent.csv")


def test_read_many_and_dedupe_latest(tmp_path, rows):
    first = write_csv(rows, tmp_path / "a.csv")
    later = rows.iloc[:5].assign(timestamp="2026-11-23T00:00:00Z",
                                 latency_ms=rows["latency_ms"].iloc[:5] * 2)
    second = write_csv(later, tmp_path / "b.csv")
    both = read_many([first, second])
    assert len(both) == len(rows) + 5
    latest = dedupe_latest(both)
    assert len(latest) == len(rows)
    merged = latest.set_index(["suite", "case", "impl", "mode"])
    for _, r in later.iterrows():
        got = merged.loc[(r["suite"], r["case"], r["impl"], r["mode"]), "latency_ms"]
        assert got == pytest.approx(r["latency_ms"], nan_ok=True)
    assert read_many([]).empty


# ---------------------------------------------------------------------- schema version 1
REPO = Path(__file__).resolve().parents[1]
V1_FILE = REPO / "results" / "runs" / "2026-11-22-h100-softmax-d128.csv"  # committed, version 1


def test_committed_version_1_file_reads_with_the_new_columns_filled():
    assert V1_FILE.read_text().startswith("schema_version,")
    raw = pd.read_csv(V1_FILE)
    assert set(raw["schema_version"]) == {1} and "attempts" not in raw.columns
    back = read_results(V1_FILE)
    assert list(back.columns) == [*COLUMN_NAMES, "source"]
    for name, dtype in COLUMNS:
        assert str(back[name].dtype) == dtype, name
    ok = back["status"] == "ok"
    assert ok.any() and (~ok).any()
    assert (back.loc[ok, "attempts"] == 1).all() and (back.loc[~ok, "attempts"] == 0).all()
    for name in (*V2_COLUMNS[1:], *V3_COLUMNS):
        assert back[name].isna().all(), name
    np.testing.assert_allclose(back["latency_ms"], raw["latency_ms"], rtol=1e-12)
    assert (back["schema_version"] == 1).all()


def test_version_1_file_missing_one_of_its_columns_is_refused(tmp_path):
    path = tmp_path / "v1.csv"
    pd.read_csv(V1_FILE, dtype=str).drop(columns=["rel_err"]).to_csv(path, index=False)
    with pytest.raises(ResultFileError, match="'rel_err'") as err:
        read_results(path)
    assert str(path) in str(err.value)


def test_version_2_file_missing_a_version_2_column_is_refused(tmp_path):
    path = tmp_path / "v2.csv"
    frame = pd.read_csv(V1_FILE, dtype=str, keep_default_na=False)
    frame = frame.assign(schema_version="2", sm_clock_mhz="", mem_clock_mhz="",
                         gpu_temp_c="", gpu_power_w="")  # attempts missing
    frame.to_csv(path, index=False)
    with pytest.raises(ResultFileError, match="'attempts'") as err:
        read_results(path)
    assert err.value.column == "attempts"


def test_mixed_versions_in_one_file_are_refused(tmp_path):
    path = tmp_path / "mixed.csv"
    frame = pd.read_csv(V1_FILE, dtype=str, keep_default_na=False)
    frame.loc[0, "schema_version"] = "2"
    frame.to_csv(path, index=False)
    with pytest.raises(ResultFileError, match="several schema versions"):
        read_results(path)


def test_version_2_file_reads_with_the_traffic_columns_nan(tmp_path):
    path = tmp_path / "v2.csv"
    frame = pd.read_csv(V1_FILE, dtype=str, keep_default_na=False)
    frame = frame.assign(schema_version="2", attempts="2", sm_clock_mhz="1980",
                         mem_clock_mhz="", gpu_temp_c="", gpu_power_w="")
    frame.to_csv(path, index=False)
    back = read_results(path)
    assert list(back.columns) == [*COLUMN_NAMES, "source"]
    assert (back["attempts"] == 2).all() and (back["sm_clock_mhz"] == 1980).all()
    for name in V3_COLUMNS:
        assert back[name].isna().all() and str(back[name].dtype) == "float64", name


def test_version_3_file_missing_a_traffic_column_is_refused(tmp_path, rows):
    path = tmp_path / "v3.csv"
    rows.assign(schema_version=3).drop(columns=["tbps"]).to_csv(path, index=False)
    with pytest.raises(ResultFileError, match="'tbps'") as err:
        read_results(path)
    assert err.value.column == "tbps" and SCHEMA_VERSION == 3


def test_traffic_columns_round_trip(tmp_path, rows):
    rows = rows.assign(bytes=1.5e9, tbps=2.5, bw_frac=0.75)
    back = read_results(write_csv(rows, tmp_path / "t.csv"))
    assert (back["bytes"] == 1.5e9).all() and (back["bw_frac"] == 0.75).all()


def test_header_only_files_of_every_version_read_empty(tmp_path):
    for version in (1, 2, 3):
        path = tmp_path / f"h{version}.csv"
        path.write_text(",".join(columns_of(version)) + "\n")
        back = read_results(path)
        assert back.empty and list(back.columns) == [*COLUMN_NAMES, "source"]


def test_noisy_status_is_read():
    from attnbench.results.schema import STATUSES

    assert "noisy" in STATUSES
