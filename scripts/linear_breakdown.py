"""Kernel-by-kernel GPU time of the linear suite's cases (issue 18: what bounds a row), for each
implementation as its rows run it: the harness's own inputs, mappings and contexts
(attnbench.linear, the impls' `prepare`; fla's gated backward through its adapter), the
forward and the forward+backward under torch.profiler.

Usage: python scripts/linear_breakdown.py OUT.json [PATTERN] [IMPL,IMPL]
  PATTERN: the linear suite's cases whose name contains or glob-matches it (as attnbench run
  --filter; default all); impls default engine,fla.
The record ({case: {impl: {mode: {"kernels_us", "kernels": {"i:name": us}}}}}, kernels in
launch order) is rewritten atomically after every case, so a cut run keeps what it measured.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from attnbench.impls import get_impl
from attnbench.linear import make_linear_inputs
from attnbench.runner import default_get_linear_variant
from attnbench.suites import load_suite
from engine.tuning.tune_file import atomic_write_json

MODES = ("fwd", "fwd+bwd")


def aggregate(events: Iterable[tuple[str, float, float]], calls: int) -> dict:
    """(name, start, duration us) of `calls` identical calls' kernels -> each kernel's mean
    time, keyed by its place in a call's launch order and its name."""
    ordered = sorted(events, key=lambda e: e[1])
    if calls < 1 or len(ordered) % calls:
        raise ValueError(f"{len(ordered)} kernels do not split into {calls} equal calls")
    per = len(ordered) // calls
    times: dict[str, float] = collections.defaultdict(float)
    for i, (name, _, dur) in enumerate(ordered):
        times[f"{i % per}:{name[:60]}"] += dur / calls
    return {"kernels_us": round(sum(times.values()), 1),
            "kernels": {k: round(v, 1) for k, v in times.items()}}


def kernel_times(fn: Callable[[], object], calls: int = 10, warmup: int = 3) -> dict:
    """`fn`'s kernels' GPU time per call (torch.profiler's CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return aggregate(((e.name, e.time_range.start, e.device_time_total)
                      for e in prof.events() if e.device_type == cuda), calls)


TIMES = kernel_times  # tests replace it (no CUDA profiler on a CPU)


def _call(p, mode: str, grad_out: torch.Tensor) -> Callable[[], object]:
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return p.forward()
        return forward
    g = p.from_common(grad_out)
    return lambda: torch.autograd.grad(p.forward(), p.leaves, g)


def breakdown(case, impls: list[str], device: str = "cuda") -> dict:
    """{impl: {mode: kernel_times}} of one case (an impl that cannot run it: its reason)."""
    variant = default_get_linear_variant(case.variant)
    inputs, grad_out = make_linear_inputs(case, variant, device, seed=0)
    out: dict = {}
    for name in impls:
        impl = get_impl(name)
        reason = impl.unavailable()
        if reason is not None:
            out[name] = {"skipped": reason}
            continue
        for mode in MODES:
            p = impl.prepare(case, variant, inputs, mode != "fwd")
            with p.context():
                out.setdefault(name, {})[mode] = TIMES(_call(p, mode, grad_out))
            print(case.name, name, mode, out[name][mode]["kernels_us"], flush=True)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out, patterns = Path(argv[0]), argv[1:2]
    impls = argv[2].split(",") if len(argv) > 2 else ["engine", "fla"]
    record: dict = {}
    for case in load_suite("linear").filtered(patterns).cases:
        record[case.name] = breakdown(case, impls)
        atomic_write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
