"""The regression gate: noise rule, accuracy, status changes, baseline and the CLI."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnbench.baseline import baseline_path, merge_run, newest_runs, promote
from attnbench.cli import main
from attnbench.compare import GateRule, compare, comparison_markdown, dtype_tolerance
from attnbench.report.sample import SampleSpec, sample_rows, write_csv
from attnbench.results.read import KEY, read_results
from attnbench.results.schema import STATUSES

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
    # the vanished row is of a gated implementation: missing, a failure of its own
    assert cmp.missing == list(cmp.vanished)
    strict = compare(base, new, GateRule(strict=True, impls=EVERY_IMPL))
    assert len(strict.regressions) == 2 and strict.failed
    md = comparison_markdown(cmp, "base.csv", "new.csv")
    assert "FAIL" in md and "ok -> failed" in md and "Missing" in md and "Appeared" in md
    # gating only another implementation: the vanished row is listed, not gated
    other = compare(base, new, GateRule(impls=("no-such-impl",)))
    assert not other.missing and not other.failed
    assert "Vanished" in comparison_markdown(other, "base.csv", "new.csv")


def test_latest_of_repeated_rows_is_used(base, rng):
    i = _ok_index(base, rng)
    retry = base.loc[[i]].assign(timestamp="2026-11-23T00:00:00Z")
    later = base.assign(latency_ms=base["latency_ms"] * 1.5, timestamp="2026-11-22T12:00:00Z")
    new = pd.concat([later, retry])
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
    # no baseline yet: an error, unless --nothing-to-gate-ok (CI); the run is not empty
    assert main(["compare", "--against-baseline", *args]) == 2
    assert main(["compare", "--against-baseline", "--nothing-to-gate-ok", *args]) == 0
    assert "no baseline yet" in capsys.readouterr().out
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
    done = promote(new, results)
    assert done.path == baseline_path("h100", results) and done.noisy == 0
    merged = done.rows
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


# --- nothing measured is not a pass (issue 16) ---------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real entry point, in a subprocess at the repository root."""
    return subprocess.run([sys.executable, "-m", "attnbench", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _engine_keys(frame: pd.DataFrame) -> set:
    rows = frame[frame["impl"].str.startswith("engine")]
    return {tuple(r) for r in rows[list(KEY)].itertuples(index=False)}


def test_header_only_or_partial_run_fails_the_gate(tmp_path, base, rng):
    good = write_csv(base, tmp_path / "good.csv")
    header_only = write_csv(base.iloc[:0], tmp_path / "header_only.csv")
    done = _cli("compare", str(good), str(header_only))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gate: FAIL" in done.stdout and "the new run has no rows" in done.stdout
    assert f"{len(_engine_keys(base))} gated row(s) missing" in done.stdout

    # a run cut short: every row of one case is absent; only the engine's rows gate
    case = str(rng.choice(base["case"].unique()))
    partial = write_csv(base[base["case"] != case], tmp_path / "partial.csv")
    cmp = compare(base, read_results(partial))
    assert set(cmp.missing) == {k for k in _engine_keys(base) if k[1] == case}
    assert set(cmp.vanished) == {tuple(r) for r in base.loc[base["case"] == case, list(KEY)]
                                 .itertuples(index=False)}
    assert cmp.failed and not cmp.regressions
    assert main(["compare", str(good), str(partial)]) == 1
    # filtered on purpose: --allow-missing names the case (or the implementation)
    done = _cli("compare", str(good), str(partial), "--allow-missing", f"*{case[-12:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "excused by --allow-missing" in done.stdout
    excused = compare(base, read_results(partial), GateRule(allow_missing=("engine*",)))
    assert set(excused.excused) == set(cmp.missing) and not excused.failed
    # a pattern naming something else excuses nothing
    assert compare(base, read_results(partial), GateRule(allow_missing=("no-such*",))).failed


def test_a_suite_without_ok_rows_fails(base):
    other = base.assign(suite="other")
    new = pd.concat([base, other.assign(status="skipped", latency_ms=math.nan)])
    cmp = compare(pd.concat([base, other]), new)
    assert cmp.failed and not cmp.regressions and not cmp.missing
    assert cmp.empty == (f"suite other: no ok rows in the new run (of {len(other)})",)
    # the same skipped rows in a run of their own: no ok row at all
    alone = compare(other, other.assign(status="skipped"))
    assert alone.failed and "no ok rows" in alone.empty[0]
    assert not compare(pd.concat([base, other]), pd.concat([base, other])).failed


def test_rows_an_earlier_run_fills_in_are_missing(base, rng):
    """A day's file keeps every run of the day; a run cut short leaves the earlier run's rows
    (here: the very rows the baseline holds) standing in for the cases it did not reach."""
    cases = sorted(base["case"].unique())
    reached = set(cases[: len(cases) // 2])
    rerun = base[base["case"].isin(reached)].assign(timestamp="2026-11-23T09:00:00Z")
    day_file = pd.concat([base, rerun], ignore_index=True)
    cmp = compare(base, day_file)
    assert set(cmp.missing) == {k for k in _engine_keys(base) if k[1] not in reached}
    assert cmp.failed and any("not newer than the base" in n for n in cmp.notes)
    # the run completed later the same day (another commit, same kernels): nothing missing
    rest = base[~base["case"].isin(reached)].assign(timestamp="2026-11-23T11:00:00Z")
    complete = compare(base, pd.concat([day_file, rest], ignore_index=True))
    assert not complete.vanished and not complete.failed
    # the newest run is the baseline itself (just promoted): nothing was re-run, it passes
    assert not compare(base, base.copy()).failed


def test_nothing_to_gate_ok_excuses_only_the_absence_of_data(tmp_path, rng, capsys):
    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    args = ("compare", "--against-baseline", "--results", str(results))
    assert main(list(args)) == 2  # no run: an error naming the flag
    assert "--nothing-to-gate-ok" in capsys.readouterr().err
    done = _cli(*args, "--nothing-to-gate-ok")
    assert done.returncode == 0 and "nothing to gate, passing" in done.stdout
    # an empty run file committed under runs/ is an empty run, not "no run"
    rows = sample_rows(rng, SPEC)
    empty = write_csv(rows.iloc[:0], results / "runs" / "2026-11-23-h100-softmax.csv")
    done = _cli(*args, "--nothing-to-gate-ok")
    assert done.returncode == 1 and f"{empty}: an empty run" in done.stdout
    # with a baseline and a good run beside the empty one: still a failure
    good = write_csv(rows, results / "runs" / "2026-11-22-h100-softmax.csv")
    assert main(["baseline", "promote", str(good), "--results", str(results)]) == 0
    assert main([*args, "--nothing-to-gate-ok"]) == 1
    empty.unlink()
    assert main([*args, "--nothing-to-gate-ok"]) == 0
    # the old flag says what replaced it
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([*args, "--missing-ok"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--nothing-to-gate-ok" in err and "--allow-missing" in err


def test_rule_options_have_help_and_checks(capsys):
    done = _cli("compare", "--help")
    assert "--allow-missing PATTERN" in done.stdout
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    for text in (done.stdout, capsys.readouterr().out):
        text = " ".join(text.split())
        assert "combined interquartile spread" in text and "lower is better" in text
    done = _cli("compare", "a.csv", "b.csv", "--noise-k", "-1")
    assert done.returncode == 2 and "--noise-k" in done.stderr and "'-1'" in done.stderr
    with pytest.raises(SystemExit):
        main(["compare", "a.csv", "b.csv", "--allow-missing", ""])
    assert "argument --allow-missing: expected a glob" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allow_missing"):
        GateRule(allow_missing=("",))


# --- noisy rows (issue 22) ------------------------------------------------------------------

def _noisy(frame: pd.DataFrame, index, factor: float) -> pd.DataFrame:
    """Mark rows noisy the way the runner does: numbers kept, spread far above 5%."""
    out = frame.copy()
    out.loc[index, "status"] = "noisy"
    out.loc[index, "latency_ms"] *= factor
    out.loc[index, "tflops"] /= factor
    out.loc[index, "latency_spread_ms"] = out.loc[index, "latency_ms"] * 0.4
    return out


def test_noisy_rows_are_listed_never_judged(base, rng):
    engine = base[(base["status"] == "ok") & (base["impl"] == "engine")].index
    slow, fast = rng.choice(engine, size=2, replace=False)
    new = _noisy(base, [slow], 2.0)
    new = _noisy(new, [fast], 0.5)
    cmp = compare(base, new)
    assert not cmp.failed and not cmp.regressions and not cmp.faster
    noisy = {r.key: r for r in cmp.noisy}
    assert set(noisy) == {tuple(base.loc[i, list(KEY)]) for i in (slow, fast)}
    assert noisy[tuple(base.loc[slow, list(KEY)])].change == pytest.approx(1.0)
    assert all(r.status_change == "ok -> noisy" for r in cmp.noisy)
    assert cmp.counts()["noisy"] == 2
    md = comparison_markdown(cmp, "base", "new")
    assert "PASS" in md and "2 noisy" in md and "Noisy (" in md
    # a noisy base row is not judged either; a noisy row that now fails is a regression
    back = compare(new, base)
    assert not back.failed and len(back.noisy) == 2 and not back.faster
    worse = new.copy()
    worse.loc[slow, "status"] = "error"
    assert [r.key for r in compare(new, worse).regressions] == [
        tuple(base.loc[slow, list(KEY)])]
    # without the noisy status the same numbers are a regression (the test can fail)
    plain = new.copy()
    plain.loc[[slow, fast], "status"] = "ok"
    assert compare(base, plain).failed


def test_promote_onto_an_older_schema_writes_one_version(tmp_path, rng):
    """A baseline of version-1 rows and a newer run: the promoted file is read back whole
    (a file of mixed versions is refused by the reader)."""
    from attnbench.results.schema import SCHEMA_VERSION

    results, old, _ = _write_runs(tmp_path, rng)
    v1 = read_results(old).drop(columns=["attempts", "sm_clock_mhz", "mem_clock_mhz",
                                         "gpu_temp_c", "gpu_power_w"], errors="ignore")
    path = baseline_path("h100", results)
    path.parent.mkdir(parents=True, exist_ok=True)
    v1.assign(schema_version=1).to_csv(path, index=False)
    promote(results / "runs/2026-11-20-h100-variants.csv", results)
    merged = read_results(path)
    assert set(merged["schema_version"]) == {SCHEMA_VERSION}
    assert set(merged["suite"]) == {"softmax", "variants"}


def test_promote_leaves_noisy_rows_out(base, rng):
    current = base.copy()
    other = sample_rows(rng, SampleSpec(suite="variants", variants=("softcap",),
                                        seqlens=(4096,), impls=("engine", "flex")))
    current = pd.concat([current, other], ignore_index=True)
    run = base.assign(latency_ms=base["latency_ms"] * 0.9, timestamp="2026-11-23T10:00:00Z")
    ok = run[run["status"] == "ok"].index
    kept_i, fresh_i = rng.choice(ok, size=2, replace=False)
    run = _noisy(run, [kept_i, fresh_i], 3.0)
    # the second noisy key has no previous baseline row
    fresh_key = tuple(run.loc[fresh_i, list(KEY)])
    current = current[[tuple(r) != fresh_key
                       for r in current[list(KEY)].itertuples(index=False)]]
    merged, noisy, kept = merge_run(current, run)
    assert (noisy, kept) == (2, 1)
    assert (merged["status"] == "noisy").sum() == 0
    by_key = merged.set_index(list(KEY))
    kept_key = tuple(run.loc[kept_i, list(KEY)])
    assert by_key.loc[kept_key, "latency_ms"] == base.loc[kept_i, "latency_ms"]
    assert fresh_key not in by_key.index
    others = run.drop(index=[kept_i, fresh_i])
    promoted = by_key.loc[[tuple(r) for r in others[list(KEY)].itertuples(index=False)]]
    np.testing.assert_array_equal(promoted["latency_ms"], others["latency_ms"])
    assert (merged["suite"] == "variants").sum() == len(other)
    # every key once: the run's rows, the kept one, the other suite; none for the fresh key
    assert len(merged) == len(others) + 1 + len(other)
    # gating that run against the baseline just promoted from it: nothing missing, the noisy
    # rows (newer than the rows kept for them) listed apart
    cmp = compare(merged[merged["suite"] == "softmax"], run)
    assert not cmp.failed and len(cmp.noisy) == 1 and not cmp.notes


@pytest.mark.skipif("noisy" not in STATUSES,
                    reason="the result reader does not accept the noisy status yet (schema 2)")
def test_promote_cli_reports_the_noisy_rows_it_left_out(tmp_path, base, rng):
    results = tmp_path / "results"
    first = write_csv(base, results / "runs" / "2026-11-22-h100-softmax.csv")
    assert _cli("baseline", "promote", str(first), "--results", str(results)).returncode == 0
    ok = base[base["status"] == "ok"].index
    noisy_rows = _noisy(base.assign(timestamp="2026-11-23T10:00:00Z"),
                        rng.choice(ok, size=3, replace=False), 2.0)
    second = write_csv(noisy_rows, results / "runs" / "2026-11-23-h100-softmax.csv")
    done = _cli("baseline", "promote", str(second), "--results", str(results))
    assert done.returncode == 0, done.stderr
    assert "left out 3 noisy row(s) (kept the previous baseline row for 3 of them)" in done.stdout
    assert "noisy" not in set(read_results(baseline_path("h100", results))["status"])
    gate = _cli("compare", "--against-baseline", "--results", str(results))
    assert gate.returncode == 0 and "3 noisy (not judged)" in gate.stdout


# ---------------------------------------------------------------------- the same-run check
def _engine_and_ref(base: pd.DataFrame, rng) -> tuple[int, int]:
    """An ok engine row with an ok row of its case's baseline implementation: their indices."""
    ok = base[base["status"] == "ok"]
    for i in rng.permutation(ok[ok["impl"] == "engine"].index):
        r = base.loc[i]
        ref = ok[(ok["suite"] == r["suite"]) & (ok["case"] == r["case"])
                 & (ok["mode"] == r["mode"]) & (ok["impl"] == r["baseline"])]
        if len(ref):
            return int(i), int(ref.index[0])
    raise AssertionError("no engine row with a reference row")


def _slow(frame: pd.DataFrame, rows: list[int], factor: float) -> pd.DataFrame:
    new = frame.copy()
    new.loc[rows, "latency_ms"] *= factor
    new.loc[rows, "latency_spread_ms"] = 0.0
    return new


@pytest.fixture
def quiet(base) -> pd.DataFrame:
    """The sample with spreads of zero, so that the threshold alone decides."""
    return base.assign(latency_spread_ms=0.0)


def test_same_run_check_calls_a_run_wide_slowdown_clock(quiet, rng):
    i, ref = _engine_and_ref(quiet, rng)
    factor = rng.uniform(1.08, 1.2)
    new = _slow(quiet, [i, ref], factor)  # the whole run slower alike: its clock
    assert compare(quiet, new, GateRule()).failed
    cmp = compare(quiet, new, GateRule(same_run=True))
    assert not cmp.failed and cmp.counts()["clock"] == 1
    row = _by_key(cmp, quiet.loc[i])
    assert row.perf == "clock" and row.reasons == () and row.ratio_change == pytest.approx(0)
    assert row.change == pytest.approx(factor - 1)


def test_same_run_check_keeps_a_slowdown_of_the_row_alone(quiet, rng):
    i, _ref = _engine_and_ref(quiet, rng)
    factor = rng.uniform(1.08, 1.2)
    cmp = compare(quiet, _slow(quiet, [i], factor), GateRule(same_run=True))
    assert cmp.failed and [r.key for r in cmp.regressions] == [tuple(quiet.loc[i, list(KEY)])]
    assert "same run's baseline" in cmp.regressions[0].reasons[-1]


def test_same_run_check_ignores_a_baseline_that_got_faster(quiet, rng):
    i, ref = _engine_and_ref(quiet, rng)
    cmp = compare(quiet, _slow(quiet, [ref], 0.6), GateRule(same_run=True))
    assert not cmp.failed and _by_key(cmp, quiet.loc[i]).perf == "same"


def test_same_run_check_without_a_reference_judges_latency(quiet, rng):
    i, ref = _engine_and_ref(quiet, rng)
    new = _slow(quiet, [i, ref], 1.15)
    new.loc[ref, ["status", "latency_ms"]] = ["skipped", math.nan]  # no reference in the run
    cmp = compare(quiet, new, GateRule(same_run=True))
    assert cmp.failed and _by_key(cmp, quiet.loc[i]).regression


def test_cli_same_run_flag(quiet, rng, tmp_path, capsys):
    i, ref = _engine_and_ref(quiet, rng)
    base_csv, new_csv = tmp_path / "base.csv", tmp_path / "new.csv"
    write_csv(quiet, base_csv)
    write_csv(_slow(quiet, [i, ref], 1.12), new_csv)
    assert main(["compare", str(base_csv), str(new_csv)]) == 1
    assert main(["compare", str(base_csv), str(new_csv), "--same-run"]) == 0
    out = capsys.readouterr().out
    assert "same-run check" in out and "clock (x the same run's baseline" in out
