"""Same-process A/B of kernel variants on a suite's cases: what NOTES calls a probe. Each arm
is an implementation, optionally with module constants patched while it builds its kernels
(a plan's switch or bound), e.g. the persistent backward walk forced at 4k beside the default
and cuDNN:

    python scripts/kernel_probe.py OUT.json paper 'softmax/fa3-paper-d128/b4/*' --mode bwd \
        --arm engine \
        --arm 'engine@engine.kernels.attention_bwd.plan:PERSISTENT_MAX_SQ=65536' \
        --arm sdpa-cudnn

An arm may also set a linear module's configs (`engine@fwd=KEY@bwd=KEY`; attnbench.arms); where
they do not fit a case (a ConfigError), the arm sits that case out, its record {"refused":
reason} (the first arm, the reference, may not). Each
arm is prepared with its patches applied, every arm's engine kernels are compiled together
in worker processes, and each arm is called once with its patches applied (the patches are
restored after it); its outputs (or gradients) are compared with the first arm's in the
common layout. Then every arm is timed in `--rounds`
rounds whose order rotates, each a kernel-time measurement of `--calls` calls by
torch.profiler (attnbench.kernel_profile: GPU time only, no host gaps). Modes as rows time
them: fwd, fwd+bwd, and bwd (the backward alone, on one kept forward).

The record, {case: {arm: {"median_us", "rounds_us", "kernels_us" (median per kernel),
"rel_diff"}, "order": [[arm, ...] per round]}}, is rewritten atomically after each case, so a
cut run keeps what it measured. A probe ranks variants in one process; rows from
`attnbench run` remain the results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnbench.arms import Arm, arm_sources, compile_together, parse_arm, patched, set_configs
from attnbench.deadline import deadline
from attnbench.impls import DeviceInfo, get_impl
from attnbench.kernel_profile import kernel_times
from attnbench.runner import _CaseContext, default_get_linear_variant, default_get_variant
from attnbench.suites import load_suite
from engine.plan.config import ConfigError
from engine.tuning.tune_file import atomic_write_json

MODES = ("fwd", "fwd+bwd", "bwd")
TIMES = kernel_times  # tests replace it (no CUDA profiler on a CPU)
# Deadlines (attnbench.deadline): an arm's first call (its kernels loaded, compiled already)
# and one round's timing; past them a kernel is taken to hang and the script exits.
FIRST_CALL_S, ROUND_S = 180.0, 120.0


def case_inputs(case, device: DeviceInfo) -> tuple[object, dict, torch.Tensor | None]:
    """(variant, inputs, output gradient) of a case, as its rows make them (the runner's case
    context, seed 0)."""
    if case.kind == "decode":
        raise ValueError(f"{case.name}: decode cases are not probed here "
                         "(scripts/decode_sweep.py times the decode kernels)")
    lookup = default_get_linear_variant if case.kind == "linear" else default_get_variant
    variant = lookup(case.variant)
    ctx = _CaseContext(case, variant, device, 0)
    return variant, ctx.inputs, ctx.grad_out


def timed_call(p, case, mode: str, grad: torch.Tensor | None
               ) -> tuple[Callable[[], object], Callable[[object], list[torch.Tensor]]]:
    """(the call a row of `mode` times, its result in the common layout as a tensor list)."""
    if mode == "fwd":
        return p.timed_call("fwd"), lambda out: tensors(p.to_common(out))
    g = p.from_common(grad)

    def common(grads: tuple) -> list[torch.Tensor]:
        return list(p.grads_to_common(grads if case.kind == "linear" else grads[:3]))

    if mode == "fwd+bwd":
        return p.timed_call("fwd+bwd", g), common
    out = p.forward()  # the backward alone, on this one forward's graph
    return (lambda: torch.autograd.grad(out, p.leaves, g, retain_graph=True)), common


def tensors(x) -> list[torch.Tensor]:
    """A result's tensors, in order (a continuation's forward returns (o, final state))."""
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors(item)]
    return [] if x is None else [x]


def rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    """max |got - want| / max |want| per tensor both have (implementations may differ in how
    many gradients they give: the learnable inputs')."""
    return [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got, want, strict=False)]


def rotations(arms: list[Arm], rounds: int) -> list[list[Arm]]:
    """Each round's order: the arms rotated by one more each round."""
    return [arms[r % len(arms):] + arms[:r % len(arms)] for r in range(rounds)]


def probe_case(case, arms: list[Arm], mode: str, rounds: int, calls: int,
               device: DeviceInfo) -> dict:
    """One case's record (module docstring)."""
    variant, inputs, grad = case_inputs(case, device)
    prepared, sources, refused = {}, [], {}
    for arm in arms:
        with patched(arm.patches):
            p = get_impl(arm.impl).prepare(case, variant, inputs, mode != "fwd")
            try:
                set_configs(p, arm.configs)
                sources += arm_sources(p, case, variant, inputs, mode)
            except ConfigError as exc:  # a config that does not fit this case: the arm sits out
                if arm is arms[0]:
                    raise  # the reference every other arm is compared with
                refused[arm.label] = str(exc)
                print(f"{case.name} {arm.label}: refused here: {exc}", flush=True)
                continue
        prepared[arm.label] = p
    arms = [a for a in arms if a.label not in refused]
    compile_together(sources)
    ready, outs = {}, {}
    for arm in arms:
        p, t = prepared[arm.label], time.perf_counter()
        with patched(arm.patches), deadline(FIRST_CALL_S, f"{case.name} {arm.label}'s first call"):
            with p.context():
                fn, common = timed_call(p, case, mode, grad)
                outs[arm.label] = common(fn())
            if torch.cuda.is_initialized():  # a kernel that hangs, caught by the deadline
                torch.cuda.synchronize()
        ready[arm.label] = (p, fn)
        print(f"{case.name} {arm.label}: first call {time.perf_counter() - t:.1f} s", flush=True)
    order = rotations(arms, rounds)
    times: dict[str, list[dict]] = {a.label: [] for a in arms}
    for round_arms in order:
        for arm in round_arms:
            p, fn = ready[arm.label]
            with p.context(), deadline(ROUND_S, f"{case.name} {arm.label}'s timing"):
                times[arm.label].append(TIMES(fn, calls=calls))
    record: dict = {a.label: summary(times[a.label], outs[a.label], outs[arms[0].label])
                    for a in arms}
    record.update({label: {"refused": why} for label, why in refused.items()})
    record["order"] = [[a.label for a in r] for r in order]
    return record


def summary(rounds: list[dict], got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    per: dict[str, list[float]] = {}
    for r in rounds:
        for name, us in r.get("kernels", {}).items():
            per.setdefault(name, []).append(us)
    totals = [r["kernels_us"] for r in rounds]
    return {"median_us": statistics.median(totals), "rounds_us": totals,
            "kernels_us": {n: statistics.median(v) for n, v in per.items()},
            "rel_diff": rel_diff(got, want)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the record (JSON), rewritten after each case")
    ap.add_argument("suite", help="a suite name (suites/NAME.toml)")
    ap.add_argument("patterns", help="case patterns, space-separated (as attnbench run --filter)")
    ap.add_argument("--arm", action="append", required=True, type=parse_arm,
                    help="IMPL[@module.path:NAME=VALUE][@fwd=KEY][@bwd=KEY] (attnbench.arms); "
                         "the first is the reference")
    ap.add_argument("--mode", choices=MODES, default="fwd+bwd")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="calls per kernel-time measurement")
    args = ap.parse_args(argv)
    cases = load_suite(args.suite).filtered(args.patterns.split()).cases
    if not cases:
        ap.error(f"patterns {args.patterns!r}: no case of suite {args.suite!r} matches")
    device = DeviceInfo("cuda", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    record: dict = {}
    for case in cases:
        record[case.name] = probe_case(case, args.arm, args.mode, args.rounds, args.calls, device)
        atomic_write_json(args.out, record)
        first = record[case.name][args.arm[0].label]["median_us"]
        for arm in args.arm:
            r = record[case.name][arm.label]
            if "refused" in r:
                continue  # said when it was refused
            print(f"{case.name} {args.mode} {arm.label}: {r['median_us']:.1f} us "
                  f"({first / r['median_us']:.3f}x the first arm's speed), "
                  f"rel_diff {max(r['rel_diff']):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
