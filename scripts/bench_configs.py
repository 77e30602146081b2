"""Exploration on the GPU: time the engine's forward under several KernelConfigs against
FlashAttention-3 and cuDNN in the same process (accuracy checked first). Recorded results
come from `attnbench run`; this is for choosing defaults and search spaces.

Usage: python scripts/bench_configs.py '[{"block_M": 192, "threads": 384}, {}]' [variant ...]
"""

from __future__ import annotations

import json
import sys

import torch

from attnbench.timing import L2Flusher, measure
from engine.plan.config import KernelConfig
from engine.reference.executor import rel_err
from engine.runtime.precompile import precompile
from engine.variants import get_variant

SHAPES = [(4, 4096), (1, 16384)]  # (batch, seqlen) at llama3-8b heads, 16k tokens


def main() -> None:
    torch.set_grad_enabled(False)
    cfgs = [KernelConfig.from_dict(c) for c in json.loads(sys.argv[1])]
    variants = sys.argv[2:] or ["softmax", "softmax_causal"]
    dt = torch.bfloat16
    mods = {}
    for vn in variants:
        for B, S in SHAPES:
            for cfg in cfgs:
                v = get_variant(vn)
                mods[vn, B, S, cfg] = v.build(
                    batch=B,
                    heads_q=32,
                    heads_kv=8,
                    seqlen_q=S,
                    seqlen_kv=S,
                    head_dim=128,
                    head_dim_v=128,
                    dtype=dt,
                    backend="tilelang",
                    config=cfg,
                )
    errs = precompile([m.kernel_source for m in mods.values()])
    print(f"precompiled, {len(errs)} failed", *[e[:200] for e in errs.values()], sep="\n")
    flush = L2Flusher(torch.device("cuda"))
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError:
        flash_attn_func = None
    for vn in variants:
        v = get_variant(vn)
        for B, S in SHAPES:
            inp = v.make_inputs(
                batch=B,
                heads_q=32,
                heads_kv=8,
                seqlen_q=S,
                seqlen_kv=S,
                head_dim=128,
                head_dim_v=128,
                dtype=dt,
                device="cuda",
                seed=1,
            )
            frac = 0.5 if v.causal else 1.0
            flops = 4 * B * 32 * S * S * 128 * frac
            ref = None
            row = [f"{vn:15s} B{B} S{S:5d}"]
            if flash_attn_func is not None and v.sdpa_kwargs(inp) is not None:
                def fn(inp=inp, causal=v.causal):
                    return flash_attn_func(inp["q"], inp["k"], inp["v"], causal=causal)

                t = measure(fn, device="cuda", repeats=30, warmup=5, flush=flush)
                row.append(f"fa3 {flops / t.median_ms / 1e9:5.0f}")
            for cfg in cfgs:
                if (vn, B, S, cfg) in mods and mods[vn, B, S, cfg].kernel_source in errs:
                    row.append(f"{cfg.key()}: compile failed")
                    continue
                mod = mods[vn, B, S, cfg]
                out = mod(**inp)
                if ref is None and S <= 4096:  # the materialised reference must fit in memory
                    ref = v.torch_reference(
                        {k: (t[:1] if k in "qkv" else t) for k, t in inp.items()}
                    )
                e = rel_err(out[:1], ref) if ref is not None else float("nan")
                t = measure(
                    lambda m=mod, x=inp: m(**x), device="cuda", repeats=30, warmup=5, flush=flush
                )
                row.append(f"{cfg.key()} {flops / t.median_ms / 1e9:5.0f} (err {e:.1e})")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
