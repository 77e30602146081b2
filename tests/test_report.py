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
    assert "No committed runs" in page and "Plotly.newPlot" not in page
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
