"""The decode kernels' TB/s over DecodeConfigs for some cases of the decode suite (the
measurements behind the kind's defaults; results/NOTES.md). One process, every config of a case
on the same inputs; kernels compiled in parallel first.

    python scripts/decode_sweep.py OUT.json [GLOB,GLOB...] [N:STAGES:SPLITS ...]
"""

from __future__ import annotations

import fnmatch
import json
import sys

import torch

from attnbench.decode import case_traffic, decode_customs, make_decode_inputs
from attnbench.impls import get_impl
from attnbench.suites import load_suite
from attnbench.timing import measure
from engine.kernels.attention_decode.plan import DecodeConfig
from engine.runtime.device import sm_count
from engine.runtime.precompile import precompile
from engine.variants import get_variant

DEFAULT_CONFIGS = ["128:2:0", "64:2:0", "128:3:0", "64:3:0", "64:1:0"]


def _time(fn) -> float:
    """The median ms of `fn` as attnbench run times a row (queued behind a spin kernel, so
    that the module's host time is not timed as GPU time)."""
    return measure(fn, device="cuda", repeats=30, warmup=5).median_ms


def _modules(case, configs: list[DecodeConfig]):
    variant = get_variant(case.variant)
    impl = get_impl("engine")
    pages = case.batch * case.seqlen_kv // case.page_size if case.page_size else 0
    out = []
    for cfg in configs:
        mod = impl.build(case, variant)
        mod.decode_config = cfg
        mod.check_cache_values = False
        out.append((cfg, mod, mod.decode_kernels(case.page_size, pages,
                                                 sm_count(torch.device("cuda")))))
    return variant, out


def main(argv: list[str]) -> int:
    out_path, pattern = argv[0], argv[1] if len(argv) > 1 else "*"
    configs = [DecodeConfig(*map(int, c.split(":"))) for c in (argv[2:] or DEFAULT_CONFIGS)]
    cases = [c for c in load_suite("decode").cases
             if any(fnmatch.fnmatch(c.name, p) for p in pattern.split(","))]
    built = [(c, *_modules(c, configs)) for c in cases]
    precompile([s for _, _, mods in built for _, _, dk in mods for s in dk.sources()])
    records = []
    for case, variant, mods in built:
        inputs = make_decode_inputs(case, variant, "cuda", seed=0)
        nbytes, _ = case_traffic(case, variant, seed=0)
        customs = decode_customs(inputs)
        for cfg, mod, dk in mods:
            args = [customs[n] for n in mod.custom_io.names()]
            ms = _time(lambda mod=mod, args=args, inputs=inputs: mod(
                inputs["q"], inputs["k_cache"], inputs["v_cache"], *args,
                cache_seqlens=inputs["cache_seqlens"], block_table=inputs["block_table"]))
            rec = dict(case=case.name, config=cfg.key(), splits=dk.plan.splits,
                       chunk=dk.plan.chunk, block_N=dk.plan.block_N, ms=ms,
                       tbps=nbytes / ms / 1e9)
            print(f"{case.name:55s} {cfg.key():14s} splits {dk.plan.splits:3d} "
                  f"{ms * 1e3:8.1f} us {rec['tbps']:.2f} TB/s", flush=True)
            records.append(rec)
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main(sys.argv[1:]))
