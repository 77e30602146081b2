"""The dashboard builder: self-contained HTML with its plots, and the markdown summary."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest

from attnbench.cli import main
from attnbench.compare import geomean
from attnbench.report.build import build_report
from attnbench.report.sample import SampleSpec, sample_rows, write_csv
from attnbench.results.read import read_results
from attnbench.results.schema import STATUSES

SOFTMAX = SampleSpec(seqlens=(1024, 4096, 16384), variants=("causal", "alibi"))
VARIANTS = SampleSpec(suite="variants", variants=("softcap",), seqlens=(2048, 8192),
                      modes=("fwd", "fwd+bwd"), impls=("engine", "flex", "sdpa-cudnn"))


def make_results(root, rng, days=("2026-11-20", "2026-11-21", "2026-11-22")):
    """Committed-results layout with a few runs over commits and a promoted baseline."""
    for n, day in enumerate(days):
        sha = f"{n + 1:x}" * 40
        for spec in (SOFTMAX, VARIANTS):
            stamped = replace(spec, git_sha=sha, timestamp=f"{day}T10:0{n}:00Z")
            write_csv(sample_rows(rng, stamped), root / "runs" / f"{day}-h100-{spec.suite}.csv")
    first = read_results(root / "runs" / f"{days[0]}-h100-softmax.csv")
    write_csv(first, root / "baseline" / "h100.csv")
    return root


def expected_figures(suites=(SOFTMAX, VARIANTS)) -> int:
    # per suite: one TFLOP/s figure per variant + the speedup summary + the history
    return sum(len(s.variants) + 2 for s in suites)


def test_dashboard_is_self_contained_with_all_plots(tmp_path):
    rng = np.random.default_rng(7)
    results = make_results(tmp_path / "results", rng)
    out = build_report(results, tmp_path / "out")
    page = out.html.read_text()
    assert out.figures == expected_figures() and out.runs == 6
    assert page.count("Plotly.newPlot(") == out.figures
    assert len(re.findall(r'class="plotly-graph-div"', page)) == out.figures
    # plotly.js inlined exactly once; nothing fetched from the network
    assert len(re.findall(r"plotly\.js v\d", page)) == 1
    assert not re.search(r"<script[^>]+src=", page)
    # outside the inlined bundle (which mentions its CDN as an unused default) no URL at all
    head, rest = page.split("</head>", 1)
    assert "<link" not in head and "http" not in rest.replace("http://www.w3.org", "")
    for section in ("Suite softmax", "Suite variants", "history over commits",
                    "Environment of each run", "engine speedup", "accuracy"):
        assert section in page, section
    for n in range(1, 4):  # every commit of the history appears on the page
        assert f"{n:x}" * 7 in page


def test_summary_speedups_match_the_data(tmp_path):
    rng = np.random.default_rng(8)
    results = make_results(tmp_path / "results", rng)
    out = build_report(results, tmp_path / "out")
    md = out.markdown.read_text()
    assert md.startswith("## attnbench results") and "Gate " in md
    newest = read_results(results / "runs" / "2026-11-22-h100-softmax.csv")
    ok = newest[(newest["status"] == "ok") & (newest["variant"] == "alibi")
                & (newest["mode"] == "fwd")]
    lat = ok.pivot_table(index="case", columns="impl", values="latency_ms")
    want = geomean(lat["flex"] / lat["engine"])
    assert math.isfinite(want)
    line = next(ln for ln in md.splitlines() if ln.startswith("| alibi | fwd |"))
    assert f"{want:.2f}x" in line


def test_regressed_run_shows_a_failing_gate(tmp_path):
    rng = np.random.default_rng(9)
    results = make_results(tmp_path / "results", rng, days=("2026-11-20",))
    newest = results / "runs" / "2026-11-20-h100-softmax.csv"
    slow = read_results(newest)
    slow["latency_ms"] *= 1.5
    write_csv(slow, newest)
    out = build_report(results, tmp_path / "out")
    assert "Gate **FAIL**" in out.markdown.read_text()
    assert "gate fail" in out.html.read_text()


def test_empty_results_give_a_page_without_plots(tmp_path, capsys):
    out_dir = tmp_path / "dash"
    assert main(["report", "--results", str(tmp_path / "none"), "--out", str(out_dir)]) == 0
    page = (out_dir / "index.html").read_text()
    assert "No runs under" in page and "Plotly.newPlot" not in page
    assert "0 plots" in capsys.readouterr().out


def test_broken_result_file_is_named(tmp_path, capsys):
    rng = np.random.default_rng(10)
    results = make_results(tmp_path / "results", rng, days=("2026-11-20",))
    bad = results / "runs" / "2026-11-21-h100-softmax.csv"
    sample_rows(rng, SOFTMAX).drop(columns=["tflops"]).to_csv(bad, index=False)
    assert main(["report", "--results", str(results), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'tflops'" in err


@pytest.mark.parametrize("metric", ["latency_ms", "tflops"])
def test_report_cli_writes_both_files(tmp_path, metric, capsys):
    rng = np.random.default_rng(12)
    results = make_results(tmp_path / "results", rng, days=("2026-11-20", "2026-11-21"))
    out_dir = tmp_path / "dash"
    assert main(["report", "--results", str(results), "--out", str(out_dir),
                 "--metric", metric]) == 0
    assert (out_dir / "index.html").stat().st_size > 1_000_000  # plotly.js is inside
    assert metric in (out_dir / "summary.md").read_text()


# --- committed and local runs, the headline, noisy rows (issues 16 and 22) -----------------

LOCAL = SampleSpec(suite="smoke", variants=("causal",), seqlens=(128, 256), modes=("fwd",),
                   impls=("engine", "reference", "sdpa-math"), baseline="reference",
                   gpu="cpu", device="cpu", tokens=512)


def add_local_cpu_run(root, rng):
    """A CPU run where the runner writes it by default: results/local (not committed)."""
    stamped = replace(LOCAL, timestamp="2026-11-22T11:00:00Z")
    return write_csv(sample_rows(rng, stamped), root / "local" / "2026-11-22-cpu-smoke.csv")


def _expected_headline(rows):
    """(pairs, median, worst) of best-other latency / engine latency, computed row by row."""
    ok = rows[rows["status"] == "ok"]
    ratios = []
    for (_case, _mode), grp in ok.groupby(["case", "mode"]):
        lat = dict(zip(grp["impl"], grp["latency_ms"], strict=True))
        others = [v for impl, v in lat.items() if not impl.startswith("engine")]
        if "engine" in lat and others:
            ratios.append(min(others) / lat["engine"])
    return len(ratios), float(np.median(ratios)), min(ratios)


def test_headline_first_gpu_suites_first_and_origins_labelled(tmp_path):
    rng = np.random.default_rng(21)
    results = make_results(tmp_path / "results", rng, days=("2026-11-21", "2026-11-22"))
    local = add_local_cpu_run(results, rng)
    out = build_report(results, tmp_path / "out")
    page, md = out.html.read_text(), out.markdown.read_text()
    headline = page.index("<table class='headline'>")
    assert headline < page.index("id='gpu-h100'") < page.index("id='gpu-cpu'")
    table = page[headline:page.index("</table>", headline)]
    rows = table.split("<tr>")[2:]
    assert [re.search(r"#h100-(\w+)|#cpu-(\w+)", r).group(0) for r in rows] == [
        "#h100-softmax", "#h100-variants", "#cpu-smoke"]
    newest = {"softmax": read_results(results / "runs" / "2026-11-22-h100-softmax.csv"),
              "smoke": read_results(local)}
    for row, rows_of in ((rows[0], newest["softmax"]), (rows[2], newest["smoke"])):
        pairs, median, worst = _expected_headline(rows_of)
        assert f"<td class='num'>{pairs}</td>" in row
        assert f"{median:.2f}x" in row and f"{worst:.2f}x" in row
    assert "origin committed" in rows[0] and "origin local" in rows[2]
    assert "only local runs: not gated" in page
    assert f"<code>{local.name}</code> <span class='origin local'>" in page  # environment
    assert out.figures == expected_figures((SOFTMAX, VARIANTS, LOCAL)) and out.runs == 5
    assert md.index("| H100 | softmax |") < md.index("| CPU | smoke |") < md.index("### H100")


def test_noisy_rows_are_grey_and_left_out_of_the_headline():
    from attnbench.report.build import render_report, suite_headline

    rng = np.random.default_rng(22)
    rows = sample_rows(rng, SOFTMAX).assign(source="runs/2026-11-22-h100-softmax.csv")
    engine = rows[(rows["status"] == "ok") & (rows["impl"] == "engine")].index
    picked = rng.choice(engine, size=3, replace=False)
    noisy = rows.copy()
    noisy.loc[picked, "status"] = "noisy"
    noisy.loc[picked, "latency_ms"] *= 3.0  # an untrusted number, far off
    noisy.loc[picked, "tflops"] /= 3.0
    page = render_report(noisy, {}).html
    # greyed: the speedup cells of those rows, their accuracy cells, the problems table, a plot
    assert page.count("class='num noisy' title='noisy: not trusted'") >= len(picked)
    assert page.count("<tr class='noisy'>") == len(picked)
    assert '"name":"noisy (not trusted)"' in page
    # the headline leaves them out: the same as without those rows, not as with them as ok
    head = suite_headline("h100", "softmax", noisy)
    without = suite_headline("h100", "softmax", rows.drop(index=picked))
    as_ok = suite_headline("h100", "softmax", noisy.assign(status=rows["status"]))
    assert head.noisy == len(picked) and (head.median, head.worst) == (without.median,
                                                                       without.worst)
    assert as_ok.worst < head.worst
    plain = render_report(rows, {}).html  # the same rows, none noisy: nothing grey
    assert "num noisy" not in plain and "<tr class='noisy'>" not in plain
    assert '"name":"noisy (not trusted)"' not in plain


@pytest.mark.skipif("noisy" not in STATUSES,
                    reason="the result reader does not accept the noisy status yet (schema 2)")
def test_noisy_rows_from_files_are_grey(tmp_path):
    rng = np.random.default_rng(23)
    results = make_results(tmp_path / "results", rng, days=("2026-11-22",))
    path = results / "runs" / "2026-11-22-h100-softmax.csv"
    rows = read_results(path)
    picked = rows[(rows["status"] == "ok") & (rows["impl"] == "engine")].index[:2]
    rows.loc[picked, "status"] = "noisy"
    write_csv(rows, path)
    out = build_report(results, tmp_path / "out")
    page = out.html.read_text()
    assert page.count("<tr class='noisy'>") >= len(picked)
    assert "2 noisy (not judged)" in page


def test_bandwidth_table_only_for_rows_with_traffic():
    from attnbench.report.build import _bandwidth_table

    rows = sample_rows(np.random.default_rng(3), SampleSpec(seqlens=(1024,), variants=("causal",)))
    assert _bandwidth_table(rows) == ""  # attention rows: no traffic columns filled
    ok = rows["status"] == "ok"
    rows.loc[ok, "tbps"], rows.loc[ok, "bw_frac"] = 2.5, 0.746
    html = _bandwidth_table(rows)
    assert "TB/s" in html and "2.5 (75%)" in html
