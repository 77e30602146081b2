"""`attnbench baseline promote RUN` / `attnbench baseline show [--gpu h100]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnbench.baseline import DEFAULT_RESULTS, baseline_path, promote
from attnbench.results.read import ResultFileError, read_results


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "baseline",
        help="show or promote the per-GPU regression baseline",
        description="The baseline of a GPU is results/baseline/<gpu>.csv; "
        "`compare --against-baseline` gates runs against it.",
    )
    sub = p.add_subparsers(dest="baseline_command", metavar="ACTION")
    sub.required = True
    pr = sub.add_parser("promote", help="make a run file the baseline of its GPU "
                        "(replaces that GPU's rows for the run's suites; noisy rows are "
                        "left out and the previous baseline row of their key is kept)")
    pr.add_argument("run_file", type=Path, metavar="RUN", help="a result CSV under results/runs")
    pr.add_argument("--gpu", help="override the GPU slug read from the run's rows")
    pr.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    pr.set_defaults(func=_promote)
    sh = sub.add_parser("show", help="print where the baseline is and what it holds")
    sh.add_argument("--gpu", default="h100")
    sh.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    sh.set_defaults(func=_show)


def _promote(args: argparse.Namespace) -> int:
    try:
        done = promote(args.run_file, args.results, args.gpu)
    except (ResultFileError, ValueError) as exc:
        print(f"attnbench baseline: {exc}", file=sys.stderr)
        return 2
    suites = ", ".join(sorted(set(done.rows["suite"])))
    print(f"baseline {done.path}: {len(done.rows)} rows (suites: {suites}); promoted "
          f"{done.promoted} row(s) of {args.run_file}; left out {done.noisy} noisy row(s) "
          f"(kept the previous baseline row for {done.kept} of them)")
    return 0


def _show(args: argparse.Namespace) -> int:
    path = baseline_path(args.gpu, args.results)
    if not path.exists():
        print(f"no baseline for {args.gpu} ({path}); promote a run with "
              "`attnbench baseline promote RUN`")
        return 0
    try:
        rows = read_results(path)
    except ResultFileError as exc:
        print(f"attnbench baseline: {exc}", file=sys.stderr)
        return 2
    print(f"baseline {path}: {len(rows)} rows")
    for (suite, sha), group in rows.groupby(["suite", "git_sha"], dropna=False):
        stamp = group["timestamp"].max()
        print(f"  {suite}: {len(group)} rows, git {str(sha)[:12]}, measured {stamp}")
    return 0
