"""Build the static dashboard (one self-contained HTML file) and a markdown summary.

Plots use plotly: interactive hover and zoom matter when reading dozens of implementation lines,
and plotly.js can be inlined once per page (about 4.7 MB) so the file opens from disk with no
server and no network. Everything else on the page is plain HTML tables.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from attnbench.baseline import newest_runs
from attnbench.compare import (
    Comparison,
    GateRule,
    compare,
    comparison_markdown,
    dtype_tolerance,
    geomean,
)
from attnbench.report import plots
from attnbench.results.read import gpu_slug, read_many, read_results, run_files
from engine.fsutil import atomic_write_text

ENGINE_IMPL = "engine"  # the implementation whose speedup over every other one is shown


@dataclass(frozen=True)
class ReportOutput:
    html: Path
    markdown: Path
    figures: int  # plot count on the page; the browser test checks they all rendered
    runs: int


def write_text(path: Path | str, text: str) -> Path:
    """Write a text file atomically (temp file in the same folder, fsync, rename)."""
    return atomic_write_text(path, text)


def build_report(
    results_dir: Path | str, out_dir: Path | str, rule: GateRule | None = None
) -> ReportOutput:
    """Read results/runs and results/baseline; write index.html and summary.md into out_dir."""
    rule = rule or GateRule()
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    runs = read_many(run_files(results_dir / "runs"))
    runs["gpu_slug"] = runs["gpu"].map(gpu_slug).astype("string")
    page = _Page()
    md: list[str] = ["## attnbench results", ""]

    if runs.empty:
        page.add(f"<p class='empty'>No committed runs under "
                 f"<code>{_e(results_dir / 'runs')}</code> yet.</p>")
        md.append("No committed runs yet.")
    for gpu in sorted(runs["gpu_slug"].dropna().unique()):
        latest, _sources = newest_runs(results_dir / "runs", gpu)
        _gpu_section(page, md, results_dir, gpu, latest, runs[runs["gpu_slug"] == gpu], rule)
    _environment_section(page, runs)

    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    html_path = write_text(out_dir / "index.html", page.render(generated))
    md_path = write_text(out_dir / "summary.md", "\n".join(md).rstrip() + "\n")
    n_runs = runs["source"].nunique() if not runs.empty else 0
    return ReportOutput(html_path, md_path, page.figures, int(n_runs))


def _gpu_section(page, md, results_dir, gpu, latest, history, rule) -> None:
    page.heading(2, f"{gpu.upper()}", f"gpu-{gpu}")
    md += [f"### {gpu.upper()}", ""]
    base_path = results_dir / "baseline" / f"{gpu}.csv"
    if base_path.exists():
        base = read_results(base_path)
        base = base[base["suite"].isin(set(latest["suite"]))]
        cmp = compare(base, latest, rule)
        new_label = ", ".join(sorted({Path(s).name for s in latest["source"]}))
        page.add(_gate_html(cmp, base_path.name, new_label))
        md.append(comparison_markdown(cmp, f"baseline/{base_path.name}", new_label, limit=10))
    else:
        page.add(f"<p>No baseline for {_e(gpu)} yet (<code>attnbench baseline promote RUN"
                 f"</code> creates <code>{_e(base_path)}</code>).</p>")
        md += [f"No baseline for {gpu} yet.", ""]

    for suite, rows in latest.groupby("suite", sort=True):
        src = ", ".join(sorted({Path(s).name for s in rows["source"]}))
        shas = ", ".join(sorted({str(s)[:10] for s in rows["git_sha"].dropna()}))
        page.heading(3, f"Suite {suite}", f"{gpu}-{suite}")
        page.add(f"<p class='meta'>latest run: <code>{_e(src)}</code>, git {_e(shas)}, "
                 f"{(rows['status'] == 'ok').sum()} ok of {len(rows)} rows</p>")
        md += [f"**{suite}** (`{src}`)", ""]
        md += _speedup_markdown(rows)
        for variant, vrows in rows.groupby("variant", sort=True, dropna=False):
            page.heading(4, f"{suite} / {variant}", f"{gpu}-{suite}-{variant}")
            page.figure(plots.tflops_over_seqlen(vrows, f"{suite} / {variant}: TFLOP/s"))
            page.add(_speedup_table(vrows))
            page.add(_accuracy_table(vrows))
        fig = plots.engine_speedup_bars(rows, ENGINE_IMPL, f"{suite}: {ENGINE_IMPL} speedup "
                                        "over each implementation (geomean over cases)")
        if fig is not None:
            page.heading(4, f"{suite}: speedup summary", f"{gpu}-{suite}-speedup")
            page.figure(fig)
        hist = history[history["suite"] == suite]
        page.heading(4, f"{suite}: history over commits", f"{gpu}-{suite}-history")
        page.add("<p class='meta'>geomean TFLOP/s over each run's ok cases (hover for the "
                 "count); one point per committed run file.</p>")
        page.figure(plots.history(hist, f"{suite} on {gpu}: history"))
        page.add(_problems_table(rows))


def _gate_html(cmp: Comparison, base_label: str, new_label: str) -> str:
    c = cmp.counts()
    cls = "fail" if cmp.failed else "pass"
    head = (f"<div class='gate {cls}'><b>Gate {'FAIL' if cmp.failed else 'pass'}</b>: "
            f"<code>{_e(new_label)}</code> against baseline <code>{_e(base_label)}</code> "
            f"({_e(cmp.rule.metric)}, threshold {cmp.rule.threshold:.0%}, noise "
            f"k={cmp.rule.noise_k:g}): {c['faster']} faster, {c['slower']} slower, "
            f"{c['noise']} inside the noise, {c['same']} unchanged, "
            f"{c['accuracy regressions']} accuracy regressions, {c['appeared']} appeared, "
            f"{c['vanished']} vanished.</div>")
    changed = [r for r in cmp.rows if r.regression or r.perf in ("faster", "noise")]
    if not changed:
        return head
    body = "".join(
        f"<tr class='{'bad' if r.regression else ('good' if r.perf == 'faster' else '')}'>"
        + "".join(f"<td>{_e(k)}</td>" for k in r.key)
        + f"<td class='num'>{_fmt(r.base)}</td><td class='num'>{_fmt(r.new)}</td>"
        f"<td class='num'>{_pct(r.change)}</td><td>{_e('; '.join(r.reasons) or r.perf)}</td></tr>"
        for r in sorted(changed, key=lambda r: (not r.regression, r.key))
    )
    return (head + "<details><summary>changed rows</summary><table><tr><th>suite</th>"
            "<th>case</th><th>impl</th><th>mode</th><th>base</th><th>new</th><th>change</th>"
            f"<th>verdict</th></tr>{body}</table></details>")


def _case_frame(rows: pd.DataFrame) -> pd.DataFrame:
    ok = rows[rows["status"] == "ok"]
    return ok.sort_values(["dtype", "mode", "seqlen_q", "case"], kind="stable")


def _speedup_table(rows: pd.DataFrame) -> str:
    ok = _case_frame(rows)
    lat = ok.pivot_table(index=["case", "mode"], columns="impl", values="latency_ms",
                         aggfunc="median", sort=False)
    if ENGINE_IMPL not in lat.columns:
        return f"<p class='meta'>No ok {ENGINE_IMPL} rows: no speedup table.</p>"
    others = [c for c in lat.columns if c != ENGINE_IMPL]
    head = "".join(f"<th>vs {_e(c)}</th>" for c in others)
    body = []
    for (case, mode), r in lat.iterrows():
        cells = "".join(_speedup_cell(r[c] / r[ENGINE_IMPL]) for c in others)
        body.append(f"<tr><td>{_e(case)}</td><td>{_e(mode)}</td>{cells}</tr>")
    geo = "".join(_speedup_cell(geomean(lat[c] / lat[ENGINE_IMPL])) for c in others)
    body.append(f"<tr class='total'><td>geomean</td><td></td>{geo}</tr>")
    return (f"<details open><summary>{ENGINE_IMPL} speedup (other latency / {ENGINE_IMPL} "
            f"latency)</summary><table><tr><th>case</th><th>mode</th>{head}</tr>"
            f"{''.join(body)}</table></details>")


def _speedup_cell(v: float) -> str:
    if not math.isfinite(v):
        return "<td class='num'>-</td>"
    cls = "good" if v >= 1.05 else ("bad" if v <= 0.95 else "")
    return f"<td class='num {cls}'>{v:.2f}x</td>"


def _accuracy_table(rows: pd.DataFrame) -> str:
    ok = _case_frame(rows)
    err = ok.pivot_table(index=["case", "mode", "dtype"], columns="impl", values="rel_err",
                         aggfunc="max", sort=False, dropna=False)
    if err.empty:
        return ""
    head = "".join(f"<th>{_e(c)}</th>" for c in err.columns)
    body = []
    for (case, mode, dtype), r in err.iterrows():
        try:
            tol = dtype_tolerance(dtype)
        except ValueError:
            tol = math.nan
        cells = "".join(_err_cell(r[c], tol) for c in err.columns)
        body.append(f"<tr><td>{_e(case)}</td><td>{_e(mode)}</td><td class='num'>{tol:.0e}</td>"
                    f"{cells}</tr>")
    return ("<details><summary>accuracy: rel_err against the reference (red: beyond the dtype "
            f"tolerance or NaN)</summary><table><tr><th>case</th><th>mode</th><th>tolerance</th>"
            f"{head}</tr>{''.join(body)}</table></details>")


def _err_cell(v: float, tol: float) -> str:
    if pd.isna(v):
        return "<td class='num'>-</td>"
    bad = not math.isfinite(v) or (math.isfinite(tol) and v > tol)
    return f"<td class='num{' bad' if bad else ''}'>{v:.2e}</td>"


def _problems_table(rows: pd.DataFrame) -> str:
    bad = rows[rows["status"] != "ok"]
    if bad.empty:
        return ""
    body = "".join(
        f"<tr class='{'bad' if s in ('failed', 'error') else ''}'><td>{_e(c)}</td><td>{_e(i)}"
        f"</td><td>{_e(m)}</td><td>{_e(s)}</td><td>{_e(r)}</td></tr>"
        for c, i, m, s, r in bad[["case", "impl", "mode", "status", "reason"]].itertuples(
            index=False)
    )
    return (f"<details><summary>{len(bad)} row(s) not ok (skipped / failed / error)</summary>"
            "<table><tr><th>case</th><th>impl</th><th>mode</th><th>status</th><th>reason</th>"
            f"</tr>{body}</table></details>")


def _speedup_markdown(rows: pd.DataFrame) -> list[str]:
    ok = rows[rows["status"] == "ok"]
    lat = ok.pivot_table(index=["variant", "case", "mode"], columns="impl",
                         values="latency_ms", aggfunc="median")
    if ENGINE_IMPL not in lat.columns:
        return [f"No ok {ENGINE_IMPL} rows.", ""]
    others = [c for c in lat.columns if c != ENGINE_IMPL]
    out = ["| variant | mode | " + " | ".join(f"vs {c}" for c in others) + " |",
           "|---|---|" + "---:|" * len(others)]
    for (variant, mode), grp in lat.groupby(level=["variant", "mode"]):
        cells = [geomean(grp[c] / grp[ENGINE_IMPL]) for c in others]
        out.append(f"| {variant} | {mode} | "
                   + " | ".join("-" if math.isnan(v) else f"{v:.2f}x" for v in cells) + " |")
    return [f"{ENGINE_IMPL} speedup, geomean over cases:", "", *out, ""]


def _environment_section(page, runs: pd.DataFrame) -> None:
    page.heading(2, "Environment of each run", "environment")
    if runs.empty:
        page.add("<p>No runs.</p>")
        return
    cols = ["gpu", "driver", "cuda", "torch", "triton", "tilelang", "git_sha", "device"]
    body = []
    for source, grp in sorted(runs.groupby("source"), key=lambda kv: Path(kv[0]).name):
        vals = ["<br>".join(_e(v) for v in sorted({str(x) for x in grp[c].dropna()}))
                for c in cols]
        stamps = grp["timestamp"].dropna()
        when = f"{stamps.min()} .. {stamps.max()}" if len(stamps) else "-"
        counts = grp["status"].value_counts()
        status = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "skipped", "failed",
                                                                "error") if counts.get(s, 0))
        body.append(f"<tr><td><code>{_e(Path(source).name)}</code></td>"
                    + "".join(f"<td>{v}</td>" for v in vals)
                    + f"<td>{_e(when)}</td><td>{_e(status)}</td></tr>")
    head = "".join(f"<th>{c}</th>" for c in ["file", *cols, "measured (UTC)", "rows"])
    page.add(f"<table class='env'><tr>{head}</tr>{''.join(body)}</table>")


def _fmt(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.4g}"


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:+.1%}"


def _e(v) -> str:
    return html.escape(str(v))


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 28px}
header h1{margin:0;font-size:22px} header p{margin:4px 0 0;color:#c4cad6}
main{padding:8px 28px 40px;max-width:1500px}
nav{columns:3;font-size:13px;margin:10px 0 20px}
nav a{display:block;color:#2856b6;text-decoration:none}
h2{border-bottom:2px solid #1d2330;padding-bottom:4px;margin-top:36px}
h3{margin-top:28px;color:#2856b6} h4{margin:22px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:12.5px}
th,td{border:1px solid #d8dce4;padding:3px 8px;text-align:left}
th{background:#f1f3f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
.good{background:#e3f4e6} .bad{background:#fbe3e3} tr.total td{font-weight:600}
.gate{padding:8px 12px;border-radius:4px;margin:10px 0}
.gate.pass{background:#e3f4e6;border:1px solid #8cc79a}
.gate.fail{background:#fbe3e3;border:1px solid #de8a8a}
.meta{color:#5b6475;font-size:13px;margin:2px 0} summary{cursor:pointer;color:#2856b6}
.plot{margin:4px 0 10px} .empty{font-size:16px;color:#5b6475}
"""


class _Page:
    """Accumulates body parts and a table of contents; inlines plotly.js once at render."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.toc: list[tuple[int, str, str]] = []
        self.figures = 0

    def add(self, fragment: str) -> None:
        if fragment:
            self.parts.append(fragment)

    def heading(self, level: int, text: str, anchor: str) -> None:
        anchor = "".join(ch if ch.isalnum() else "-" for ch in anchor.lower())
        self.toc.append((level, text, anchor))
        self.parts.append(f"<h{level} id='{anchor}'>{_e(text)}</h{level}>")

    def figure(self, fig) -> None:
        if fig is None:
            self.add("<p class='meta'>Nothing to plot.</p>")
            return
        self.figures += 1
        self.parts.append(plots.to_div(fig, f"fig{self.figures}"))

    def render(self, generated: str) -> str:
        toc = "".join(f"<a href='#{a}' style='padding-left:{(lvl - 2) * 14}px'>{_e(t)}</a>"
                      for lvl, t, a in self.toc if lvl <= 3)
        script = plots.plotlyjs() if self.figures else ""
        return (
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<title>attnbench dashboard</title>"
            f"<style>{_CSS}</style><script>{script}</script></head><body>"
            f"<header><h1>attnbench dashboard</h1><p>built {generated} from the committed "
            f"results; {self.figures} plots</p></header><main><nav>{toc}</nav>"
            f"{''.join(self.parts)}</main></body></html>"
        )

