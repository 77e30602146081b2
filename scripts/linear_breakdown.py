"""Kernel-by-kernel GPU time of the linear suite's cases (issue 18: what bounds a row), for each
implementation as its rows run it: the harness's own inputs, mappings and contexts
(attnbench.linear, the impls' `prepare`; fla's gated backward through its adapter), the
forward and the forward+backward under torch.profiler.

Usage: python scripts/linear_breakdown.py OUT.json [PATTERNS] [IMPL,IMPL]
  PATTERNS: the linear suite's cases whose name contains or glob-matches one of these
  space-separated patterns (as attnbench run --filter; default all); impls default
  engine,fla. An impl is an arm (attnbench.arms): `engine@fwd=KEY` or `engine@bwd=KEY` (or
  both, `engine@fwd=KEY@bwd=KEY`) runs the engine's module with that LinearConfig (its key,
  as kernel headers name it: C64_K64_V64_s2_t128) for the forward or a training call's
  backward, beside its defaults: a config's kernels against the default's in one run; a part
  `module.path:NAME=VALUE` patches that constant while the impl is measured.
The record ({case: {impl: {mode: {"kernels_us", "kernels": {"i:name": us}}}}}, kernels in
launch order) is rewritten atomically after every case, so a cut run keeps what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnbench.arms import arm_sources, compile_together, parse_arm, patched, set_configs
from attnbench.deadline import deadline
from attnbench.impls import get_impl
from attnbench.kernel_profile import kernel_times
from attnbench.linear import make_linear_inputs
from attnbench.runner import default_get_linear_variant
from attnbench.suites import load_suite
from engine.tuning.tune_file import atomic_write_json

MODES = ("fwd", "fwd+bwd")
TIMES = kernel_times  # tests replace it (no CUDA profiler on a CPU)
DEADLINE_S = 300.0  # one arm's mode, kernels loaded: past it a kernel is taken to hang


def breakdown(case, impls: list[str], device: str = "cuda") -> dict:
    """{impl: {mode: kernel_times}} of one case (an impl that cannot run it: its reason)."""
    variant = default_get_linear_variant(case.variant)
    inputs, grad_out = make_linear_inputs(case, variant, device, seed=0)
    out: dict = {}
    arms = {name: parse_arm(name) for name in impls}
    ready = {}
    for name, arm in arms.items():
        impl = get_impl(arm.impl)
        reason = impl.unavailable()
        if reason is not None:
            out[name] = {"skipped": reason}
            continue
        for mode in MODES:
            with patched(arm.patches):
                p = impl.prepare(case, variant, inputs, mode != "fwd")
                set_configs(p, arm.configs)
                ready[name, mode] = (p, arm_sources(p, case, variant, inputs, mode))
    compile_together([s for _, srcs in ready.values() for s in srcs])
    for (name, mode), (p, _) in ready.items():
        with patched(arms[name].patches), p.context(), \
                deadline(DEADLINE_S, f"{case.name} {name} {mode}"):
            g = None if mode == "fwd" else p.from_common(grad_out)
            out.setdefault(name, {})[mode] = TIMES(p.timed_call(mode, g))
        print(case.name, name, mode, out[name][mode]["kernels_us"], flush=True)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out, patterns = Path(argv[0]), argv[1].split() if len(argv) > 1 else []
    impls = argv[2].split(",") if len(argv) > 2 else ["engine", "fla"]
    record: dict = {}
    for case in load_suite("linear").filtered(patterns).cases:
        record[case.name] = breakdown(case, impls)
        atomic_write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
