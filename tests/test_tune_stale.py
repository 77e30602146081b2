"""Stale tune entries: an entry records the engine's default when it was tuned, and once the
engine's default at that shape is another config the entry gives way to it (with one warning),
as the 2026-11-22 entries should have when the warp-specialised forward became the default
(results/NOTES.md 117). Entries without that record are used as before."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.kernels.attention_bwd.plan import default_backward_config
from engine.kernels.attention_fwd.plan import default_forward_config
from engine.plan.config import KernelConfig
from engine.runtime.kernel_cache import backward_config
from engine.tuning import select, tune_file
from engine.tuning.autotune import has_exact_entry
from engine.variants import VARIANTS

SIZES = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=2048, seqlen_kv=2048, head_dim=128,
             head_dim_v=128)
TUNED = KernelConfig(128, 64, 2, 256, "FullRow", 8)
OLD_DEFAULT = KernelConfig(192, 128, 2, 384)


def _module(path, name: str = "softmax"):
    return VARIANTS[name].build(**SIZES, dtype=torch.bfloat16, backend="tilelang",
                                tune_file=str(path))


def _store(path, mod, template: str, record: dict, config: KernelConfig = TUNED) -> None:
    tune_file.store(str(path), {
        "template": template, "spec_hash": mod.spec_hash, "dtype": "bf16",
        "mode": "fwd" if template == "attention_fwd" else "bwd", "gpu": "none",
        "shape": dict(SIZES), "config": config.to_dict(), "latency_ms": 1.0, "tflops": 1.0,
        "date": "2026-11-27T00:00:00+00:00", "study": f"{template}:test", **record})


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch):
    monkeypatch.setattr(select, "_told", set())


def _default(name: str = "softmax") -> KernelConfig:
    spec = VARIANTS[name].build(**SIZES, dtype=torch.bfloat16, backend="reference").spec
    return default_forward_config(128, 128, spec=spec, seqlen_q=SIZES["seqlen_q"])


@pytest.mark.parametrize("record", [
    "engine_default",  # what the tuner records now
    "default_config",  # older entries: the baseline they were confirmed against
    None,  # no record: nothing to judge it by
])
def test_current_entry_is_used(tmp_path, record):
    mod = _module(tmp_path / "fwd.json")
    _store(tmp_path / "fwd.json", mod, "attention_fwd",
           {record: _default().to_dict()} if record else {})
    assert mod.forward_kernel().config == TUNED
    assert has_exact_entry(mod.kernel_request(), "none")


def test_stale_entry_gives_way_to_the_default_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "fwd.json"
    _store(path, _module(path), "attention_fwd", {"engine_default": OLD_DEFAULT.to_dict()})
    with caplog.at_level(logging.WARNING, logger="engine"):
        for _ in range(2):
            mod = _module(path)
            assert mod.forward_kernel().config == _default() != TUNED
        assert not has_exact_entry(mod.kernel_request(), "none")  # tune=True tunes it again
    said = [r.getMessage() for r in caplog.records if "confirmed against" in r.getMessage()]
    assert len(said) == 1 and OLD_DEFAULT.key() not in said[0] and "attnbench tune" in said[0]
    assert _default().key() in said[0]


def test_engine_default_wins_over_the_older_record(tmp_path):
    """An entry's baseline can be another entry (the nearest tuned shape the engine ran);
    `engine_default` is what decides."""
    path = tmp_path / "fwd.json"
    _store(path, _module(path), "attention_fwd", {"engine_default": _default().to_dict(),
                                                  "default_config": OLD_DEFAULT.to_dict()})
    assert _module(path).forward_kernel().config == TUNED


def test_backward_entries_are_judged_the_same_way(tmp_path):
    path = tmp_path / "bwd.json"
    mod = _module(path, "softmax_causal")
    spec = mod.spec
    tuned = KernelConfig(64, 128, 2, 256, "FullRow", 8)
    current = default_backward_config(128, 128, spec=spec)
    _store(path, mod, "attention_bwd", {"engine_default": current.to_dict()}, tuned)
    assert backward_config(mod.kernel_request()) == tuned
    _store(path, mod, "attention_bwd", {"engine_default": OLD_DEFAULT.to_dict()}, tuned)
    fresh = _module(path, "softmax_causal")
    assert backward_config(fresh.kernel_request()) == current
