"""Tune files: round trip, atomic replace, nearest-shape fallback, corrupt/other-version files."""

from __future__ import annotations

import json
import logging
import random

import pytest

from engine.plan.config import KernelConfig
from engine.tuning import tune_file
from engine.tuning.tune_file import TuneFileWarning, lookup, store

GPU = "NVIDIA H100 80GB HBM3"


def _shape(seqlen: int, batch: int = 2, hq: int = 32, hkv: int = 8, d: int = 128) -> dict:
    return {"batch": batch, "heads_q": hq, "heads_kv": hkv, "seqlen_q": seqlen,
            "seqlen_kv": seqlen, "head_dim": d, "head_dim_v": d}


def _entry(shape: dict, cfg: KernelConfig, latency: float, spec: str = "abc123") -> dict:
    return {"template": "attention_fwd", "spec_hash": spec, "dtype": "bf16", "mode": "fwd",
            "gpu": GPU, "shape": shape, "config": cfg.to_dict(), "latency_ms": latency,
            "tflops": 500.0, "date": "2026-11-22T00:00:00+00:00"}


def _q(path, shape, **kw):
    args = dict(template="attention_fwd", spec_hash="abc123", dtype="bf16", mode="fwd", gpu=GPU)
    args.update(kw)
    return lookup(path, shape=shape, **args)


def _random_cfg(rng: random.Random) -> KernelConfig:
    return KernelConfig(block_M=rng.choice([64, 128]), block_N=rng.choice([32, 64, 128]),
                        num_stages=rng.choice([1, 2, 3]), threads=rng.choice([128, 256]),
                        swizzle_panel=rng.choice([0, 8]))


def test_round_trip_exact(tmp_path):
    rng = random.Random()
    path = tmp_path / "h100" / "attention_fwd.json"
    cfgs = {s: _random_cfg(rng) for s in (2048, 4096, 8192)}
    for s, cfg in cfgs.items():
        store(path, _entry(_shape(s), cfg, rng.uniform(0.5, 5)))
    for s, cfg in cfgs.items():
        got = _q(path, _shape(s))
        assert got is not None
        assert got[0] == cfg
        assert got[1]["exact"] is True
        assert got[1]["tilelang_version"] == tune_file.tilelang_version()
    # Other dtype, mode, spec, gpu or template: no match.
    assert _q(path, _shape(4096), dtype="fp16") is None
    assert _q(path, _shape(4096), mode="bwd") is None
    assert _q(path, _shape(4096), spec_hash="other") is None
    assert _q(path, _shape(4096), gpu="NVIDIA A100") is None
    assert _q(path, _shape(4096), template="attention_bwd") is None
    # The GPU may be given as its name or its slug; dtype as torch-style name.
    assert _q(path, _shape(4096), gpu="nvidia-h100-80gb-hbm3", dtype="bfloat16")[0] == cfgs[4096]


def test_store_replaces_one_entry_keeps_others_and_leaves_no_temp(tmp_path):
    path = tmp_path / "t.json"
    a, b, c = KernelConfig(block_N=64), KernelConfig(num_stages=3), KernelConfig(threads=128)
    store(path, _entry(_shape(2048), a, 1.0))
    store(path, _entry(_shape(4096), b, 2.0))
    store(path, _entry(_shape(2048), c, 0.9))  # same key: replaced
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 2
    assert _q(path, _shape(2048))[0] == c and _q(path, _shape(4096))[0] == b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.json.lock"]


def test_store_failure_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    store(path, _entry(_shape(2048), KernelConfig(block_N=64), 1.0))
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    # The disk fills while the temp file is flushed: the old file stays, the temp file goes.
    import engine.fsutil

    monkeypatch.setattr(engine.fsutil.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        store(path, _entry(_shape(4096), KernelConfig(), 1.0))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_store_rejects_bad_entries(tmp_path):
    e = _entry(_shape(2048), KernelConfig(), 1.0)
    del e["latency_ms"]
    with pytest.raises(ValueError, match="latency_ms"):
        store(tmp_path / "t.json", e)
    e = _entry(_shape(2048), KernelConfig(), 1.0)
    e["config"]["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        store(tmp_path / "t.json", e)


def test_nearest_shape_fallback_logs_both_shapes(tmp_path, caplog):
    path = tmp_path / "t.json"
    small, big = KernelConfig(block_N=64), KernelConfig(num_stages=3)
    store(path, _entry(_shape(2048), small, 1.0))
    store(path, _entry(_shape(16384), big, 9.0))
    with caplog.at_level(logging.INFO, logger="engine.tuning.tune_file"):
        cfg, meta = _q(path, _shape(3072))
    assert cfg == small and meta["exact"] is False
    assert meta["shape"]["seqlen_q"] == 2048 and meta["requested_shape"]["seqlen_q"] == 3072
    assert "sq3072" in caplog.text and "sq2048" in caplog.text
    assert _q(path, _shape(12000))[0] == big
    # Heads and head dims must match: no fallback across them.
    assert _q(path, _shape(4096, hq=16)) is None
    assert _q(path, _shape(4096, d=64)) is None


def test_missing_file_is_silent(tmp_path, recwarn):
    assert _q(tmp_path / "none.json", _shape(2048)) is None
    assert not [w for w in recwarn if issubclass(w.category, TuneFileWarning)]


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"format_version": 1}', "not a tune file"),
        ('[1, 2]', "not a tune file"),
        ('{"format_version": 99, "tilelang_version": "0.1.15", "entries": {}}', "format_version"),
    ],
)
def test_corrupt_or_other_format_warns_and_falls_back(tmp_path, content, match):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.warns(TuneFileWarning, match=match):
        assert _q(path, _shape(2048)) is None


def test_other_tilelang_version_warns_and_store_starts_fresh(tmp_path):
    path = tmp_path / "t.json"
    store(path, _entry(_shape(2048), KernelConfig(block_N=64), 1.0))
    data = json.loads(path.read_text())
    data["tilelang_version"] = "0.0.1"
    path.write_text(json.dumps(data))
    with pytest.warns(TuneFileWarning, match="TileLang '0.0.1'"):
        assert _q(path, _shape(2048)) is None
    with pytest.warns(TuneFileWarning, match="moved to"):
        store(path, _entry(_shape(4096), KernelConfig(), 1.0))
    assert (tmp_path / "t.json.bak").exists()
    assert _q(path, _shape(4096)) is not None
    assert _q(path, _shape(2048))[1]["exact"] is False  # the old entry went with the old file


def test_lookup_never_raises_on_garbage_entries(tmp_path):
    path = tmp_path / "t.json"
    store(path, _entry(_shape(2048), KernelConfig(), 1.0))
    data = json.loads(path.read_text())
    data["entries"]["junk"] = {"template": "attention_fwd", "shape": "oops"}
    data["entries"]["junk2"] = 5
    path.write_text(json.dumps(data))
    assert _q(path, _shape(2048))[0] == KernelConfig()
    key = next(k for k in data["entries"] if k.startswith("attention_fwd|"))
    data["entries"][key]["config"]["block_Q"] = 3
    path.write_text(json.dumps(data))
    with pytest.warns(TuneFileWarning, match="unusable config"):
        assert _q(path, _shape(2048)) is None


def test_bad_query_shape_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="seqlen_kv"):
        _q(tmp_path / "t.json", {k: v for k, v in _shape(2048).items() if k != "seqlen_kv"})


def test_default_path_uses_gpu_slug(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNBENCH_TUNE_DIR", str(tmp_path))
    assert tune_file.default_path(GPU, "attention_fwd") == (
        tmp_path / "nvidia-h100-80gb-hbm3" / "attention_fwd.json"
    )
    store(tune_file.default_path(GPU, "attention_fwd"), _entry(_shape(2048), KernelConfig(), 1.0))
    assert _q(None, _shape(2048))[0] == KernelConfig()
