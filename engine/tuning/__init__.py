"""Tune files: tuned KernelConfigs per problem, read by the engine at construction."""

from engine.tuning.tune_file import (
    FORMAT_VERSION,
    TuneFileWarning,
    default_path,
    entry_key,
    gpu_slug,
    lookup,
    normalize_dtype,
    store,
)

__all__ = [
    "FORMAT_VERSION",
    "TuneFileWarning",
    "default_path",
    "entry_key",
    "gpu_slug",
    "lookup",
    "normalize_dtype",
    "store",
]
