"""The columns of a result row (one per case x implementation x mode).

Result files are CSV under `results/runs/<date>-<gpu>-<suite>.csv` (GPU runs; CPU runs go to
`results/local/`). Every file carries the `schema_version` column; readers accept this version
and versions 1 and 2 (which lacked `V2_COLUMNS` and/or `V3_COLUMNS`; `read.py` fills them) and
refuse any other version or missing columns.

Version 2 added `attempts` (timing attempts the row needed: 1 normally, more when a noisy
measurement was re-taken, 0 for rows not measured), the GPU's clocks, temperature and power read
through NVML right after the row's measurement (NaN on a CPU or without NVML), and the status
`noisy` (spread still above the re-measure threshold after every attempt; the row keeps the
tightest attempt's numbers).

Version 3 added the memory traffic of a row, for bandwidth-bound cases (decode): `bytes` (the
bytes a case must move: the K and V cache bytes within each sequence's valid length, or its
window, plus q and o; `attnbench.decode.decode_bytes`), `tbps` (bytes / latency, in TB/s) and
`bw_frac` (tbps over the GPU's peak memory bandwidth, `metrics.GPU_MEM_BW`). Rows of other
kinds leave them NaN, as do version-1 and version-2 files when read.
"""

from __future__ import annotations

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

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
    # version 3: memory traffic (decode rows; NaN elsewhere)
    ("bytes", "float64"),  # bytes the case must move (attnbench.decode.decode_bytes)
    ("tbps", "float64"),  # bytes / latency, 1e12 B/s
    ("bw_frac", "float64"),  # tbps / the device's peak memory bandwidth
    ("timestamp", "string"),  # ISO 8601, UTC
)

# Columns a version-1 file lacks; readers fill them (attempts 1 for ok rows else 0, NVML NaN).
V2_COLUMNS: tuple[str, ...] = (
    "attempts", "sm_clock_mhz", "mem_clock_mhz", "gpu_temp_c", "gpu_power_w",
)

# Columns a version-1 or version-2 file lacks; readers fill them with NaN.
V3_COLUMNS: tuple[str, ...] = ("bytes", "tbps", "bw_frac")

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in COLUMNS)
STATUSES = ("ok", "noisy", "skipped", "failed", "error")
MODES = ("fwd", "bwd", "fwd+bwd")


def columns_of(version: int) -> tuple[str, ...]:
    """The columns a file of `version` (one of READABLE_VERSIONS) must have."""
    missing = {1: V2_COLUMNS + V3_COLUMNS, 2: V3_COLUMNS}.get(version, ())
    return tuple(c for c in COLUMN_NAMES if c not in missing)
