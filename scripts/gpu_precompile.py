"""Compile the engine kernels a suite will need, in parallel (run before `attnbench run`)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from attnbench.impls import registry
from attnbench.suites import load_suite
from engine.runtime.precompile import precompile
from engine.variants import get_variant

ENGINE_IMPLS = ("engine", "engine-dynamic", "engine-deterministic")


def _decode_sources(mod, case) -> list[str]:
    """The decode kernels the case's call will build (its paging, this GPU's SM count)."""
    from engine.runtime.device import sm_count

    pages = case.batch * case.seqlen_kv // case.page_size if case.page_size else 0
    return mod.decode_kernels(case.page_size, pages, sm_count(torch.device("cuda"))).sources()


def _linear_sources(impl, case) -> list[str]:
    """The linear kernels the case's call builds (no initial or final state: the suite's
    call), at the configs the module runs (its tune file's, else the plan's)."""
    from attnbench.linear import build_linear, decay_needs_grad
    from engine.variants.linear import get_linear_variant

    variant = get_linear_variant(case.variant)
    mod = build_linear(case, variant, impl.backend)
    return mod.kernel_sources(("fwd", "bwd") if set(case.modes) - {"fwd"} else ("fwd",),
                              decay_grad=decay_needs_grad(variant))


def main(names: list[str], patterns: list[str]) -> int:
    impls = registry()
    srcs = []
    for name in names:
        for c in load_suite(name).filtered(patterns).cases:
            engines = [impls[i] for i in ENGINE_IMPLS if i in c.impls]
            if not engines or c.kind not in ("attention", "decode", "linear"):
                continue
            if c.kind == "linear":
                srcs += _linear_sources(engines[0], c)
                continue
            v = get_variant(c.variant)
            if v.supports(head_dim=c.head_dim, head_dim_v=c.head_dim_v, heads_q=c.heads_q,
                          heads_kv=c.heads_kv, seqlen_q=c.seqlen_q, seqlen_kv=c.seqlen_kv):
                continue
            if c.kind == "decode":
                srcs += _decode_sources(engines[0].build(c, v), c)
                continue
            for impl in engines:
                # The module each implementation times (its dynamic-shape and deterministic
                # settings included); sources shared between them are compiled once.
                mod = impl.build(c, v)
                srcs += mod.kernel_sources(("fwd", "bwd") if set(c.modes) - {"fwd"} else ("fwd",))
    t = time.time()
    errors = precompile(srcs)
    print(f"precompiled {len(set(srcs))} kernels in {time.time() - t:.0f}s, {len(errors)} failed")
    for e in errors.values():
        print("  ", e[:300])
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suites", nargs="+")
    parser.add_argument("--filter", action="append", default=[],
                        help="only the cases attnbench run --filter selects (repeatable)")
    args = parser.parse_args()
    sys.exit(main(args.suites, args.filter))
