"""Timing of one call: warm-up, then `repeats` timed repetitions; median and interquartile
range (the spread) in milliseconds.

CUDA: one pair of CUDA events per repetition around the call only. When the working set fits
in L2, L2 is flushed before every repetition by overwriting a buffer twice its size (the flush
is enqueued before the start event, so it is not timed); a repeated call would otherwise read
its inputs from L2 and look faster than in a model. CPU: `time.perf_counter` around each call
(CPU torch ops are synchronous). Cost of one measurement ~ (warmup + repeats) x call time, so
suites keep calls in the milliseconds (e.g. a fixed token count) to finish in minutes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread_ms: float  # interquartile range
    repeats: int
    samples_ms: tuple[float, ...]


def summarize(samples_ms: list[float]) -> Timing:
    if not samples_ms:
        raise ValueError("samples_ms must not be empty")
    med = statistics.median(samples_ms)
    if len(samples_ms) >= 2:
        q = statistics.quantiles(samples_ms, n=4, method="inclusive")
        spread = q[2] - q[0]
    else:
        spread = 0.0
    return Timing(med, spread, len(samples_ms), tuple(samples_ms))


class L2Flusher:
    """Overwrites a buffer of twice the device's L2 size to evict everything from L2."""

    def __init__(self, device: torch.device) -> None:
        props = torch.cuda.get_device_properties(device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        self._buf = torch.empty(2 * self.l2_bytes, dtype=torch.int8, device=device)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.l2_bytes

    def __call__(self) -> None:
        self._buf.zero_()


def measure(fn: Callable[[], object], *, device: str, repeats: int = 30, warmup: int = 3,
            flush: Callable[[], None] | None = None) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed ones (flushing before each
    when `flush` is given, CUDA only)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    if device == "cuda":
        return _measure_cuda(fn, repeats, flush)
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def _measure_cuda(fn, repeats, flush) -> Timing:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    torch.cuda.synchronize()
    for i in range(repeats):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])
