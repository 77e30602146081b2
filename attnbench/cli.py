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


class _VersionAction(argparse.Action):
    """--version, worked out only when asked for (it imports torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from attnbench.version_info import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnbench",
        description="Benchmark, tune and compare attention kernels on NVIDIA Hopper GPUs.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of attnbench, torch, TileLang and nvcc, the GPU, "
                        "and exit")
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
