"""Build the static dashboard (one self-contained HTML file) and a markdown summary.

Plots use plotly: interactive hover and zoom matter when reading dozens of implementation lines,
and plotly.js can be inlined once per page (about 4.7 MB) so the file opens from disk with no
server and no network. Everything else on the page is plain HTML tables.

Runs come from results/runs (committed) and results/local (a machine's own runs, git-ignored);
each run is labelled with its origin. Only committed runs are gated against the baseline, as in
CI. Noisy rows (status `noisy`) are drawn grey and left out of speedup summaries.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from pathlib import Path

import pandas as pd

from attnbench.baseline import against_baseline, gate, newest_per_suite
from attnbench.compare import (
    RAN,
    Comparison,
    GateRule,
    comparison_markdown,
    dtype_tolerance,
    geomean,
    perf_summary,
    rule_text,
)
from attnbench.report import plots
from attnbench.results.read import read_many, run_files
from engine.fsutil import atomic_write_text
from engine.gpus import gpu_model

ENGINE_IMPL = "engine"  # the implementation whose speedup over every other one is shown
ENGINE_FAMILY = "engine*"  # its siblings (engine-dynamic, ...): not rivals in the headline
ORIGINS = (("runs", "committed"), ("local", "local"))  # results/<folder>, label


@dataclass(frozen=True)
class ReportOutput:
    html: Path
    markdown: Path
    figures: int  # plot count on the page; the browser test checks they all rendered
    runs: int


@dataclass(frozen=True)
class Rendered:
    html: str
    markdown: str
    figures: int


@dataclass(frozen=True)
class Headline:
    """One suite's newest run: the engine against the best other implementation, per case and
    mode, as best-other latency / engine latency (> 1: the engine is faster)."""

    gpu: str
    suite: str
    run: str  # file name of the newest run
    origin: str  # committed | local
    pairs: int  # (case, mode) pairs where the engine and another implementation ran ok
    median: float = math.nan
    worst: float = math.nan
    worst_at: str = ""  # "case mode vs impl"
    rivals: str = ""  # which implementation was the best other, and how often
    noisy: int = 0  # noisy rows left out


# per GPU: the gate against the baseline, or why there is none
GateView = tuple[Comparison, str, str] | str


def write_text(path: Path | str, text: str) -> Path:
    """Write a text file atomically (temp file in the same folder, fsync, rename)."""
    return atomic_write_text(path, text)


def load_runs(results_dir: Path | str) -> pd.DataFrame:
    """Every run file of results/runs and results/local, with `origin` and `gpu_model` columns."""
    frames = []
    for folder, origin in ORIGINS:
        frame = read_many(run_files(Path(results_dir) / folder))
        frames.append(frame.assign(origin=pd.Series(origin, index=frame.index, dtype="string")))
    runs = pd.concat([f for f in frames if not f.empty] or frames[:1], ignore_index=True)
    runs["gpu_model"] = runs["gpu"].map(gpu_model).astype("string")
    return runs


def build_report(
    results_dir: Path | str, out_dir: Path | str, rule: GateRule | None = None
) -> ReportOutput:
    """Read results/runs, results/local and results/baseline; write index.html and summary.md."""
    rule = rule or GateRule()
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    runs = load_runs(results_dir)
    gates: dict[str, GateView] = {}
    for gpu in gpu_order(runs):
        if not (runs.loc[runs["gpu_model"] == gpu, "origin"] == "committed").any():
            gates[gpu] = "only local runs: not gated (CI gates the committed runs)"
            continue
        inputs = against_baseline(results_dir, gpu)
        gates[gpu] = (f"No baseline for {gpu} yet (`attnbench baseline promote RUN` creates "
                      f"{inputs.base_label})." if inputs.base is None
                      else (gate(inputs, rule), Path(inputs.base_label).name, inputs.new_label))
    page = render_report(runs, gates, results_dir)
    html_path = write_text(out_dir / "index.html", page.html)
    md_path = write_text(out_dir / "summary.md", page.markdown)
    n_runs = runs["source"].nunique() if not runs.empty else 0
    return ReportOutput(html_path, md_path, page.figures, int(n_runs))


def gpu_order(runs: pd.DataFrame) -> list[str]:
    """GPU slugs with a CUDA run first, then the rest (cpu), each group by name."""
    slugs = runs["gpu_model"].dropna().unique()
    cuda = set(runs.loc[runs["device"] == "cuda", "gpu_model"].dropna())
    return sorted(slugs, key=lambda g: (g not in cuda, g))


def render_report(
    runs: pd.DataFrame, gates: dict[str, GateView], results_dir: Path | str = "results"
) -> Rendered:
    """The page and the markdown summary of `runs` (as `load_runs` gives them; rows without
    an `origin` count as committed). `gates`: per GPU slug, its gate or why it has none."""
    if "origin" not in runs:
        runs = runs.assign(origin=pd.Series("committed", index=runs.index, dtype="string"))
    if "gpu_model" not in runs:
        runs = runs.assign(gpu_model=runs["gpu"].map(gpu_model).astype("string"))
    page = _Page(f"{Path(results_dir) / 'runs'} (committed) and {Path(results_dir) / 'local'} "
                 "(this machine's runs, not committed)")
    md: list[str] = ["## attnbench results", ""]
    newest = {gpu: newest_per_suite(runs[runs["gpu_model"] == gpu])[0]
              for gpu in gpu_order(runs)}
    heads = [suite_headline(gpu, suite, rows)
             for gpu, latest in newest.items() for suite, rows in latest.groupby("suite")]
    page.heading(2, "Headline: the engine against the best other implementation", "headline")
    page.add(_headline_html(heads))
    md += _headline_markdown(heads)
    if runs.empty:
        page.add(f"<p class='empty'>No runs under <code>{_e(Path(results_dir) / 'runs')}"
                 f"</code> or <code>{_e(Path(results_dir) / 'local')}</code> yet.</p>")
        md.append("No runs yet.")
    for gpu, latest in newest.items():
        view = gates.get(gpu, "not gated")
        _gpu_section(page, md, gpu, latest, runs[runs["gpu_model"] == gpu], view)
    _environment_section(page, runs)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return Rendered(page.render(generated), "\n".join(md).rstrip() + "\n", page.figures)


def suite_headline(gpu: str, suite: str, rows: pd.DataFrame,
                   engine: str = ENGINE_IMPL) -> Headline:
    """The engine against the best other implementation over one run's cases and modes."""
    source = Path(str(rows["source"].iloc[0])).name
    origin = str(rows["origin"].iloc[0]) if "origin" in rows else "committed"
    noisy = int((rows["status"] == "noisy").sum())
    lat = rows[rows["status"] == "ok"].pivot_table(
        index=["case", "mode"], columns="impl", values="latency_ms", aggfunc="median")
    others = [c for c in lat.columns if not fnmatchcase(str(c), ENGINE_FAMILY)]
    if engine not in lat.columns or not others:
        return Headline(gpu, suite, source, origin, 0, noisy=noisy)
    lat = lat[lat[engine].gt(0) & lat[others].notna().any(axis=1)]
    if lat.empty:
        return Headline(gpu, suite, source, origin, 0, noisy=noisy)
    rival = lat[others].idxmin(axis=1)
    ratio = lat[others].min(axis=1) / lat[engine]
    case, mode = ratio.idxmin()
    counts = rival.value_counts()
    return Headline(
        gpu, suite, source, origin, len(ratio), float(ratio.median()), float(ratio.min()),
        f"{case} {mode} vs {rival[(case, mode)]}",
        ", ".join(f"{impl} ({n})" for impl, n in counts.items()), noisy)


def _headline_html(heads: list[Headline]) -> str:
    if not heads:
        return "<p class='meta'>No runs: no headline.</p>"
    body = "".join(
        f"<tr><td>{_e(h.gpu.upper())}</td><td><a href='#{_anchor(f'{h.gpu}-{h.suite}')}'>"
        f"{_e(h.suite)}</a></td><td><code>{_e(h.run)}</code> {_origin(h.origin)}</td>"
        f"<td class='num'>{h.pairs}</td>{_speedup_cell(h.median)}{_speedup_cell(h.worst)}"
        f"<td>{_e(h.worst_at)}</td><td>{_e(h.rivals)}</td><td class='num'>{h.noisy}</td></tr>"
        for h in heads)
    return ("<p class='meta'>Per suite, its newest run: for each case and mode, the best other "
            f"implementation's latency / {ENGINE_IMPL}'s (&gt; 1: {ENGINE_IMPL} faster), "
            "measured in the same run; ok rows only (noisy rows left out).</p>"
            "<table class='headline'><tr><th>GPU</th><th>suite</th><th>run</th><th>cases x "
            "modes</th><th>median</th><th>worst</th><th>worst at</th><th>best other (how "
            f"often)</th><th>noisy rows</th></tr>{body}</table>")


def _headline_markdown(heads: list[Headline]) -> list[str]:
    if not heads:
        return []
    out = [f"{ENGINE_IMPL} against the best other implementation (its latency / "
           f"{ENGINE_IMPL}'s, same run; > 1: {ENGINE_IMPL} faster):", "",
           "| GPU | suite | run | cases x modes | median | worst | worst at |",
           "|---|---|---|---:|---:|---:|---|"]
    out += [f"| {h.gpu.upper()} | {h.suite} | `{h.run}` ({h.origin}) | {h.pairs} | "
            f"{_x(h.median)} | {_x(h.worst)} | {h.worst_at} |" for h in heads]
    return [*out, ""]


def _gpu_section(page, md, gpu, latest, history, view: GateView) -> None:
    page.heading(2, f"{gpu.upper()}", f"gpu-{gpu}")
    md += [f"### {gpu.upper()}", ""]
    if isinstance(view, str):
        page.add(f"<p>{_e(view)}</p>")
        md += [view, ""]
    else:
        cmp, base_label, new_label = view
        page.add(_gate_html(cmp, base_label, new_label))
        md.append(comparison_markdown(cmp, f"baseline/{base_label}", new_label, limit=10))

    for suite, rows in latest.groupby("suite", sort=True):
        src = ", ".join(sorted({Path(s).name for s in rows["source"]}))
        origin = str(rows["origin"].iloc[0])
        page.heading(3, f"Suite {suite}", f"{gpu}-{suite}")
        n_ok, n_noisy = (rows["status"] == "ok").sum(), (rows["status"] == "noisy").sum()
        page.add(f"<p class='meta'>newest run: <code>{_e(src)}</code> {_origin(origin)}, "
                 f"git {_e(_commits(rows))}, {n_ok} ok"
                 + (f", <span class='noisy'>{n_noisy} noisy</span>" if n_noisy else "")
                 + f" of {len(rows)} rows</p>")
        md += [f"**{suite}** (`{src}`, {origin})", ""]
        md += _speedup_markdown(rows)
        for variant, vrows in rows.groupby("variant", sort=True, dropna=False):
            page.heading(4, f"{suite} / {variant}", f"{gpu}-{suite}-{variant}")
            page.figure(plots.tflops_over_seqlen(vrows, f"{suite} / {variant}: TFLOP/s"))
            page.add(_speedup_table(vrows))
            page.add(_bandwidth_table(vrows))
            page.add(_accuracy_table(vrows))
        fig = plots.engine_speedup_bars(rows, ENGINE_IMPL, f"{suite}: {ENGINE_IMPL} speedup "
                                        "over each implementation (geomean over cases)")
        if fig is not None:
            page.heading(4, f"{suite}: speedup summary", f"{gpu}-{suite}-speedup")
            page.figure(fig)
        hist = history[history["suite"] == suite]
        page.heading(4, f"{suite}: history over commits", f"{gpu}-{suite}-history")
        page.add("<p class='meta'>geomean TFLOP/s over each run's ok cases (hover for the "
                 "count); one point per run file (local ones marked).</p>")
        page.figure(plots.history(hist, f"{suite} on {gpu}: history"))
        page.add(_problems_table(rows))


def _commits(rows: pd.DataFrame) -> str:
    """The commits a run's rows come from, with counts when a day's file mixes several."""
    counts = rows["git_sha"].dropna().astype(str).str[:10].value_counts()
    if len(counts) <= 1:
        return ", ".join(counts.index)
    return ", ".join(f"{sha} ({n} rows)" for sha, n in counts.items())


def _origin(origin: str) -> str:
    return f"<span class='origin {_e(origin)}'>{_e(origin)}</span>"


def _anchor(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower())


def _gate_html(cmp: Comparison, base_label: str, new_label: str) -> str:
    c = cmp.counts()
    cls = "fail" if cmp.failed else "pass"
    noisy = f"{c['noisy']} noisy (not judged)"
    counts = ", ".join([
        perf_summary(c), f"<span class='noisy'>{noisy}</span>" if c["noisy"] else noisy,
        f"{c['accuracy regressions']} accuracy regressions", f"{c['appeared']} appeared",
        f"{c['vanished']} vanished ({c['missing']} gated rows missing, {c['excused']} excused)",
    ])
    why = "".join(f"<br>{_e(w)}" for w in cmp.failures())
    head = (f"<div class='gate {cls}'><b>Gate {'FAIL' if cmp.failed else 'pass'}</b>: "
            f"<code>{_e(new_label)}</code> against baseline <code>{_e(base_label)}</code> "
            f"({_e(rule_text(cmp.rule))}): {counts}.{why}</div>")
    missing = "".join(f"<tr class='bad'>{''.join(f'<td>{_e(k)}</td>' for k in key)}<td></td>"
                      "<td></td><td></td><td>missing from the new run</td></tr>"
                      for key in cmp.missing)
    changed = [r for r in cmp.rows
               if r.regression or r.perf in ("faster", "clock", "noise", "noisy")]
    if not changed and not missing:
        return head
    row_class = {"faster": "good", "noisy": "noisy"}
    body = missing + "".join(
        f"<tr class='{'bad' if r.regression else row_class.get(r.perf, '')}'>"
        + "".join(f"<td>{_e(k)}</td>" for k in r.key)
        + f"<td class='num'>{_fmt(r.base)}</td><td class='num'>{_fmt(r.new)}</td>"
        f"<td class='num'>{_pct(r.change)}</td><td>{_e('; '.join(r.reasons) or r.perf)}</td></tr>"
        for r in sorted(changed, key=lambda r: (not r.regression, r.key))
    )
    return (head + "<details><summary>changed rows</summary><table><tr><th>suite</th>"
            "<th>case</th><th>impl</th><th>mode</th><th>base</th><th>new</th><th>change</th>"
            f"<th>verdict</th></tr>{body}</table></details>")


def _case_frame(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that ran (ok and noisy), in table order."""
    ran = rows[rows["status"].isin(RAN)]
    return ran.sort_values(["dtype", "mode", "seqlen_q", "case"], kind="stable")


def _speedup_table(rows: pd.DataFrame) -> str:
    ran = _case_frame(rows)
    index = ["case", "mode"]
    lat = ran.pivot_table(index=index, columns="impl", values="latency_ms",
                          aggfunc="median", sort=False)
    noisy = (ran.assign(_noisy=ran["status"] == "noisy")
             .pivot_table(index=index, columns="impl", values="_noisy", aggfunc="max",
                          sort=False).reindex_like(lat).fillna(False).astype(bool))
    if ENGINE_IMPL not in lat.columns:
        return f"<p class='meta'>No ok {ENGINE_IMPL} rows: no speedup table.</p>"
    others = [c for c in lat.columns if c != ENGINE_IMPL]
    head = "".join(f"<th>vs {_e(c)}</th>" for c in others)
    body = []
    for key, r in lat.iterrows():
        cells = "".join(_speedup_cell(r[c] / r[ENGINE_IMPL],
                                      noisy.at[key, c] or noisy.at[key, ENGINE_IMPL])
                        for c in others)
        body.append(f"<tr><td>{_e(key[0])}</td><td>{_e(key[1])}</td>{cells}</tr>")
    trusted = lat.where(~noisy)  # the geomean leaves noisy rows out
    geo = "".join(_speedup_cell(geomean(trusted[c] / trusted[ENGINE_IMPL])) for c in others)
    body.append(f"<tr class='total'><td>geomean</td><td></td>{geo}</tr>")
    note = (" grey: noisy (spread above the re-measure threshold), left out of the geomean"
            if noisy.to_numpy().any() else "")
    return (f"<details open><summary>{ENGINE_IMPL} speedup (other latency / {ENGINE_IMPL} "
            f"latency){note}</summary><table><tr><th>case</th><th>mode</th>{head}</tr>"
            f"{''.join(body)}</table></details>")


def _speedup_cell(v: float, noisy: bool = False) -> str:
    if not math.isfinite(v):
        return "<td class='num'>-</td>"
    cls = "noisy" if noisy else ("good" if v >= 1.05 else ("bad" if v <= 0.95 else ""))
    title = " title='noisy: not trusted'" if noisy else ""
    return f"<td class='num {cls}'{title}>{v:.2f}x</td>"


def _bandwidth_table(rows: pd.DataFrame) -> str:
    """TB/s per case and implementation, with the fraction of the GPU's peak bandwidth, for
    rows that carry their traffic (decode, schema version 3); "" for the others."""
    ran = _case_frame(rows)
    ran = ran[ran["tbps"].notna()]
    if ran.empty:
        return ""
    tb = ran.pivot_table(index="case", columns="impl", values="tbps", aggfunc="median",
                         sort=False)
    frac = ran.pivot_table(index="case", columns="impl", values="bw_frac", aggfunc="median",
                           sort=False, dropna=False).reindex_like(tb)
    head = "".join(f"<th>{_e(c)}</th>" for c in tb.columns)
    body = "".join(
        f"<tr><td>{_e(case)}</td>" + "".join(
            f"<td class='num'>{_fmt(r[c])}"
            + ("" if pd.isna(frac.at[case, c]) else f" ({frac.at[case, c]:.0%})") + "</td>"
            for c in tb.columns) + "</tr>"
        for case, r in tb.iterrows())
    return ("<details open><summary>bandwidth: TB/s of the bytes a case must move (in brackets: "
            "of the GPU's peak)</summary><table><tr><th>case</th>"
            f"{head}</tr>{body}</table></details>")


def _accuracy_table(rows: pd.DataFrame) -> str:
    ok = _case_frame(rows)
    index = ["case", "mode", "dtype"]
    err = ok.pivot_table(index=index, columns="impl", values="rel_err",
                         aggfunc="max", sort=False, dropna=False)
    if err.empty:
        return ""
    noisy = set(ok.loc[ok["status"] == "noisy", [*index, "impl"]].itertuples(index=False,
                                                                             name=None))
    head = "".join(f"<th>{_e(c)}</th>" for c in err.columns)
    body = []
    for (case, mode, dtype), r in err.iterrows():
        try:
            tol = dtype_tolerance(dtype)
        except ValueError:
            tol = math.nan
        cells = "".join(_err_cell(r[c], tol, (case, mode, dtype, c) in noisy)
                        for c in err.columns)
        body.append(f"<tr><td>{_e(case)}</td><td>{_e(mode)}</td><td class='num'>{tol:.0e}</td>"
                    f"{cells}</tr>")
    return ("<details><summary>accuracy: rel_err against the reference (red: beyond the dtype "
            f"tolerance or NaN)</summary><table><tr><th>case</th><th>mode</th><th>tolerance</th>"
            f"{head}</tr>{''.join(body)}</table></details>")


def _err_cell(v: float, tol: float, noisy: bool = False) -> str:
    if pd.isna(v):
        return "<td class='num'>-</td>"
    bad = not math.isfinite(v) or (math.isfinite(tol) and v > tol)
    cls = " bad" if bad else (" noisy" if noisy else "")
    return f"<td class='num{cls}'>{v:.2e}</td>"


def _problems_table(rows: pd.DataFrame) -> str:
    bad = rows[rows["status"] != "ok"]
    if bad.empty:
        return ""
    cls = {"failed": "bad", "error": "bad", "noisy": "noisy"}
    body = "".join(
        f"<tr class='{cls.get(s, '')}'><td>{_e(c)}</td><td>{_e(i)}"
        f"</td><td>{_e(m)}</td><td>{_e(s)}</td><td>{_e(r)}</td></tr>"
        for c, i, m, s, r in bad[["case", "impl", "mode", "status", "reason"]].itertuples(
            index=False)
    )
    return (f"<details><summary>{len(bad)} row(s) not ok (skipped / noisy / failed / error)"
            "</summary>"
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
    by_origin = sorted(runs.groupby("source"), key=lambda kv: (
        str(kv[1]["origin"].iloc[0]) != "committed", Path(kv[0]).name))
    for source, grp in by_origin:
        vals = ["<br>".join(_e(v) for v in sorted({str(x) for x in grp[c].dropna()}))
                for c in cols]
        stamps = grp["timestamp"].dropna()
        when = f"{stamps.min()} .. {stamps.max()}" if len(stamps) else "-"
        counts = grp["status"].value_counts()
        status = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("ok", "noisy", "skipped",
                                                                "failed", "error")
                           if counts.get(s, 0))
        body.append(f"<tr><td><code>{_e(Path(source).name)}</code> "
                    f"{_origin(str(grp['origin'].iloc[0]))}</td>"
                    + "".join(f"<td>{v}</td>" for v in vals)
                    + f"<td>{_e(when)}</td><td>{_e(status)}</td></tr>")
    head = "".join(f"<th>{c}</th>" for c in ["file (origin)", *cols, "measured (UTC)",
                                             "rows"])
    page.add(f"<table class='env'><tr>{head}</tr>{''.join(body)}</table>")


def _x(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2f}x"


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
.noisy{color:#8a909c;background:#eeeff2} td.noisy{font-style:italic}
.origin{font-size:11px;padding:1px 5px;border-radius:3px;margin-left:4px}
.origin.committed{background:#dfe8fb;color:#1f3f86} .origin.local{background:#fff0c9;color:#6d5200}
table.headline td,table.headline th{font-size:13.5px}
"""


class _Page:
    """Accumulates body parts and a table of contents; inlines plotly.js once at render."""

    def __init__(self, source: str) -> None:
        self.source = source  # what the page was built from, for its header
        self.parts: list[str] = []
        self.toc: list[tuple[int, str, str]] = []
        self.figures = 0

    def add(self, fragment: str) -> None:
        if fragment:
            self.parts.append(fragment)

    def heading(self, level: int, text: str, anchor: str) -> None:
        anchor = _anchor(anchor)
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
            f"<header><h1>attnbench dashboard</h1><p>built {generated} from "
            f"{_e(self.source)}; {self.figures} plots</p></header><main><nav>{toc}</nav>"
            f"{''.join(self.parts)}</main></body></html>"
        )

