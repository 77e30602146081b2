"""`attnbench run suite NAME|PATH`: run a benchmark suite and append result rows."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run benchmarks (see: attnbench run suite --help)")
    sub = p.add_subparsers(dest="what", metavar="WHAT")
    sub.required = True
    s = sub.add_parser(
        "suite", help="run a suite from suites/ (by name) or a suite file (by path)",
        description="Run every case of a suite and append one row per case x impl x mode to "
        "OUT/<date>-<gpu>-<suite>.csv, as each case finishes.",
    )
    s.add_argument("suite", metavar="NAME|PATH", help="suite name in suites/ or a file path")
    s.add_argument("--filter", action="append", default=[], metavar="PATTERN",
                   help="keep cases whose name contains PATTERN (or glob-matches it); repeatable")
    s.add_argument("--impl", default="", metavar="A,B,...",
                   help="run only these implementations (plus each case's baseline)")
    s.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    s.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="timed repetitions per measurement (default: the suite's)")
    s.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed calls before timing (default: the suite's)")
    s.add_argument("--out", type=Path, default=Path("results/runs"), metavar="DIR",
                   help="folder of result files (default: results/runs)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    s.add_argument("--shape", default=None, metavar="NAME",
                   help="run every case at this shape preset instead of its own")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--sleep", type=float, default=None, metavar="S",
                   help="seconds to sleep between implementations (default 0.1 on CUDA)")
    s.set_defaults(func=run_suite_command)


def _parse_impls(text: str) -> list[str]:
    from attnbench.impls import IMPL_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in IMPL_NAMES]
    if bad:
        raise ValueError(f"--impl: unknown implementation(s) {', '.join(bad)}; known: "
                         f"{', '.join(IMPL_NAMES)}")
    return names


def run_suite_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from attnbench.suites import SuiteError, load_suite

    # wide tables when piped to a file (rich defaults to 80 columns without a terminal)
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        if args.repeat is not None and args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        if args.warmup is not None and args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        impls = _parse_impls(args.impl)
        suite = load_suite(args.suite, shape_override=args.shape)
    except (SuiteError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    suite = with_impls(suite.filtered(args.filter), impls)
    if not suite.cases:
        print(f"error: no case of suite {suite.name} matches --filter {args.filter}",
              file=sys.stderr)
        return 2
    if args.dry_run:
        print_cases(suite, console)
        return 0

    from attnbench.runner import Runner, RunOptions

    try:
        runner = Runner(suite, RunOptions(device=args.device, repeats=args.repeat,
                                          warmup=args.warmup, seed=args.seed,
                                          sleep_s=args.sleep, out_dir=args.out))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = run_with_progress(runner, console)
    print_table(rows, console)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "skipped", "failed",
                                                                "error")}
    console.print(f"{len(rows)} rows ({', '.join(f'{v} {k}' for k, v in counts.items())}) "
                  f"-> {runner.path}")
    return 1 if counts["error"] or counts["failed"] else 0


def with_impls(suite, impls: list[str]):
    """Narrow each case to `impls`, keeping its baseline so that speedups stay defined."""
    from dataclasses import replace

    if not impls:
        return suite
    cases = []
    for c in suite.cases:
        chosen = [c.baseline] + [i for i in impls if i != c.baseline]
        cases.append(replace(c, impls=tuple(chosen)))
    return replace(suite, cases=tuple(cases))


def run_with_progress(runner, console) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    skipped = runner.gpu_only_skipped()
    if skipped:
        console.print(f"[yellow]no CUDA device: skipping GPU-only implementations "
                      f"{', '.join(skipped)} (their rows are written as skipped)[/yellow]")
    rows: list[dict] = []
    cases = runner.suite.cases
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task(f"{runner.suite.name}", total=len(cases))
        it = runner.iter_cases()
        for i in range(len(cases)):
            progress.update(task, description=f"{runner.suite.name}: {cases[i].name}")
            _, case_rows = next(it)
            rows.extend(case_rows)
            progress.advance(task)
        progress.update(task, description=runner.suite.name)
    return rows


def print_cases(suite, console) -> None:
    """One line per case (plain text, so it can be piped): name, kind, modes, impls."""
    console.print(f"suite {suite.name}: {len(suite.cases)} cases", highlight=False)
    for c in suite.cases:
        impls = [c.baseline] + [i for i in c.impls if i != c.baseline]
        console.print(f"{c.name}  kind={c.kind}  modes={','.join(c.modes)}  "
                      f"impls={','.join(impls)} (baseline {c.baseline})", highlight=False,
                      soft_wrap=True)


def _fmt(x: float, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict], console, show_skipped: bool = False) -> None:
    """Results grouped by case; per (case, mode) the fastest ok implementation in bold green."""
    from rich.table import Table

    table = Table(title="results", show_lines=False)
    for col, just in (("case", "left"), ("mode", "left"), ("impl", "left"),
                      ("status", "left"), ("ms", "right"), ("TFLOP/s", "right"),
                      ("MFU", "right"), ("speedup", "right"), ("rel_err", "right"),
                      ("reason", "left")):
        table.add_column(col, justify=just, overflow="fold")
    fastest = {}
    for r in rows:
        if r["status"] == "ok":
            key = (r["case"], r["mode"])
            if key not in fastest or r["latency_ms"] < fastest[key]["latency_ms"]:
                fastest[key] = r
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    hidden = 0
    for case, case_rows in by_case.items():
        shown = [r for r in case_rows if show_skipped or r["status"] != "skipped"]
        hidden += len(case_rows) - len(shown)
        for i, r in enumerate(sorted(shown, key=lambda r: (r["mode"], r["impl"]))):
            style = "bold green" if fastest.get((r["case"], r["mode"])) is r else None
            if r["status"] in ("failed", "error"):
                style = "red"
            table.add_row(case if i == 0 else "", r["mode"], r["impl"], r["status"],
                          _fmt(r["latency_ms"], ".4g"), _fmt(r["tflops"], ".3g"),
                          _fmt(r["mfu"], ".1%"), _fmt(r["speedup"], ".2f"),
                          _fmt(r["rel_err"], ".1e"), (r["reason"] or "")[:80], style=style)
        if shown:
            table.add_section()
    console.print(table)
    if hidden:
        console.print(f"({hidden} skipped rows not shown; see the result file for reasons)")
