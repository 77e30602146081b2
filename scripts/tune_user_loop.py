"""`tune=True` as a user meets it (issue 22): for three custom variants, build one module with
the engine's defaults and one with `tune=True`, let the second tune on its first call, then time
both in a plain user loop and write a record.

The user loop is what a model does: call the module back to back, no L2 flush, timed with two
CUDA events around `CALLS` calls, after a warm-up of the runner's length (attnbench.timing) so
that the SM clock has settled; the two modules alternate over `ROUNDS` rounds so that clock and
temperature drift hit both alike. Each module's figure is the median of its rounds; the ratio
is the median of the per-round ratios (each round's two timings are adjacent in time).

Usage (a Hopper GPU): python scripts/tune_user_loop.py OUT_DIR [--variants A,B]
The study's budget is tune=True's (ATTNBENCH_TUNE_TRIALS / ATTNBENCH_TUNE_SECONDS override it).
Writes OUT_DIR/user-loop-<gpu>.json and prints a line per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from attnbench.timing import WARMUP_MS, warm_up
from engine import AttentionEngine, CustomIO, OnlineIdentity, OnlineSoftmax, meta_tensor

B, HQ, HKV, S, D = 2, 32, 8, 4096, 128
DTYPE = torch.bfloat16
CALLS, ROUNDS = 20, 16


def _alibi_softcap_window():
    """Not in the library: ALiBi, a tanh soft-cap of 50 and a causal window of 2048 keys."""
    io = CustomIO({"slopes": ("heads",)})

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        s = score * D**-0.5 + custom_fwd_inputs["slopes"] * (kv_idx - q_idx)
        return (s * (1 / 50.0)).tanh() * 50.0

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 2048)

    def customs(gen):
        return [torch.tensor([2.0 ** (-8.0 * (i + 1) / HQ) for i in range(HQ)])]

    return io, score_mod, mask_mod, OnlineSoftmax(), customs


def _temperature_causal():
    """Not in the library: causal softmax with a learned temperature per head."""
    io = CustomIO({"inv_temp": ("heads",)})

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return score * D**-0.5 * custom_fwd_inputs["inv_temp"]

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def customs(gen):
        return [0.5 + torch.rand(HQ, generator=gen)]

    return io, score_mod, mask_mod, OnlineSoftmax(), customs


def _sigmoid_bias():
    """Sigmoid attention with a per-head bias (the library's `sigmoid`, written as a user would)."""
    io = CustomIO({"bias": ("heads",)})

    def score_mod(score, custom_fwd_inputs, b, h, q_idx, kv_idx):
        return (score * D**-0.5 + custom_fwd_inputs["bias"]).sigmoid()

    def customs(gen):
        return [-math.log(S) + 0.1 * torch.randn(HQ, generator=gen)]

    return io, score_mod, None, OnlineIdentity(), customs


VARIANTS = {"alibi_softcap_window": _alibi_softcap_window,
            "temperature_causal": _temperature_causal,
            "sigmoid_bias": _sigmoid_bias}


def _module(spec, tune: bool, tune_file: str) -> AttentionEngine:
    io, score_mod, mask_mod, online, _ = spec
    meta = (meta_tensor(B, HQ, S, D, dtype=DTYPE), meta_tensor(B, HKV, S, D, dtype=DTYPE),
            meta_tensor(B, HKV, S, D, dtype=DTYPE))
    return AttentionEngine(meta, io, score_mod=score_mod, mask_mod=mask_mod,
                           online_func=online, tune=tune, tune_file=tune_file)


def _inputs(spec, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, HQ, D, generator=gen, dtype=DTYPE)
    k = torch.randn(B, S, HKV, D, generator=gen, dtype=DTYPE)
    v = torch.randn(B, S, HKV, D, generator=gen, dtype=DTYPE)
    return [t.cuda() for t in (q, k, v, *spec[4](gen))]


def _round_ms(mod, args) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(CALLS):
        mod(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def user_loop(default, tuned, args) -> dict:
    """Alternate the two modules over ROUNDS rounds; medians and spreads per call in ms."""
    times: dict[str, list[float]] = {"default": [], "tuned": []}
    with torch.no_grad():
        for mod in (default, tuned):
            warm_up(lambda m=mod: m(*args), calls=3, min_ms=WARMUP_MS, sync=torch.cuda.synchronize)
        for r in range(ROUNDS):
            order = ("default", "tuned") if r % 2 == 0 else ("tuned", "default")
            for name in order:
                times[name].append(_round_ms(default if name == "default" else tuned, args))
    med = {n: statistics.median(t) for n, t in times.items()}
    ratios = [t / d for t, d in zip(times["tuned"], times["default"], strict=True)]
    return {"default_ms": med["default"], "tuned_ms": med["tuned"],
            "tuned_over_default": statistics.median(ratios),
            "default_rounds_ms": times["default"], "tuned_rounds_ms": times["tuned"]}


def run_variant(name: str, out: Path) -> dict:
    spec = VARIANTS[name]()
    tune_file = str(out / f"user-loop-tune-{name}.json")
    args = _inputs(spec, seed=len(name))
    default = _module(spec, tune=False, tune_file=tune_file)
    with torch.no_grad():
        default(*args)  # compiles the default config before the tune file has an entry
    tuned = _module(spec, tune=True, tune_file=tune_file)
    t0 = time.perf_counter()
    with torch.no_grad():
        tuned(*args)  # tunes (child process), then compiles the chosen config
    tune_s = time.perf_counter() - t0
    with torch.no_grad():
        ref = default(*args).float()
        err = ((tuned(*args).float() - ref).norm() / ref.norm()).item()
    res = {"variant": name, "tune_s": round(tune_s, 1), "rel_diff_tuned_vs_default": err,
           "default_config": _config_text(default), "tuned_config": _config_text(tuned),
           "same_config": _config_text(default) == _config_text(tuned),
           **user_loop(default, tuned, args)}
    print(f"{name:24s} tune {tune_s:6.1f}s  default {res['default_ms']:.4f} ms  tuned "
          f"{res['tuned_ms']:.4f} ms  ratio {res['tuned_over_default']:.3f}"
          f"{'  (same config)' if res['same_config'] else ''}", flush=True)
    return res


def _config_text(mod) -> str:
    return mod.forward_kernel().config.key()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_user_loop: needs a CUDA GPU", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    rows = [run_variant(n, a.out) for n in a.variants.split(",")]
    record = {"gpu": gpu, "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "git_sha": os.environ.get("ATTNBENCH_GIT_SHA", ""),
              "shape": {"batch": B, "heads_q": HQ, "heads_kv": HKV, "seqlen": S, "head_dim": D,
                        "dtype": "bfloat16"},
              "calls_per_round": CALLS, "rounds": ROUNDS, "variants": rows}
    path = a.out / f"user-loop-{gpu.replace(' ', '-').lower()}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
