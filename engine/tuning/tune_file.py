"""Tune files: the best config per problem, written by `attnbench tune`, read by the engine.

One JSON file per GPU and kernel template (`results/tune/<gpu-slug>/<template>.json`):

    {"format_version": 1, "tilelang_version": "0.1.15", "template": "attention_fwd",
     "entries": {"<key>": {"template": ..., "spec_hash": ..., "dtype": "bf16", "mode": "fwd",
                          "gpu": "NVIDIA H100 80GB HBM3", "shape": {...}, "config": {...},
                          "latency_ms": ..., "tflops": ..., "date": ..., "tilelang_version": ...,
                          ...}}}

A kind's config type (engine.kernels.registry: KernelConfig, the decode kind's DecodeConfig) reads
and checks its entries' `config` (`config_type=`). Decode shapes add `page_size` (0: contiguous
cache) to the seven sizes; their key's shape tag ends in `_page<n>`, and a nearest-shape
fallback keeps it (attention shapes have no page_size: their keys are unchanged).

Entries written by `attnbench tune` also carry what the A/B confirmation found (`outcome`,
`default_config`, `default_latency_ms`, `trial_latency_ms`, `best_trial`, `confirm`: see
attnbench/tune/runner.py); readers need only the keys above, so older entries stay readable.

Reading never raises into the user's program: a missing file is silent, a corrupt file or one
written by another format or TileLang version gives a `TuneFileWarning` and is ignored (the
engine falls back to its default config). Writing is atomic (temp file in the same folder,
fsync, os.replace) under an advisory lock so concurrent tuners never lose each other's entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.dtypes import short_dtype_name
from engine.fsutil import atomic_write_text
from engine.gpus import gpu_slug
from engine.plan.config import ConfigError, KernelConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHAPE_KEYS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim", "head_dim_v")
# Sizes only some kinds' shapes have: decode's page size (0: a contiguous cache), the linear
# kinds' value heads (engine/kernels/linear_fwd/tune_shape.py).
OPTIONAL_SHAPE_KEYS = ("page_size", "heads")
# A nearest-shape fallback may change batch and sequence lengths, never heads, head dims or the
# paging (those change the kernel itself, not only its grid).
FIXED_SHAPE_KEYS = ("heads_q", "heads_kv", "head_dim", "head_dim_v", "page_size", "heads")
REQUIRED_ENTRY_KEYS = ("template", "spec_hash", "dtype", "mode", "gpu", "shape", "config")


class TuneFileWarning(UserWarning):
    """A tune file could not be used; the engine falls back to default configs."""


def tilelang_version() -> str:
    """The installed TileLang version, read from package metadata (no heavy import)."""
    try:
        return metadata.version("tilelang")
    except metadata.PackageNotFoundError:
        return "none"


def normalize_dtype(dtype: Any) -> str:
    """'bf16', 'bfloat16' or torch.bfloat16 -> 'bf16' (same for fp16, fp32, fp8): the short
    name of the one dtype table (engine.dtypes)."""
    return short_dtype_name(dtype)


def default_dir() -> Path:
    """`$ATTNBENCH_TUNE_DIR`, else `results/tune` of the repository this engine lives in."""
    env = os.environ.get("ATTNBENCH_TUNE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "results" / "tune"


def default_path(gpu: str, template: str) -> Path:
    return default_dir() / gpu_slug(gpu) / f"{template}.json"


def shape_tag(shape: Mapping[str, int]) -> str:
    s = {k: int(shape[k]) for k in SHAPE_KEYS}
    tag = (
        f"b{s['batch']}_hq{s['heads_q']}_hkv{s['heads_kv']}_sq{s['seqlen_q']}"
        f"_skv{s['seqlen_kv']}_d{s['head_dim']}_dv{s['head_dim_v']}"
    )
    tag += f"_page{int(shape['page_size'])}" if "page_size" in shape else ""
    return tag + (f"_h{int(shape['heads'])}" if "heads" in shape else "")


def entry_key(
    *, template: str, spec_hash: str, dtype: str, mode: str, gpu: str, shape: Mapping[str, int]
) -> str:
    return "|".join(
        [template, str(spec_hash), normalize_dtype(dtype), mode, gpu_slug(gpu), shape_tag(shape)]
    )


def _check_shape(shape: Mapping[str, Any]) -> dict[str, int]:
    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"shape: missing key(s) {missing}; expected keys {list(SHAPE_KEYS)}")
    out = {}
    for k in SHAPE_KEYS:
        v = shape[k]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"shape[{k!r}]={v!r}: expected a positive int")
        out[k] = v
    for k in OPTIONAL_SHAPE_KEYS:
        if k in shape:
            v = shape[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"shape[{k!r}]={v!r}: expected an int >= 0")
            out[k] = v
    return out


def _read(path: Path) -> dict | None:
    """The parsed file, or None (with a TuneFileWarning unless the file simply does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn(path, f"cannot be read ({exc})")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        _warn(path, f"is not valid JSON ({exc.msg} at line {exc.lineno})")
        return None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        _warn(path, "is not a tune file (expected an object with an 'entries' object)")
        return None
    if data.get("format_version") != FORMAT_VERSION:
        _warn(
            path,
            f"has format_version {data.get('format_version')!r}; this engine reads "
            f"{FORMAT_VERSION}. Re-run `attnbench tune` to regenerate it",
        )
        return None
    installed = tilelang_version()
    if data.get("tilelang_version") != installed:
        _warn(
            path,
            f"was tuned with TileLang {data.get('tilelang_version')!r} but {installed!r} is "
            "installed; configs may no longer be the fastest. Re-run `attnbench tune`",
        )
        return None
    return data


def _warn(path: Path, what: str) -> None:
    warnings.warn(
        f"tune file {path} {what}; ignoring it and using default kernel configs",
        TuneFileWarning,
        stacklevel=3,
    )


def _distance(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    # Log-scale distance: 4k vs 8k is as far as 8k vs 16k. Sequence lengths dominate the
    # choice of tiles more than batch does.
    d = 0.0
    for k, weight in (("seqlen_q", 1.0), ("seqlen_kv", 1.0), ("batch", 0.25)):
        d += weight * abs(math.log2(a[k] / b[k]))
    return d


def lookup(
    path: str | os.PathLike | None,
    *,
    template: str,
    spec_hash: str,
    dtype: str,
    mode: str,
    gpu: str,
    shape: dict,
    config_type: type = KernelConfig,
) -> tuple[Any, dict] | None:
    """The tuned config (a `config_type`) for this problem and its entry's metadata, or None.

    An exact shape match wins; otherwise the nearest tuned shape with the same heads, head
    dims and paging (by log-distance of sequence lengths and batch), announced with a
    logging.info line. `path=None` means `default_path(gpu, template)`. The metadata dict is a
    copy of the entry plus `exact` (bool) and `requested_shape`.
    """
    want = _check_shape(shape)
    dtype_n = normalize_dtype(dtype)
    p = Path(path) if path is not None else default_path(gpu, template)
    try:
        data = _read(p)
    except Exception as exc:  # never let a tune file take down the user's program
        _warn(p, f"could not be loaded ({type(exc).__name__}: {exc})")
        return None
    if data is None:
        return None
    best: tuple[float, str, dict] | None = None
    for key, entry in data["entries"].items():
        if not isinstance(entry, dict) or any(k not in entry for k in REQUIRED_ENTRY_KEYS):
            continue
        try:
            if (
                entry["template"] != template
                or str(entry["spec_hash"]) != str(spec_hash)
                or normalize_dtype(entry["dtype"]) != dtype_n
                or entry["mode"] != mode
                or gpu_slug(entry["gpu"]) != gpu_slug(gpu)
            ):
                continue
            have = _check_shape(entry["shape"])
        except (ValueError, TypeError):
            continue
        if any(have.get(k) != want.get(k) for k in FIXED_SHAPE_KEYS):
            continue
        dist = _distance(have, want)
        if best is None or (dist, key) < (best[0], best[1]):
            best = (dist, key, entry)
    if best is None:
        return None
    dist, key, entry = best
    try:
        cfg = config_type.from_dict(dict(entry["config"]))
    except (ConfigError, TypeError, ValueError) as exc:
        _warn(p, f"has an unusable config in entry {key!r} ({exc})")
        return None
    meta = dict(entry)
    meta["exact"] = dist == 0.0
    meta["requested_shape"] = dict(want)
    if dist:
        log.info(
            "tune file %s: no entry for shape %s; using the nearest tuned shape %s (%s)",
            p,
            shape_tag(want),
            shape_tag(entry["shape"]),
            cfg.key(),
        )
    return cfg, meta


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to `path` so that a reader sees the old or the new file, never a partial one."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def store(path: str | os.PathLike, entry: Mapping[str, Any],
          config_type: type = KernelConfig) -> str:
    """Add or replace one entry (keyed by template, spec hash, dtype, mode, GPU and shape),
    keeping all other entries; its config must be a valid `config_type` dict. Returns the
    entry's key. A corrupt file or one of another format/TileLang version is moved aside to
    `<name>.bak` (with a warning) and a new one started.
    """
    key, _, _ = _store(path, entry, keep_old=None, config_type=config_type)
    return key


def store_if_faster(
    path: str | os.PathLike, entry: Mapping[str, Any], config_type: type = KernelConfig
) -> tuple[bool, dict | None]:
    """Like `store`, but an existing entry for the same key with a lower `latency_ms` is kept
    (checked under the file lock, so two tuners never overwrite a faster entry). Returns
    (written, the previous entry or None)."""
    return store_unless(path, entry, _faster_or_equal, config_type)


def store_unless(
    path: str | os.PathLike, entry: Mapping[str, Any],
    keep_old: Callable[[Mapping[str, Any], Mapping[str, Any]], bool],
    config_type: type = KernelConfig,
) -> tuple[bool, dict | None]:
    """Like `store`, but an existing entry for the same key is kept when `keep_old(old, new)`
    says so (decided under the file lock). Returns (written, the previous entry or None)."""
    _, written, old = _store(path, entry, keep_old=keep_old, config_type=config_type)
    return written, old


def _store(
    path: str | os.PathLike, entry: Mapping[str, Any], *, keep_old, config_type: type
) -> tuple[str, bool, dict | None]:
    missing = [k for k in (*REQUIRED_ENTRY_KEYS, "latency_ms", "tflops", "date") if k not in entry]
    if missing:
        raise ValueError(f"entry: missing key(s) {missing}")
    entry = dict(entry)
    entry["shape"] = _check_shape(entry["shape"])
    entry["dtype"] = normalize_dtype(entry["dtype"])
    config_type.from_dict(dict(entry["config"]))  # reject a malformed config before writing
    entry.setdefault("tilelang_version", tilelang_version())
    key = entry_key(**{k: entry[k] for k in ("template", "spec_hash", "dtype", "mode", "gpu",
                                             "shape")})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with _locked(p):
        data = None
        if p.exists():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                data = _read(p)
            if data is None:
                reason = "; ".join(str(w.message) for w in caught) or "unreadable"
                backup = p.with_name(p.name + ".bak")
                os.replace(p, backup)
                warnings.warn(
                    f"tune file {p}: replaced; the previous file was moved to {backup} ({reason})",
                    TuneFileWarning,
                    stacklevel=3,
                )
        if data is None:
            data = {
                "format_version": FORMAT_VERSION,
                "tilelang_version": tilelang_version(),
                "template": entry["template"],
                "entries": {},
            }
        old = data["entries"].get(key)
        old = dict(old) if isinstance(old, dict) else None
        if keep_old is not None and old is not None and keep_old(old, entry):
            log.info(
                "tune file %s: kept the existing entry for %s (%s ms) over the new one "
                "(%.4g ms)", p, key, old.get("latency_ms"), entry["latency_ms"],
            )
            return key, False, old
        data["entries"][key] = entry
        atomic_write_json(p, data)
    return key, True, old


def _faster_or_equal(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    try:
        return float(old["latency_ms"]) <= float(new["latency_ms"])
    except (KeyError, TypeError, ValueError):  # an old entry without a usable latency loses
        return False
