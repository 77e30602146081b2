"""The columns of a result row (one per case x implementation x mode).

Result files are CSV under `results/runs/<date>-<gpu>-<suite>.csv`. Every file carries the
`schema_version` column; readers refuse a file from another version or with missing columns.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

# (column, pandas dtype) in file order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("schema_version", "int64"),
    ("suite", "string"),
    ("case", "string"),
    ("variant", "string"),
    ("shape", "string"),
    ("batch", "int64"),
    ("heads_q", "int64"),
    ("heads_kv", "int64"),
    ("seqlen_q", "int64"),
    ("seqlen_kv", "int64"),
    ("head_dim", "int64"),
    ("head_dim_v", "int64"),
    ("dtype", "string"),
    ("causal", "boolean"),
    ("mask", "string"),
    ("mode", "string"),  # fwd | bwd | fwd+bwd
    ("impl", "string"),
    ("baseline", "string"),  # the case's baseline implementation
    ("latency_ms", "float64"),  # median
    ("latency_spread_ms", "float64"),  # interquartile range of the repetitions
    ("repeats", "int64"),
    ("flops", "float64"),  # counted as in ARCHITECTURE.md, unmasked work only
    ("tflops", "float64"),
    ("mfu", "float64"),  # tflops / dense peak of the device for the dtype
    ("speedup", "float64"),  # baseline latency / this latency
    ("rel_err", "float64"),  # max over outputs (and gradients) of ||x - ref|| / ||ref||
    ("max_abs_err", "float64"),
    ("peak_mem_mb", "float64"),
    ("compile_s", "float64"),  # one-off compile time, kept out of latency
    ("status", "string"),  # ok | skipped | failed | error
    ("reason", "string"),
    ("device", "string"),  # cuda | cpu
    ("gpu", "string"),
    ("driver", "string"),
    ("cuda", "string"),
    ("torch", "string"),
    ("triton", "string"),
    ("tilelang", "string"),
    ("git_sha", "string"),
    ("seed", "int64"),
    ("timestamp", "string"),  # ISO 8601, UTC
)

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in COLUMNS)
STATUSES = ("ok", "skipped", "failed", "error")
MODES = ("fwd", "bwd", "fwd+bwd")
