"""The regression gate: noise rule, accuracy, status changes, baseline and the CLI."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from attnbench.baseline import baseline_path, newest_runs, promote
from attnbench.cli import main
from attnbench.compare import GateRule, compare, comparison_markdown, dtype_tolerance
from attnbench.report.sample import SampleSpec, sample_rows, write_csv
from attnbench.results.read import KEY, read_results

# These tests exercise the gate's rules on rows of any implementation.
EVERY_IMPL = ("*",)
SPEC = SampleSpec(seqlens=(2048, 8192), variants=("causal",), dtypes=("bf16", "fp16"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


@pytest.fixture
def base(rng) -> pd.DataFrame:
    return sample_rows(rng, SPEC)


def _ok_index(frame: pd.DataFrame, rng, impl: str | None = None) -> int:
    ok = frame[(frame["status"] == "ok") & ((frame["impl"] == impl) if impl else True)]
    return int(rng.choice(ok.index))


def _by_key(cmp, row) -> object:
    key = tuple(str(row[k]) for k in KEY)
    return next(r for r in cmp.rows if r.key == key)


def test_identical_runs_pass(base):
    cmp = compare(base, base.copy())
    assert not cmp.failed and not cmp.appeared and not cmp.vanished
    assert {r.perf for r in cmp.rows} <= {"same", "n/a"}
    assert all(r.accuracy in ("ok", "n/a") for r in cmp.rows)


def test_slowdown_beyond_threshold_and_noise_is_a_regression(base, rng):
    i = _ok_index(base, rng, "engine")
    new = base.copy()
    factor = rng.uniform(1.12, 1.3)
    new.loc[i, "latency_ms"] *= factor
    new.loc[i, "tflops"] /= factor
    for metric in ("latency_ms", "tflops"):
        cmp = compare(base, new, GateRule(metric=metric))
        assert cmp.failed, metric
        assert [r.key for r in cmp.regressions] == [tuple(base.loc[i, list(KEY)])]
        assert cmp.regressions[0].change == pytest.approx(
            factor - 1 if metric == "latency_ms" else 1 / factor - 1)
    # the same slowdown under a looser threshold passes
    assert not compare(base, new, GateRule(threshold=0.35)).failed


def test_slowdown_inside_the_spread_is_noise(base, rng):
    i = _ok_index(base, rng)
    new = base.copy()
    lat = base.loc[i, "latency_ms"]
    new.loc[i, "latency_ms"] = lat * 1.08
    # spreads of 7% on each side: sqrt(2) * 7% = 9.9% > 8% slowdown
    new.loc[i, "latency_spread_ms"] = lat * 0.07
    wide = base.copy()
    wide.loc[i, "latency_spread_ms"] = lat * 0.07
    cmp = compare(wide, new, GateRule(impls=EVERY_IMPL))
    row = _by_key(cmp, base.loc[i])
    assert row.perf == "noise" and not row.regression and not cmp.failed
    assert row.noise == pytest.approx(math.hypot(lat * 0.07, lat * 0.07))
    # k = 0.5 halves the noise bound: now it is a regression
    assert compare(wide, new, GateRule(noise_k=0.5, impls=EVERY_IMPL)).failed


def test_speedup_is_reported_not_gated(base, rng):
    i = _ok_index(base, rng)
    new = base.copy()
    new.loc[i, "latency_ms"] *= 0.8
    cmp = compare(base, new, GateRule(impls=EVERY_IMPL))
    assert not cmp.failed
    row = _by_key(cmp, base.loc[i])
    assert row.perf == "faster" and row.speedup == pytest.approx(1.25)
    assert cmp.faster == [row]


def test_accuracy_past_tolerance_or_nan_is_a_regression(base, rng):
    i, j = rng.choice(base[base["status"] == "ok"].index, size=2, replace=False)
    new = base.copy()
    tol = dtype_tolerance(base.loc[i, "dtype"])
    new.loc[i, "rel_err"] = tol * rng.uniform(1.5, 4)
    new.loc[j, "rel_err"] = math.nan
    cmp = compare(base, new, GateRule(impls=EVERY_IMPL))
    assert {r.key for r in cmp.regressions} == {
        tuple(base.loc[i, list(KEY)]), tuple(base.loc[j, list(KEY)])}
    assert all(r.accuracy == "regressed" for r in cmp.regressions)
    # a row already beyond tolerance in the base is reported but not gated
    old_bad = base.copy()
    old_bad.loc[i, "rel_err"] = tol * 5
    again = compare(old_bad, new.assign(rel_err=new["rel_err"].fillna(1e-4)), GateRule(impls=EVERY_IMPL))
    assert _by_key(again, base.loc[i]).accuracy == "out-of-tolerance" and not again.failed


def test_status_changes_and_appeared_vanished(base, rng):
    ok = base[base["status"] == "ok"]
    i, j = rng.choice(ok.index, size=2, replace=False)
    new = base.copy()
    new.loc[i, ["status", "latency_ms", "tflops"]] = ["failed", math.nan, math.nan]
    new.loc[j, ["status", "latency_ms", "tflops"]] = ["skipped", math.nan, math.nan]
    gone = new.index[-1]
    extra = new.iloc[[0]].assign(impl="sdpa-flash")
    new = pd.concat([new.drop(index=gone), extra], ignore_index=True)
    cmp = compare(base, new, GateRule(impls=EVERY_IMPL))
    assert [r.key for r in cmp.regressions] == [tuple(base.loc[i, list(KEY)])]
    assert cmp.regressions[0].status_change == "ok -> failed"
    assert cmp.appeared == (tuple(extra.iloc[0][list(KEY)]),)
    assert cmp.vanished == (tuple(base.loc[gone, list(KEY)]),)
    strict = compare(base, new, GateRule(strict=True, impls=EVERY_IMPL))
    assert len(strict.regressions) == 2 and strict.failed
    md = comparison_markdown(cmp, "base.csv", "new.csv")
    assert "FAIL" in md and "ok -> failed" in md and "Vanished" in md and "Appeared" in md


def test_latest_of_repeated_rows_is_used(base, rng):
    i = _ok_index(base, rng)
    retry = base.loc[[i]].assign(timestamp="2026-11-23T00:00:00Z")
    new = pd.concat([base.assign(latency_ms=base["latency_ms"] * 1.5), retry])
    cmp = compare(base, new, GateRule(impls=EVERY_IMPL))
    assert not _by_key(cmp, base.loc[i]).regression
    assert len(cmp.regressions) == (base["status"] == "ok").sum() - 1
    assert any("repeated" in n for n in cmp.notes)


def test_rule_and_tolerance_validation():
    assert dtype_tolerance("torch.bfloat16") == dtype_tolerance("bf16") == 1e-2
    with pytest.raises(ValueError, match="dtype"):
        dtype_tolerance("int8")
    with pytest.raises(ValueError, match="metric"):
        GateRule(metric="speed")
    with pytest.raises(ValueError, match="threshold"):
        GateRule(threshold=-0.1)


def _write_runs(tmp_path, rng):
    runs = tmp_path / "results" / "runs"
    spec = replace(SPEC, timestamp="2026-11-20T08:00:00Z")
    old = write_csv(sample_rows(rng, spec), runs / "2026-11-20-h100-softmax.csv")
    other = SampleSpec(suite="variants", variants=("softcap",), seqlens=(4096,),
                       impls=("engine", "flex"), baseline="flex",
                       timestamp="2026-11-20T09:00:00Z")
    write_csv(sample_rows(rng, other), runs / "2026-11-20-h100-variants.csv")
    new_rows = read_results(old).assign(timestamp="2026-11-22T09:00:00Z", git_sha="f" * 40)
    new = write_csv(new_rows, runs / "2026-11-22-h100-softmax.csv")
    return tmp_path / "results", old, new


def test_promote_and_against_baseline(tmp_path, rng, capsys):
    results, old, new = _write_runs(tmp_path, rng)
    args = ["--results", str(results)]
    # no baseline yet: an error, unless --missing-ok (CI)
    assert main(["compare", "--against-baseline", *args]) == 2
    assert main(["compare", "--against-baseline", "--missing-ok", *args]) == 0
    assert "nothing to gate" in capsys.readouterr().out
    assert main(["baseline", "promote", str(old), *args]) == 0
    assert main(["baseline", "promote", str(results / "runs/2026-11-20-h100-variants.csv"),
                 *args]) == 0
    base = read_results(baseline_path("h100", results))
    assert set(base["suite"]) == {"softmax", "variants"}
    rows, sources = newest_runs(results / "runs", "NVIDIA H100 80GB HBM3")
    assert {s.name for s in sources} == {"2026-11-22-h100-softmax.csv",
                                         "2026-11-20-h100-variants.csv"}
    assert main(["compare", "--against-baseline", *args]) == 0
    # a regression in the newest run fails the gate, naming the row
    slow = read_results(new)
    i = slow.index[(slow["status"] == "ok") & (slow["impl"] == "engine")][0]
    slow.loc[i, "latency_ms"] *= 1.3
    write_csv(slow, new)
    capsys.readouterr()
    assert main(["compare", "--against-baseline", *args]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and slow.loc[i, "case"] in out and "gate: FAIL" in out
    # promoting the new run again replaces only the softmax rows
    path, merged = promote(new, results)
    assert path == baseline_path("h100", results)
    assert (merged["suite"] == "variants").sum() == (base["suite"] == "variants").sum()
    assert main(["compare", "--against-baseline", *args]) == 0


def test_cli_two_files_threshold_and_bad_input(tmp_path, base, capsys):
    a = write_csv(base, tmp_path / "a.csv")
    slower = base.assign(latency_ms=base["latency_ms"] * 1.07)
    b = write_csv(slower, tmp_path / "b.csv")
    assert main(["compare", str(a), str(b)]) == 1
    assert main(["compare", str(a), str(b), "--threshold", "10%"]) == 0
    assert main(["compare", str(a), str(b), "--threshold", "0.1"]) == 0
    with pytest.raises(SystemExit):
        main(["compare", str(a), str(b), "--threshold", "10"])
    md = tmp_path / "out" / "gate.md"
    assert main(["compare", str(a), str(b), "--markdown", str(md)]) == 1
    assert "FAIL" in md.read_text()
    broken = tmp_path / "broken.csv"
    base.drop(columns=["latency_spread_ms"]).to_csv(broken, index=False)
    capsys.readouterr()
    assert main(["compare", str(a), str(broken)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "latency_spread_ms" in err


def test_reference_implementations_drift_without_failing_the_gate(base, rng):
    """A slower FA3/cuDNN row is reported as drift; only engine rows (or --gate-impl) gate."""
    ref = base[(base["status"] == "ok") & ~base["impl"].str.startswith("engine")]
    i = int(rng.choice(ref.index))
    new = base.copy()
    new.loc[i, "latency_ms"] *= 2.0
    new.loc[i, "tflops"] /= 2.0
    cmp = compare(base, new)
    assert not cmp.failed and [r.key for r in cmp.drift] == [tuple(base.loc[i, list(KEY)])]
    assert "drift, not gated" in comparison_markdown(cmp, "base", "new")
    everything = compare(base, new, GateRule(impls=("*",)))
    assert everything.failed and not everything.drift
    with pytest.raises(ValueError, match="impls"):
        GateRule(impls=())
