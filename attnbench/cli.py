"""The `attnbench` command line. Each subcommand lives in `attnbench/commands/<name>.py` and
exposes `add_parser(subparsers)`; modules are imported lazily so `--help` stays fast and a
CPU-only machine never imports CUDA-only code."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module under attnbench.commands
COMMANDS: dict[str, str] = {
    "run": "run",
    "tune": "tune",
    "compare": "compare",
    "report": "report",
    "baseline": "baseline",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnbench",
        description="Benchmark, tune and compare attention kernels on NVIDIA Hopper GPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(f"attnbench.commands.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"attnbench.commands.{module}":
                raise
            continue  # command not built yet
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
