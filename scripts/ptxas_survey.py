"""ptxas's view of kernels of the library, on any machine with nvcc (no GPU): registers,
spill bytes, serialised wgmmas (C751x) and, with nvdisasm, the exponentials placed before
each P V wait (engine/runtime/ptxas.py). Kernels are picked from the kernel corpus
(tests/engine/kernel_corpus.py) by glob patterns over its keys, variant|shape|dtype|kind|
config|shapes|role, e.g.

    python scripts/ptxas_survey.py 'softmax*|gqa-4096|bf16|fwd|default|static|main'
    python scripts/ptxas_survey.py '*|d256|*|bwd|default|*|main' --jobs 8 --json out.json

A line per kernel as it compiles; --json also writes them all to a file.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]

import kernel_corpus  # noqa: E402

from engine.runtime.compile import lowered_cuda  # noqa: E402
from engine.runtime.ptxas import compile_cubin, exponentials_before_pv_waits, nvdisasm  # noqa: E402


def matching_sources(patterns: list[str]):
    """(corpus key | role, TileLang source) for every corpus kernel a pattern matches."""
    for key, thunk in kernel_corpus.cases():
        if not any(fnmatch.fnmatchcase(key, p.rsplit("|", 1)[0]) for p in patterns):
            continue  # a pattern's last part is the role: generate only cases that can match
        try:
            sources = thunk()
        except kernel_corpus.REFUSALS:
            continue
        for role, src in sources.items():
            if any(fnmatch.fnmatchcase(f"{key}|{role}", p) for p in patterns):
                yield f"{key}|{role}", src


def survey(name: str, cuda: str, workdir: Path, tool: str | None) -> dict:
    report = compile_cubin(cuda, workdir)
    row = dict(kernel=name, registers=report.registers, spill_bytes=report.spill_bytes,
               serialised=sorted({w[:7] for w in report.serialised}))
    if tool:
        row["exponentials_before_pv_waits"] = exponentials_before_pv_waits(report.cubin, tool)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="+", help="globs over corpus keys (quote them)")
    ap.add_argument("--jobs", type=int, default=2, help="nvcc processes at once")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    args = ap.parse_args(argv)
    tool = nvdisasm()
    if tool is None:
        print("nvdisasm not found: no SASS placement (pip install nvidia-cuda-nvdisasm)",
              file=sys.stderr)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = []
        for i, (name, src) in enumerate(matching_sources(args.patterns)):
            work = Path(tmp) / str(i)
            work.mkdir()
            cuda = lowered_cuda(src)  # TileLang lowers one at a time
            futures.append(pool.submit(survey, name, cuda, work, tool))
        for f in futures:
            rows.append(f.result())
            print(json.dumps(rows[-1]), flush=True)
    if not rows:
        print("no corpus kernel matches", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
