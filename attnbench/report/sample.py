"""Synthetic, schema-valid result rows: realistic random numbers from a seeded generator.

Used by the tests of the gate and the dashboard (which must not depend on the suite runner) and by
`attnbench report --demo` to preview the dashboard before any H100 run is committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from attnbench.baseline import write_csv  # noqa: F401  (re-exported for tests)
from attnbench.results.schema import COLUMN_NAMES, COLUMNS, SCHEMA_VERSION

# Typical H100 TFLOP/s levels (fp16/bf16, D=128; see shared ANCHORS.md) used as the centre of the
# random draws; bwd runs at roughly 0.8x the forward rate.
_LEVELS = {
    "engine": 560.0,
    "fa3": 650.0,
    "sdpa-cudnn": 590.0,
    "flex": 430.0,
    "sdpa-flash": 340.0,
    "sdpa-efficient": 175.0,
    "reference": 60.0,
}
_PEAK = {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}
_ERR = {"bf16": 3e-3, "fp16": 4e-4, "fp32": 1e-6}


@dataclass(frozen=True)
class SampleSpec:
    suite: str = "softmax"
    variants: tuple[str, ...] = ("causal", "alibi")
    shape: str = "llama3-8b"
    seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    dtypes: tuple[str, ...] = ("bf16",)
    modes: tuple[str, ...] = ("fwd", "bwd")
    impls: tuple[str, ...] = ("engine", "fa3", "sdpa-cudnn", "flex", "reference")
    baseline: str = "sdpa-cudnn"
    gpu: str = "NVIDIA H100 80GB HBM3"
    device: str = "cuda"  # cpu for a local CPU run (gpu "cpu")
    git_sha: str = "0123456789abcdef0123456789abcdef01234567"
    timestamp: str = "2026-11-22T10:00:00Z"
    tokens: int = 16384  # batch * seqlen, as in FlashAttention's benchmark grid


def sample_rows(rng: np.random.Generator, spec: SampleSpec = SampleSpec()) -> pd.DataFrame:
    """One schema-valid row per (case, impl, mode), with seeded random but plausible values."""
    heads, dim = 32, 128
    rows: list[dict] = []
    for variant in spec.variants:
        causal = "causal" in variant
        for dtype in spec.dtypes:
            for seqlen in spec.seqlens:
                batch = max(1, spec.tokens // seqlen)
                case = f"{variant}-{spec.shape}-s{seqlen}-b{batch}-{dtype}"
                for mode in spec.modes:
                    flops = 4.0 * batch * heads * seqlen * seqlen * dim
                    flops *= 0.5 if causal else 1.0
                    flops *= {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
                    times: dict[str, float] = {}
                    for impl in spec.impls:
                        rows.append(
                            _row(rng, spec, variant, case, causal, dtype, seqlen, batch, mode,
                                 impl, flops, heads, dim, times)
                        )
                    base_ms = times.get(spec.baseline, math.nan)
                    for row in rows[-len(spec.impls):]:
                        row["speedup"] = base_ms / row["latency_ms"]
    rows = [_fill(row) for row in rows]
    return pd.DataFrame(rows, columns=list(COLUMN_NAMES)).astype(dict(COLUMNS))


def _fill(row: dict) -> dict:
    """Schema columns these samples do not draw (added by a later schema version): attempts 1
    for a measured row and 0 otherwise, NaN for numbers (as on a machine without NVML)."""
    for name, dtype in COLUMNS:
        if name in row:
            continue
        if name == "attempts":
            row[name] = 1 if row["status"] in ("ok", "noisy") else 0
        else:
            row[name] = {"float64": math.nan, "int64": 0, "boolean": False}.get(dtype, "")
    return row


def _row(rng, spec, variant, case, causal, dtype, seqlen, batch, mode, impl, flops, heads, dim,
         times) -> dict:
    row = {
        "schema_version": SCHEMA_VERSION, "suite": spec.suite, "case": case, "variant": variant,
        "shape": spec.shape, "batch": batch, "heads_q": heads, "heads_kv": heads,
        "seqlen_q": seqlen, "seqlen_kv": seqlen, "head_dim": dim, "head_dim_v": dim,
        "dtype": dtype, "causal": causal, "mask": "causal" if causal else "none", "mode": mode,
        "impl": impl, "baseline": spec.baseline, "flops": flops, "status": "ok", "reason": "",
        "device": spec.device, "gpu": spec.gpu, "driver": "580.95.05", "cuda": "13.0",
        "torch": "2.11.0+cu130", "triton": "3.6.0", "tilelang": "0.1.15",
        "git_sha": spec.git_sha, "seed": 0, "timestamp": spec.timestamp,
        "compile_s": float(rng.uniform(2, 40)) if impl == "engine" else 0.0,
    }
    nan_fields = ("latency_ms", "latency_spread_ms", "tflops", "mfu", "speedup", "rel_err",
                  "max_abs_err", "peak_mem_mb")
    if impl == "fa3" and (mode != "fwd" or dtype != "bf16"):
        row.update({k: math.nan for k in nan_fields}, repeats=0, status="skipped",
                   reason="fa3-fwd has bf16 forward only")
        return row
    level = _LEVELS.get(impl, 300.0) * (0.8 if mode != "fwd" else 1.0)
    # Short sequences leave the GPU under-occupied: rate climbs towards its level with seqlen.
    tflops = level * (1 - 0.35 * math.exp(-seqlen / 3000)) * float(rng.lognormal(0, 0.04))
    latency = flops / (tflops * 1e12) * 1e3
    times[impl] = latency
    rel = _ERR.get(dtype, 1e-3) * float(rng.lognormal(0, 0.3))
    row.update(
        latency_ms=latency,
        latency_spread_ms=latency * float(rng.uniform(0.004, 0.02)),
        repeats=int(rng.integers(30, 100)),
        tflops=tflops,
        mfu=tflops / _PEAK.get(dtype, 989.0),
        rel_err=rel,
        max_abs_err=rel * float(rng.uniform(5, 20)),
        peak_mem_mb=float(batch * heads * seqlen * dim * 2 * 4 / 2**20 * rng.uniform(1.0, 1.2)),
    )
    return row
