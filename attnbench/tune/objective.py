"""What a trial evaluates. An objective is a small picklable object with two steps, each run
in a worker process (attnbench/tune/workers.py):

- `compile(cfg)`: CPU work (build the kernel; TileLang caches it on disk, so the benchmark
  worker's own build is a cache hit). Raises TrialFailed when the config does not compile.
- `evaluate(cfg)`: on the worker's GPU, check the output against the reference and time it.
  Returns a Measurement, raises TrialFailed (wrong output, NaN, ...).

`FakeObjective` is a deterministic stand-in (a pure function of the config) used by the CPU
tests and `--objective fake`; it goes through exactly the same workers and study loop.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from attnbench.tune.problem import Problem
from engine.plan.config import KernelConfig


class TrialFailed(Exception):
    """The config cannot be used: the message is the reason kept in the trial's attributes."""


@contextmanager
def compile_failures() -> Iterator[None]:
    """Any error inside but a TrialFailed becomes one naming it: the trial's reason."""
    try:
        yield
    except TrialFailed:
        raise
    except Exception as exc:
        raise TrialFailed(f"compile failed: {type(exc).__name__}: {exc}"[:2000]) from None


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise TrialFailed("no CUDA device visible to the benchmark worker")


class UnpicklableError(RuntimeError):
    """Stands for errors that cannot be sent back from a worker (like tvm_ffi's ffi.Error)."""

    def __reduce__(self):
        raise TypeError(f"Type {type(self).__name__} does not support pickling")


@dataclass(frozen=True)
class Measurement:
    latency_ms: float
    info: dict[str, Any] = field(default_factory=dict)  # kept as trial user attributes


class Objective(Protocol):
    problem: Problem

    def spec_hash(self) -> str: ...
    def traced_spec(self) -> Any: ...  # its TracedSpec (None: unknown); picks the default config
    def gpu_name(self, device: int | None) -> str: ...
    def unmasked_fraction(self) -> float: ...
    def compile(self, cfg: KernelConfig) -> None: ...
    def evaluate(self, cfg: KernelConfig) -> Measurement: ...


@dataclass(frozen=True)
class FakeObjective:
    """Latency from a smooth formula of the config with a unique optimum.

    Optimum: block_M=128, block_N=128, num_stages=2, threads=256, FullRow, swizzle 8 (a decode
    problem's DecodeConfig: block_N=128, num_stages=2, num_splits=16; a linear problem's
    LinearConfig: chunk=64, block_K=block_V=64, num_stages=2, threads=128). Configs
    with block_N=32 and num_stages=3 "fail to compile"; `hang_keys` hang and `crash_keys` kill
    their worker process (SIGKILL-like exit), to exercise timeouts and worker replacement.
    `delay_s` makes each step take that long (tests of resume and sharing); `trace_path`, when
    set, gets one JSON line per step with its start and end time (tests of the pipeline).
    `noise` multiplies each measurement by 1 + noise * u, u uniform in [-1, 1) and reproducible
    (seeded by the config and the count of this process's measurements); `flat` gives every
    config the same latency, so that only the noise tells them apart (tests of confirm.py).
    """

    problem: Problem
    spec: str = "fake-spec"
    gpu: str = "Fake GPU"
    delay_s: float = 0.0
    hang_keys: tuple[str, ...] = ()
    crash_keys: tuple[str, ...] = ()
    wrong_keys: tuple[str, ...] = ()
    trace_path: str = ""
    unpicklable_keys: tuple[str, ...] = ()  # compile raises an UnpicklableError
    noise: float = 0.0
    flat: bool = False

    def spec_hash(self) -> str:
        return self.spec

    def traced_spec(self) -> None:
        return None

    def gpu_name(self, device: int | None) -> str:
        return self.gpu

    def unmasked_fraction(self) -> float:
        return 1.0

    def _trace(self, step: str, cfg: KernelConfig, t0: float) -> None:
        if self.trace_path:
            line = json.dumps({"step": step, "key": cfg.key(), "t0": t0, "t1": time.time()})
            with open(self.trace_path, "a") as fh:  # one short O_APPEND write per line
                fh.write(line + "\n")

    def compile(self, cfg: KernelConfig) -> None:
        t0 = time.time()
        if self.delay_s:
            time.sleep(self.delay_s / 2)
        self._trace("compile", cfg, t0)
        if cfg.key() in self.unpicklable_keys:
            raise UnpicklableError(f"Fatal: No valid warp partition (fake) for {cfg.key()}")
        if getattr(cfg, "block_N", None) == 32 and cfg.num_stages == 3:
            raise TrialFailed(f"compile failed: fake nvcc error for {cfg.key()}")

    def evaluate(self, cfg: KernelConfig) -> Measurement:
        t0 = time.time()
        if self.delay_s:
            time.sleep(self.delay_s / 2)
        self._trace("bench", cfg, t0)
        key = cfg.key()
        if key in self.hang_keys:
            time.sleep(3600)
        if key in self.crash_keys:
            os._exit(139)  # what a segfaulting CUDA process looks like to its parent
        if key in self.wrong_keys:
            raise TrialFailed("output mismatch: rel err 3.1e-01 >= 1e-02 against the reference")
        ms = fake_latency_ms(type(cfg)() if self.flat else cfg, self.problem)
        if self.noise:
            u = random.Random(f"{key}:{next(_MEASUREMENTS)}").uniform(-1.0, 1.0)
            ms *= 1.0 + self.noise * u
        return Measurement(ms, {"rel_err": 1e-3})


_MEASUREMENTS = itertools.count()  # per process: the fake's noise differs between re-timings


def fake_latency_ms(cfg: KernelConfig, problem: Problem) -> float:
    if problem.decode:
        return fake_decode_ms(cfg, problem)
    if problem.linear:
        return fake_linear_ms(cfg, problem)
    work = problem.flops() / 1e12  # TFLOP
    lm = math.log2(cfg.block_M / 128)
    ln = math.log2(cfg.block_N / 128)
    penalty = (
        0.30 * lm * lm
        + 0.25 * ln * ln
        + 0.08 * lm * ln  # mild interaction: the space is not separable
        + 0.12 * (cfg.num_stages - 2) ** 2
        + 0.10 * math.log2(cfg.threads / 256) ** 2
        + (0.0 if cfg.gemm_policy == "FullRow" else 0.07)
        + (0.0 if cfg.swizzle_panel == 8 else 0.02)
        # the engine's default (warp-specialised) is not the fake's optimum
        + (0.0 if getattr(cfg, "schedule", "auto") == "auto" else 0.05)
    )
    return 1000.0 * work / 600.0 * (1.0 + penalty)  # 600 TFLOP/s at the optimum


def fake_decode_ms(cfg, problem: Problem) -> float:
    """The KV cache's bytes at 3 TB/s at the optimum (block_N=128, 2 stages, 16 splits; 0, the
    plan's choice, a little slower), slower away from it."""
    p = problem
    nbytes = p.batch * p.seqlen_kv * p.heads_kv * (p.head_dim + p.head_dim_v) * p.elem_bytes
    ln = math.log2(cfg.block_N / 128)
    ls = math.log2(cfg.num_splits / 16) if cfg.num_splits else 0.5
    penalty = 0.25 * ln * ln + 0.12 * (cfg.num_stages - 2) ** 2 + 0.05 * ls * ls
    return 1000.0 * nbytes / 3e12 * (1.0 + penalty)


def fake_linear_ms(cfg, problem: Problem) -> float:
    """The chunked algorithm's FLOPs at 300 TFLOP/s at the optimum (chunk 64, 64 x 64 state
    tiles, 2 stages, 128 threads), slower away from it."""
    lc = math.log2(cfg.chunk / 64)
    lk, lv = math.log2(cfg.block_K / 64), math.log2(cfg.block_V / 64)
    penalty = (0.2 * lc * lc + 0.15 * lk * lk + 0.15 * lv * lv
               + 0.1 * (cfg.num_stages - 2) ** 2 + 0.1 * math.log2(cfg.threads / 128) ** 2)
    return 1000.0 * problem.flops() / 1e12 / 300.0 * (1.0 + penalty)
