"""The tuner times trials with the suite runner's timer and L2 policy (attnbench.timing), not a
copy of its own: checked on the CPU through the functions the objectives call; and the GPU its
benchmark worker times on."""

from __future__ import annotations

import pytest
import torch

import attnbench.timing as runner_timing
from attnbench.tune import engine_objective
from attnbench.tune import timing as tune_timing
from attnbench.tune.problem import Problem


def test_the_tuner_uses_the_runners_timer_and_flusher():
    assert tune_timing.measure is runner_timing.measure
    assert tune_timing.L2Flusher is runner_timing.L2Flusher
    assert not hasattr(tune_timing, "time_cuda")  # the tuner's own timer is gone


def test_an_objectives_timing_goes_through_measure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls: list[dict] = []

    def spy(fn, **kw):
        calls.append(kw)
        return runner_timing.measure(fn, **kw)

    monkeypatch.setattr(tune_timing, "measure", spy)
    ran = []
    med, reps = engine_objective.median_ms(lambda: ran.append(sum(range(2000))), 7, 2, 1024)
    assert calls == [{"device": "cpu", "repeats": 7, "warmup": 2, "flush": None}]
    assert reps == 7 and len(ran) == 9 and med > 0


@pytest.mark.parametrize("mib, flushed", [(10, True), (50, True), (51, False)])
def test_l2_is_flushed_only_when_the_working_set_fits(monkeypatch, mib, flushed):
    flusher = object.__new__(runner_timing.L2Flusher)  # no CUDA buffer: only its policy
    flusher.l2_bytes = 50 * 2**20
    calls: list[dict] = []
    monkeypatch.setattr(tune_timing, "_flusher", lambda: flusher)
    monkeypatch.setattr(tune_timing, "measure",
                        lambda fn, **kw: calls.append(kw) or runner_timing.summarize([1.0]))
    tune_timing.time_step(lambda: None, reps=3, warmup=1, working_set_bytes=mib * 2**20,
                          device="cuda")
    assert calls[0]["device"] == "cuda" and (calls[0]["flush"] is flusher) == flushed


def test_working_set_counts_inputs_output_and_its_gradient():
    p = Problem("softmax", batch=2, heads_q=8, heads_kv=2, seqlen_q=256, seqlen_kv=512,
                head_dim=64, head_dim_v=32, dtype="fp16")
    q = torch.ones(2, 256, 8, 64, dtype=torch.float16)
    k = torch.ones(2, 512, 2, 64, dtype=torch.float16)
    v = torch.ones(2, 512, 2, 32, dtype=torch.float16)
    out = 2 * 256 * 8 * 32 * 2
    want = q.nbytes + k.nbytes + v.nbytes + 2 * out
    assert tune_timing.working_set_bytes(p, [q, k, v, "not a tensor"]) == want


@pytest.mark.parametrize("index, visible, expected", [
    (0, None, "0"), (1, "", "1"), (0, "2,3", "2"), (1, "2, 3", "3"), (0, "GPU-abc", "GPU-abc"),
])
def test_benchmark_worker_gets_the_gpu_the_parent_counts(index, visible, expected):
    from attnbench.tune.workers import visible_device

    assert visible_device(index, visible) == expected
