"""`attnbench compare BASE NEW` / `attnbench compare --against-baseline [NEW]`: the gate.

Exit status: 0 pass, 1 regression (see the noise rule in attnbench/compare.py), 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from attnbench.baseline import DEFAULT_RESULTS, baseline_path, newest_runs, run_gpu
from attnbench.compare import Comparison, GateRule, compare, comparison_markdown
from attnbench.results.read import ResultFileError, dedupe_latest, read_results


def parse_threshold(text: str) -> float:
    """"5%" -> 0.05 and "0.05" -> 0.05; a bare number >= 1 is refused as ambiguous."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0 or (not raw.endswith("%") and value >= 1):
        raise argparse.ArgumentTypeError(
            f"expected a percentage such as 5% or a fraction such as 0.05, got {text!r}"
        )
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare two result files (regression gate)",
        description="Match rows by (suite, case, impl, mode); report speedups, regressions, "
        "accuracy regressions and rows that appeared or vanished. A change counts only when it "
        "exceeds both the threshold and k x the runs' combined IQR. Exits 1 on a regression.",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="BASE NEW, or NEW with "
                   "--against-baseline (default: the newest run of --gpu per suite)")
    p.add_argument("--against-baseline", action="store_true",
                   help="compare against results/baseline/<gpu>.csv")
    p.add_argument("--gpu", default="h100", help="GPU whose newest run to gate (default h100)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="results folder (default ./results)")
    p.add_argument("--threshold", type=parse_threshold, default=0.05,
                   help="relative change that matters, e.g. 5%% (default)")
    p.add_argument("--noise-k", type=float, default=1.0,
                   help="a change must also exceed k x sqrt(iqr_base^2 + iqr_new^2) (default 1)")
    p.add_argument("--metric", choices=("latency_ms", "tflops"), default="latency_ms")
    p.add_argument("--strict", action="store_true",
                   help="also fail on vanished rows and on ok -> skipped")
    p.add_argument("--all", action="store_true", help="list unchanged rows too")
    p.add_argument("--markdown", type=Path, help="also write a markdown summary here")
    p.add_argument("--gate-impl", action="append", metavar="PATTERN",
                   help="implementations the gate judges (glob, repeatable; default engine*); "
                   "'*' gates the reference implementations too")
    p.add_argument("--missing-ok", action="store_true",
                   help="with --against-baseline: pass, saying so, when there is no run or "
                   "no baseline yet (used by CI)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        impls = tuple(args.gate_impl) if args.gate_impl else GateRule.impls
        rule = GateRule(args.threshold, args.noise_k, args.metric, args.strict, impls)
        loaded = _load(args)
    except (ResultFileError, ValueError) as exc:
        print(f"attnbench compare: {exc}", file=sys.stderr)
        return 2
    if loaded is None:
        return 0
    (base, base_label), (new, new_label) = loaded
    cmp = compare(base, new, rule)
    render(cmp, base_label, new_label, show_all=args.all)
    if args.markdown:
        from attnbench.report.build import write_text

        write_text(args.markdown, comparison_markdown(cmp, base_label, new_label))
    return 1 if cmp.failed else 0


def _load(args):
    if not args.against_baseline:
        if len(args.files) != 2:
            raise ValueError(
                f"files: expected BASE NEW (2 files), got {len(args.files)}; "
                "or use --against-baseline [NEW]"
            )
        base_path, new_path = (Path(f) for f in args.files)
        return (read_results(base_path), str(base_path)), (read_results(new_path), str(new_path))
    if len(args.files) > 1:
        raise ValueError("files: --against-baseline takes at most one file (NEW)")
    if args.files:
        new_path = Path(args.files[0])
        new = dedupe_latest(read_results(new_path))
        gpu, new_label = run_gpu(new, new_path), str(new_path)
    else:
        new, sources = newest_runs(args.results / "runs", args.gpu)
        gpu = args.gpu
        if new.empty:
            return _missing(args, f"no committed {args.gpu} run under {args.results / 'runs'}")
        new_label = ", ".join(s.name for s in sources)
    path = baseline_path(gpu, args.results)
    if not path.exists():
        return _missing(
            args, f"no baseline for {gpu} yet ({path}); promote one with "
            "`attnbench baseline promote RUN`"
        )
    base = read_results(path)
    # The baseline covers many suites; gate only the suites the new run measured.
    base = base[base["suite"].isin(set(new["suite"]))]
    return (base, str(path)), (new, new_label)


def _missing(args, message: str):
    if args.missing_ok:
        print(f"attnbench compare: {message}: nothing to gate, passing")
        return None
    raise ValueError(message)


def render(cmp: Comparison, base_label: str, new_label: str, show_all: bool = False) -> None:
    """Print the comparison as rich tables: changed rows, status changes, appeared/vanished."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))  # CI logs: do not squeeze the table
    rule = cmp.rule
    table = Table(
        title=f"{new_label} vs {base_label}  ({rule.metric}, threshold {rule.threshold:.0%}, "
        f"noise k={rule.noise_k:g})",
        title_justify="left",
    )
    for name, justify in (("suite", "left"), ("case", "left"), ("impl", "left"),
                          ("mode", "left"), ("base", "right"), ("new", "right"),
                          ("change", "right"), ("noise", "right"), ("speedup", "right"),
                          ("verdict", "left"), ("rel_err base -> new", "right")):
        table.add_column(name, justify=justify)
    style = {"slower": "bold red", "faster": "green", "noise": "yellow"}
    order = {"slower": 0, "faster": 1, "noise": 2, "same": 3, "n/a": 4}
    shown = 0
    for r in sorted(cmp.rows, key=lambda r: (not r.regression, order[r.perf], r.key)):
        if not (show_all or r.regression or r.perf in ("faster", "slower", "noise")
                or r.status_change or r.accuracy in ("regressed", "out-of-tolerance")):
            continue
        shown += 1
        verdict = _verdict(r)
        noise = r.noise / r.base if r.base else math.nan
        table.add_row(
            *r.key, _n(r.base), _n(r.new), _p(r.change), "±" + _p(noise).lstrip("+"),
            "-" if math.isnan(r.speedup) else f"{r.speedup:.2f}x", verdict,
            f"{_e(r.base_err)} -> {_e(r.new_err)}",
            style=style.get("slower" if r.regression else r.perf),
        )
    if shown:
        console.print(table)
    for title, keys in (("appeared (new only)", cmp.appeared), ("vanished (base only)",
                                                                  cmp.vanished)):
        if keys:
            t = Table(title=f"{len(keys)} row(s) {title}", title_justify="left")
            for col in ("suite", "case", "impl", "mode"):
                t.add_column(col)
            for k in keys:
                t.add_row(*k)
            console.print(t)
    for note in cmp.notes:
        console.print(f"note: {note}")
    c = cmp.counts()
    summary = (f"{len(cmp.rows)} matched: {c['faster']} faster, {c['slower']} slower, "
               f"{c['noise']} inside the noise, {c['same']} unchanged, {c['n/a']} without "
               f"numbers; {c['accuracy regressions']} accuracy regression(s); "
               f"{c['appeared']} appeared, {c['vanished']} vanished; gated: "
               f"{', '.join(rule.impls)} ({len(cmp.drift)} ungated row(s) worse)")
    console.print(summary)
    if cmp.failed:
        console.print(f"[bold red]gate: FAIL ({c['regressions']} regression(s))[/]")
    else:
        console.print("[green]gate: pass[/]")


def _verdict(r) -> str:
    tags = []
    if r.regression:
        tags.append("REGRESSION")
    elif r.reasons:
        tags.append("drift (not gated)")
    tags.append(r.perf if r.perf != "n/a" else "")
    if r.status_change:
        tags.append(r.status_change)
    if r.accuracy == "regressed":
        tags.append("rel_err past tolerance" if math.isfinite(r.new_err) else "rel_err NaN")
    elif r.accuracy == "out-of-tolerance":
        tags.append("rel_err out of tolerance in both")
    return " ".join(t for t in tags if t)


def _n(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.4g}"


def _p(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:+.1%}"


def _e(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1e}"
