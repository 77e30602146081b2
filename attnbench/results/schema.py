"""The columns of a result row (one per case x implementation x mode).

Result files are CSV under `results/runs/<date>-<gpu>-<suite>.csv` (GPU runs; CPU runs go to
`results/local/`). Every file carries the `schema_version` column; readers accept this version
and version 1 (which lacked `V2_COLUMNS`; `read.py` fills them) and refuse any other version or
missing columns.

Version 2 added `attempts` (timing attempts the row needed: 1 normally, more when a noisy
measurement was re-taken, 0 for rows not measured), the GPU's clocks, temperature and power read
through NVML right after the row's measurement (NaN on a CPU or without NVML), and the status
`noisy` (spread still above the re-measure threshold after every attempt; the row keeps the
tightest attempt's numbers).
"""

from __future__ import annotations

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)

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
    ("status", "string"),  # ok | noisy | skipped | failed | error
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
    # version 2 (timestamp stays last: a cut-off last line is then recognisable)
    ("attempts", "int64"),  # timing attempts (1 normally; 0: not measured)
    ("sm_clock_mhz", "float64"),  # NVML, right after the measurement; NaN without it
    ("mem_clock_mhz", "float64"),
    ("gpu_temp_c", "float64"),
    ("gpu_power_w", "float64"),
    ("timestamp", "string"),  # ISO 8601, UTC
)

# Columns a version-1 file lacks; readers fill them (attempts 1 for ok rows else 0, NVML NaN).
V2_COLUMNS: tuple[str, ...] = (
    "attempts", "sm_clock_mhz", "mem_clock_mhz", "gpu_temp_c", "gpu_power_w",
)

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in COLUMNS)
STATUSES = ("ok", "noisy", "skipped", "failed", "error")
MODES = ("fwd", "bwd", "fwd+bwd")


def columns_of(version: int) -> tuple[str, ...]:
    """The columns a file of `version` (one of READABLE_VERSIONS) must have."""
    if version == 1:
        return tuple(c for c in COLUMN_NAMES if c not in V2_COLUMNS)
    return COLUMN_NAMES
