"""`attnbench report [--out DIR]`: build the static dashboard from results/runs (committed)
and results/local (this machine's runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnbench.baseline import DEFAULT_RESULTS
from attnbench.commands.compare import add_rule_arguments
from attnbench.compare import GateRule
from attnbench.results.read import ResultFileError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="build the HTML dashboard and a markdown summary",
        description="Reads results/runs (committed), results/local (this machine's runs, "
        "labelled local) and results/baseline, and writes DIR/index.html (one self-contained "
        "file: opens from disk, no server, no network) and DIR/summary.md (for a pull-request "
        "comment). The page opens with a headline table per suite, GPU suites first; the "
        "committed runs of each GPU are gated against its baseline as `attnbench compare "
        "--against-baseline` does.",
    )
    p.add_argument("--out", type=Path, default=Path("artifacts/dashboard"),
                   help="output folder (default artifacts/dashboard)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="results folder (default ./results)")
    add_rule_arguments(p)  # the gate shown on the page
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnbench.report.build import build_report

    try:
        rule = GateRule(args.threshold, args.noise_k, args.metric, same_run=args.same_run)
        out = build_report(args.results, args.out, rule)
    except (ResultFileError, ValueError) as exc:
        print(f"attnbench report: {exc}", file=sys.stderr)
        return 2
    print(f"dashboard: {out.html} ({out.runs} run file(s), {out.figures} plots); "
          f"summary: {out.markdown}")
    return 0
