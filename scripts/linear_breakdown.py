"""Kernel-by-kernel GPU time of the linear suite's cases (issue 18: what bounds a row), for each
implementation as its rows run it: the harness's own inputs, mappings and contexts
(attnbench.linear, the impls' `prepare`; fla's gated backward through its adapter), the
forward and the forward+backward under torch.profiler.

Usage: python scripts/linear_breakdown.py OUT.json [PATTERNS] [IMPL,IMPL]
  PATTERNS: the linear suite's cases whose name contains or glob-matches one of these
  space-separated patterns (as attnbench run --filter; default all); impls default
  engine,fla. An impl `engine@fwd=KEY` or `engine@bwd=KEY` (or both,
  `engine@fwd=KEY@bwd=KEY`) runs the engine's module with that
  LinearConfig (its key, as kernel headers name it: C64_K64_V64_s2_t128) for the forward or a
  training call's backward, beside its defaults: a config's kernels against the default's in
  one run.
The record ({case: {impl: {mode: {"kernels_us", "kernels": {"i:name": us}}}}}, kernels in
launch order) is rewritten atomically after every case, so a cut run keeps what it measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnbench.impls import get_impl
from attnbench.kernel_profile import kernel_times
from attnbench.linear import make_linear_inputs
from attnbench.runner import default_get_linear_variant
from attnbench.suites import load_suite
from engine.kernels.linear_fwd.plan import LinearConfig
from engine.tuning.tune_file import atomic_write_json

MODES = ("fwd", "fwd+bwd")
CONFIG_ATTRS = {"fwd": "config", "bwd": "backward_config"}  # LinearAttentionEngine's
TIMES = kernel_times  # tests replace it (no CUDA profiler on a CPU)


def breakdown(case, impls: list[str], device: str = "cuda") -> dict:
    """{impl: {mode: kernel_times}} of one case (an impl that cannot run it: its reason)."""
    variant = default_get_linear_variant(case.variant)
    inputs, grad_out = make_linear_inputs(case, variant, device, seed=0)
    out: dict = {}
    for name in impls:
        base, configs = impl_spec(name)
        impl = get_impl(base)
        reason = impl.unavailable()
        if reason is not None:
            out[name] = {"skipped": reason}
            continue
        for mode in MODES:
            p = impl.prepare(case, variant, inputs, mode != "fwd")
            set_configs(p, configs)
            with p.context():
                g = None if mode == "fwd" else p.from_common(grad_out)
                out.setdefault(name, {})[mode] = TIMES(p.timed_call(mode, g))
            print(case.name, name, mode, out[name][mode]["kernels_us"], flush=True)
    return out


def impl_spec(text: str) -> tuple[str, dict]:
    """(implementation name, {module attribute: LinearConfig}) of an impl argument."""
    name, *parts = text.split("@")
    configs = {}
    for part in parts:
        which, _, key = part.partition("=")
        if which not in CONFIG_ATTRS or not key:
            raise ValueError(f"impl {text!r}: expected NAME@fwd=KEY and/or @bwd=KEY, "
                             f"got {part!r}")
        configs[CONFIG_ATTRS[which]] = LinearConfig.from_key(key)
    return name, configs


def set_configs(p, configs: dict) -> None:
    """Set the prepared call's module configs (an implementation that exposes no module
    refuses them)."""
    if not configs:
        return
    module = p.extra.get("module")
    if module is None:
        raise ValueError(f"{sorted(configs)}: this implementation exposes no module to set")
    for attr, cfg in configs.items():
        setattr(module, attr, cfg)


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
