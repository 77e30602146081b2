"""`attnbench run suite NAME|PATH`: run a benchmark suite and append result rows."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

SPREAD_MARK = 0.10  # the table marks rows whose spread exceeds this fraction of the median
MAX_SEED = 2**63 - 2  # the runner seeds torch generators with seed and seed + 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="run benchmarks (see: attnbench run suite --help)")
    sub = p.add_subparsers(dest="what", metavar="WHAT")
    sub.required = True
    s = sub.add_parser(
        "suite", help="run a suite from suites/ (by name) or a suite file (by path)",
        description="Run every case of a suite and append one row per case x impl x mode to "
        "OUT/<date>-<gpu>-<suite>.csv, as each case finishes. A row whose timing spread "
        "exceeds the noise threshold is measured again after a pause (the tightest attempt "
        "is kept; still noisy after every attempt: status noisy).",
    )
    s.add_argument("suite", metavar="NAME|PATH", help="suite name in suites/ or a file path")
    s.add_argument("--filter", action="append", default=[], metavar="PATTERN",
                   help="keep cases whose name contains PATTERN (or glob-matches it); repeatable")
    s.add_argument("--impl", default=None, metavar="A,B,...",
                   help="run only these implementations (plus each case's baseline)")
    s.add_argument("--dry-run", action="store_true",
                   help="list the cases and the implementations this machine skips (and why), "
                   "then exit without measuring")
    s.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="timed repetitions per measurement (default: the suite's)")
    s.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed calls before timing (default: the suite's)")
    s.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="folder of result files (default: results/runs on a GPU; "
                   "results/local, which git ignores, without one)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    s.add_argument("--shape", default=None, metavar="NAME",
                   help="run every case at this shape preset instead of its own")
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--sleep", type=float, default=None, metavar="S",
                   help="seconds to sleep between implementations (default 0.1 on CUDA)")
    s.add_argument("--noise-threshold", type=float, default=None, metavar="F",
                   help="re-measure a row whose interquartile spread exceeds F x its median "
                   "(default: the suite's noise_threshold, else 0.05)")
    s.add_argument("--attempts", type=int, default=3, metavar="N",
                   help="timing attempts in all for a noisy row (default 3; 1: never again)")
    s.add_argument("--retry-pause", type=float, default=None, metavar="S",
                   help="seconds to pause before re-measuring a noisy row (default 1 on CUDA, "
                   "0 on a CPU)")
    s.add_argument("--impl-timeout", type=float, default=1800.0, metavar="S",
                   help="end the run (status 124) when one implementation's compile and "
                   "measurement of a case take longer than S seconds, a kernel that never "
                   "ends, after writing its case's rows so far and an error row for it "
                   "(default 1800; 0: no limit)")
    s.add_argument("--resume", action="store_true",
                   help="skip the cases today's result file already holds from a run of this "
                   "commit and seed (finish a suite over several sittings)")
    s.set_defaults(func=run_suite_command)


def _parse_impls(text: str | None) -> list[str]:
    from attnbench.impls import IMPL_NAMES

    if text is None:
        return []
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(f"--impl: expected implementation names separated by commas, got "
                         f"{text!r}; known: {', '.join(IMPL_NAMES)}")
    bad = [n for n in names if n not in IMPL_NAMES]
    if bad:
        raise ValueError(f"--impl: unknown implementation(s) {', '.join(bad)}; known: "
                         f"{', '.join(IMPL_NAMES)}")
    return names


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric option in range (one ValueError naming the first bad one)."""
    def need(ok: bool, flag: str, what: str, value) -> None:
        if not ok:
            raise ValueError(f"{flag} must be {what}, got {value}")

    def seconds(x):
        return x is None or (math.isfinite(x) and x >= 0)

    need(args.repeat is None or args.repeat >= 1, "--repeat", "an integer >= 1", args.repeat)
    need(args.warmup is None or args.warmup >= 0, "--warmup", "an integer >= 0", args.warmup)
    need(0 <= args.seed <= MAX_SEED, "--seed", f"an integer in 0..{MAX_SEED}", args.seed)
    need(seconds(args.sleep), "--sleep", "a number of seconds >= 0", args.sleep)
    need(args.noise_threshold is None or (math.isfinite(args.noise_threshold)
                                          and args.noise_threshold > 0),
         "--noise-threshold", "a number > 0 (a fraction of the median, e.g. 0.05)",
         args.noise_threshold)
    need(args.attempts >= 1, "--attempts", "an integer >= 1", args.attempts)
    need(seconds(args.retry_pause), "--retry-pause", "a number of seconds >= 0",
         args.retry_pause)
    need(seconds(args.impl_timeout), "--impl-timeout", "a number of seconds >= 0 (0: no limit)",
         args.impl_timeout)
    empty = [p for p in args.filter if not p.strip()]
    need(not empty, "--filter", "a non-empty PATTERN", repr(empty[0]) if empty else "")


def run_suite_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from attnbench.suites import SuiteError, load_suite

    # wide tables when piped to a file (rich defaults to 80 columns without a terminal)
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        _check_numbers(args)
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

    from attnbench.results.schema import STATUSES
    from attnbench.results.store import OutputDirError
    from attnbench.runner import Runner, RunOptions

    try:
        runner = Runner(suite, RunOptions(
            device=args.device, repeats=args.repeat, warmup=args.warmup, seed=args.seed,
            sleep_s=args.sleep, out_dir=args.out, noise_threshold=args.noise_threshold,
            attempts=args.attempts, retry_pause_s=args.retry_pause, resume=args.resume,
            impl_timeout_s=args.impl_timeout or None))
        if args.dry_run:
            print_cases(suite, console)
            print_skips(runner, console)
            return 0
        notes = runner.prepare()  # the results folder and day file, before any measurement
    except OutputDirError as exc:
        print(f"error: {'--out' if args.out is not None else 'results folder'}: {exc}",
              file=sys.stderr)
        return 2
    except ValueError as exc:  # ResultFileError (the day file) included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)
    rows = run_with_progress(runner, console)
    print_table(rows, console)
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
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
    """Run the suite with a progress bar whose estimate of the time left weighs each case by
    the measurements its capability checks leave (a skipped implementation costs nothing)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    skipped = runner.gpu_only_skipped()
    if skipped:
        console.print(f"[yellow]no CUDA device: skipping GPU-only implementations "
                      f"{', '.join(skipped)} (their rows are written as skipped)[/yellow]")
    rows: list[dict] = []
    cases = runner.suite.cases
    weights = [1 + runner.measurements(c) for c in cases]  # 1: inputs, reference, rows
    total, done = sum(weights), 0
    start = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), console=console,
                  transient=False) as progress:
        task = progress.add_task(f"{runner.suite.name}", total=len(cases),
                                 eta=eta_text(0.0, 0, total))
        it = runner.iter_cases()
        for i in range(len(cases)):
            progress.update(task, description=f"{runner.suite.name}: {cases[i].name}")
            _, case_rows = next(it)
            rows.extend(case_rows)
            done += weights[i]
            progress.update(task, advance=1,
                            eta=eta_text(time.monotonic() - start, done, total))
        progress.update(task, description=runner.suite.name)
    return rows


def eta_text(elapsed_s: float, done: float, total: float) -> str:
    """'eta 3m05s': the time left if the rest goes at the pace so far ('eta --' before any)."""
    if done <= 0:
        return "eta --"
    left = max(0.0, elapsed_s / done * (total - done))
    m, sec = divmod(round(left), 60)
    h, m = divmod(m, 60)
    return "eta " + (f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s")


def print_cases(suite, console) -> None:
    """One line per case (plain text, so it can be piped): name, kind, modes, impls."""
    console.print(f"suite {suite.name}: {len(suite.cases)} cases", highlight=False)
    for c in suite.cases:
        impls = [c.baseline] + [i for i in c.impls if i != c.baseline]
        console.print(f"{c.name}  kind={c.kind}  modes={','.join(c.modes)}  "
                      f"impls={','.join(impls)} (baseline {c.baseline})", highlight=False,
                      soft_wrap=True)


def print_skips(runner, console) -> None:
    """What this machine skips, per implementation and reason (the capability checks only)."""
    dev = runner.device
    where = dev.type if dev.type == "cpu" else f"{dev.type}, {dev.name}"
    skips = runner.skip_summary()
    if not skips:
        console.print(f"on this machine ({where}) the capability checks skip nothing",
                      highlight=False)
        return
    console.print(f"on this machine ({where}) these are skipped:", highlight=False)
    for impl, reason, n, of in sorted(skips):
        rows = "every row" if n == of else f"{n} of {of} rows"
        console.print(f"  {impl} ({rows}): {reason}", highlight=False, soft_wrap=True)
    console.print("(preparing an implementation can skip more, e.g. a backward with no "
                  "kernel for the head dim: the forward is still measured)", highlight=False)


def spread_marked(row: dict) -> bool:
    """A row the table marks: status noisy, or spread above SPREAD_MARK of the median."""
    if row["status"] == "noisy":
        return True
    med, spread = row.get("latency_ms"), row.get("latency_spread_ms")
    if row["status"] != "ok" or med is None or spread is None or not med > 0:
        return False
    return spread > SPREAD_MARK * med


def _fmt(x: float, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict], console, show_skipped: bool = False) -> None:
    """Results grouped by case; per (case, mode) the fastest ok implementation in bold green."""
    from rich.table import Table

    table = Table(title="results", show_lines=False)
    # bandwidth-bound rows (decode) are read in TB/s and fraction of peak bandwidth
    traffic = any(_fmt(r.get("tbps", math.nan), "g") for r in rows)
    rate, frac = ("TB/s", "BW") if traffic else ("TFLOP/s", "MFU")
    for col, just in (("case", "left"), ("mode", "left"), ("impl", "left"),
                      ("status", "left"), ("ms", "right"), (rate, "right"),
                      (frac, "right"), ("speedup", "right"), ("rel_err", "right"),
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
    hidden = marked = 0
    for case, case_rows in by_case.items():
        shown = [r for r in case_rows if show_skipped or r["status"] != "skipped"]
        hidden += len(case_rows) - len(shown)
        for i, r in enumerate(sorted(shown, key=lambda r: (r["mode"], r["impl"]))):
            style = "bold green" if fastest.get((r["case"], r["mode"])) is r else None
            if r["status"] in ("failed", "error"):
                style = "red"
            elif r["status"] == "noisy":
                style = "yellow"
            mark = "*" if spread_marked(r) else ""
            marked += bool(mark)
            table.add_row(case if i == 0 else "", r["mode"], r["impl"], r["status"],
                          _fmt(r["latency_ms"], ".4g") + mark,
                          _fmt(r.get("tbps") if traffic else r["tflops"], ".3g"),
                          _fmt(r.get("bw_frac") if traffic else r["mfu"], ".1%"),
                          _fmt(r["speedup"], ".2f"),
                          _fmt(r["rel_err"], ".1e"), (r["reason"] or "")[:80], style=style)
        if shown:
            table.add_section()
    console.print(table)
    if marked:
        console.print(f"* {marked} rows: interquartile spread above {SPREAD_MARK:.0%} of the "
                      "median, or status noisy (above the re-measure threshold in every "
                      "attempt): do not rely on these numbers", highlight=False)
    if hidden:
        console.print(f"({hidden} skipped rows not shown; see the result file for reasons)")
