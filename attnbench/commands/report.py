"""`attnbench report [--out DIR]`: build the static dashboard from the committed results."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnbench.baseline import DEFAULT_RESULTS
from attnbench.commands.compare import parse_threshold
from attnbench.compare import GateRule
from attnbench.results.read import ResultFileError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="build the HTML dashboard and a markdown summary",
        description="Reads results/runs and results/baseline and writes DIR/index.html (one "
        "self-contained file: opens from disk, no server, no network) and DIR/summary.md (for a "
        "pull-request comment).",
    )
    p.add_argument("--out", type=Path, default=Path("artifacts/dashboard"),
                   help="output folder (default artifacts/dashboard)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="results folder (default ./results)")
    p.add_argument("--threshold", type=parse_threshold, default=0.05,
                   help="gate threshold shown on the page (default 5%%)")
    p.add_argument("--noise-k", type=float, default=1.0)
    p.add_argument("--metric", choices=("latency_ms", "tflops"), default="latency_ms")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnbench.report.build import build_report

    try:
        rule = GateRule(args.threshold, args.noise_k, args.metric)
        out = build_report(args.results, args.out, rule)
    except (ResultFileError, ValueError) as exc:
        print(f"attnbench report: {exc}", file=sys.stderr)
        return 2
    print(f"dashboard: {out.html} ({out.runs} run file(s), {out.figures} plots); "
          f"summary: {out.markdown}")
    return 0
