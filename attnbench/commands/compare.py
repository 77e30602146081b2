"""`attnbench compare BASE NEW` / `attnbench compare --against-baseline [NEW]`: the gate.

Exit status: 0 pass, 1 regression, missing rows or an empty run (see the rules in
attnbench/compare.py), 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from attnbench.baseline import DEFAULT_RESULTS, against_baseline, gate
from attnbench.compare import (
    METRICS,
    Comparison,
    GateRule,
    compare,
    comparison_markdown,
    perf_summary,
    rule_text,
)
from attnbench.results.read import ResultFileError, read_results


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


def parse_noise_k(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0 such as 1, got {text!r}")
    return value


def parse_pattern(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a glob such as '*llama3-70b*', got ''")
    return text


NOISE_K_HELP = ("a change counts only when it also exceeds K x sqrt(IQR_base^2 + IQR_new^2), "
                "the two runs' combined interquartile spread in the metric's units (default 1; "
                "0: the threshold alone decides)")
METRIC_HELP = ("the number the threshold applies to: latency_ms, the median latency (lower is "
               "better; default), or tflops (higher is better)")


def add_rule_arguments(p: argparse.ArgumentParser) -> None:
    """--threshold, --noise-k and --metric: the noise rule, shared with `attnbench report`."""
    p.add_argument("--threshold", type=parse_threshold, default=0.05,
                   help="relative change that matters, e.g. 5%% (default) or 0.05")
    p.add_argument("--noise-k", type=parse_noise_k, default=1.0, metavar="K", help=NOISE_K_HELP)
    p.add_argument("--metric", choices=METRICS, default="latency_ms", help=METRIC_HELP)
    p.add_argument("--same-run", action="store_true",
                   help="a slower row is a regression only if it is also slower against its "
                   "case's baseline implementation measured in the same run (a clock that "
                   "differs between runs moves both alike)")


class _Renamed(argparse.Action):
    """A removed flag: say what replaced it instead of argparse's bare "unrecognized"."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed: use --nothing-to-gate-ok for 'no run or no "
                     "baseline yet'; rows missing from a run fail unless --allow-missing names "
                     "them")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare two result files (regression gate)",
        description="Match rows by (suite, case, impl, mode); report speedups, regressions, "
        "accuracy regressions and rows that appeared or vanished. A change counts only when it "
        "exceeds both the threshold and k x the runs' combined IQR. Rows of the gated "
        "implementations that vanished from the new run, and a new run (or suite) without an "
        "ok row, fail the gate. Noisy rows are listed, never judged. Exits 1 when the gate "
        "fails.",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="BASE NEW, or NEW with "
                   "--against-baseline (default: the newest run of --gpu per suite)")
    p.add_argument("--against-baseline", action="store_true",
                   help="compare against results/baseline/<gpu>.csv")
    p.add_argument("--gpu", default="h100", help="GPU whose newest run to gate (default h100)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="results folder (default ./results)")
    add_rule_arguments(p)
    p.add_argument("--strict", action="store_true",
                   help="also fail on vanished rows of every implementation and on ok -> "
                   "skipped")
    p.add_argument("--all", action="store_true", help="list unchanged rows too")
    p.add_argument("--markdown", type=Path, help="also write a markdown summary here")
    p.add_argument("--gate-impl", action="append", metavar="PATTERN",
                   help="implementations the gate judges (glob, repeatable; default engine*); "
                   "'*' gates the reference implementations too")
    p.add_argument("--allow-missing", action="append", metavar="PATTERN", default=[],
                   type=parse_pattern,
                   help="a new run filtered on purpose: rows whose case or implementation "
                   "matches this glob may be absent from it (repeatable), e.g. "
                   "'*llama3-70b*' or 'flash-attention-3'; any other gated row absent from "
                   "the new run fails the gate")
    p.add_argument("--nothing-to-gate-ok", action="store_true",
                   help="with --against-baseline: when --gpu has no committed run or no "
                   "baseline yet, say so and pass (CI, before the first GPU run). It never "
                   "excuses missing rows or an empty run")
    p.add_argument("--missing-ok", nargs=0, action=_Renamed, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        impls = tuple(args.gate_impl) if args.gate_impl else GateRule.impls
        rule = GateRule(args.threshold, args.noise_k, args.metric, args.strict, impls,
                        tuple(args.allow_missing), args.same_run)
        loaded = _load(args, rule)
    except (ResultFileError, ValueError) as exc:
        print(f"attnbench compare: {exc}", file=sys.stderr)
        return 2
    if loaded is None:
        return 0
    cmp, base_label, new_label = loaded
    render(cmp, base_label, new_label, show_all=args.all)
    if args.markdown:
        from attnbench.report.build import write_text

        write_text(args.markdown, comparison_markdown(cmp, base_label, new_label))
    return 1 if cmp.failed else 0


def _load(args, rule: GateRule) -> tuple[Comparison, str, str] | None:
    """The comparison to render, or None when there is nothing to gate and that is allowed."""
    if not args.against_baseline:
        if len(args.files) != 2:
            raise ValueError(
                f"files: expected BASE NEW (2 files), got {len(args.files)}; "
                "or use --against-baseline [NEW]"
            )
        base_path, new_path = (Path(f) for f in args.files)
        base, new = read_results(base_path), read_results(new_path)
        return compare(base, new, rule), str(base_path), str(new_path)
    if len(args.files) > 1:
        raise ValueError("files: --against-baseline takes at most one file (NEW)")
    inputs = against_baseline(args.results, args.gpu, args.files[0] if args.files else None)
    reason = inputs.nothing_to_gate
    if reason:
        if not args.nothing_to_gate_ok:
            raise ValueError(f"{reason} (--nothing-to-gate-ok passes in that case)")
        if inputs.new.empty and not inputs.empty_files:
            print(f"attnbench compare: {reason}: nothing to gate, passing")
            return None
        # a run but no baseline: nothing to compare it with, but an empty run still fails
        print(f"attnbench compare: {reason}: checking only that the run measured something")
    cmp = gate(inputs, rule)
    return cmp, inputs.base_label, inputs.new_label


def render(cmp: Comparison, base_label: str, new_label: str, show_all: bool = False) -> None:
    """Print the comparison as rich tables: changed and noisy rows, status changes, missing,
    appeared and vanished rows, then the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))  # CI logs: do not squeeze the table
    rule = cmp.rule
    table = Table(
        title=f"{new_label} vs {base_label}  ({rule_text(rule)})",
        title_justify="left",
    )
    for name, justify in (("suite", "left"), ("case", "left"), ("impl", "left"),
                          ("mode", "left"), ("base", "right"), ("new", "right"),
                          ("change", "right"), ("noise", "right"), ("speedup", "right"),
                          ("verdict", "left"), ("rel_err base -> new", "right")):
        table.add_column(name, justify=justify)
    style = {"slower": "bold red", "faster": "green", "clock": "yellow", "noise": "yellow",
             "noisy": "dim"}
    order = {"slower": 0, "faster": 1, "clock": 2, "noise": 2, "noisy": 3, "same": 4, "n/a": 5}
    shown = 0
    for r in sorted(cmp.rows, key=lambda r: (not r.regression, order[r.perf], r.key)):
        if not (show_all or r.regression
                or r.perf in ("faster", "slower", "clock", "noise", "noisy")
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
    flagged = set(cmp.missing) | set(cmp.excused)
    for title, keys, color in (
        ("MISSING from the new run (gated: regressions; --allow-missing PATTERN if the run "
         "was filtered on purpose)", cmp.missing, "bold red"),
        ("absent from the new run, excused by --allow-missing", cmp.excused, None),
        ("vanished (base only, not gated)", [k for k in cmp.vanished if k not in flagged],
         None),
        ("appeared (new only)", cmp.appeared, None),
    ):
        if keys:
            t = Table(title=f"{len(keys)} row(s) {title}", title_justify="left", style=color)
            for col in ("suite", "case", "impl", "mode"):
                t.add_column(col)
            for k in keys:
                t.add_row(*k)
            console.print(t)
    for note in cmp.notes:
        console.print(f"note: {note}")
    for empty in cmp.empty:
        console.print(f"[bold red]empty: {empty}[/]")
    c = cmp.counts()
    summary = (f"{len(cmp.rows)} matched: {perf_summary(c)}, {c['noisy']} noisy (not "
               f"judged), {c['n/a']} without numbers; {c['accuracy regressions']} accuracy "
               f"regression(s); {c['appeared']} appeared, {c['vanished']} vanished "
               f"({c['missing']} gated missing, {c['excused']} excused); gated: "
               f"{', '.join(rule.impls)} ({len(cmp.drift)} ungated row(s) worse)")
    console.print(summary)
    if cmp.failed:
        console.print(f"[bold red]gate: FAIL ({'; '.join(cmp.failures())})[/]")
    else:
        console.print("[green]gate: pass[/]")


def _verdict(r) -> str:
    tags = []
    if r.regression:
        tags.append("REGRESSION")
    elif r.reasons:
        tags.append("drift (not gated)")
    if r.perf == "clock":
        tags.append(f"clock (x the same run's baseline {_p(r.ratio_change)})")
    else:
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
