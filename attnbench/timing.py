"""Timing of one call: warm-up, then `repeats` timed repetitions; median and interquartile
range (the spread) in milliseconds.

CUDA: one pair of CUDA events per repetition around the call only. When the working set fits
in L2, L2 is flushed before every repetition by overwriting a buffer twice its size (the flush
is enqueued before the start event, so it is not timed); a repeated call would otherwise read
its inputs from L2 and look faster than in a model. CPU: `time.perf_counter` around each call
(CPU torch ops are synchronous). Cost of one measurement ~ (warmup + repeats) x call time, so
suites keep calls in the milliseconds (e.g. a fixed token count) to finish in minutes.

Warm-up: `warmup` calls, then on CUDA more back-to-back calls until at least `WARMUP_MS` of
device time has passed. A count alone is a few milliseconds for a long kernel, too short for the
GPU's power management to settle: its SM clock then drops part-way through the timed repetitions
and the samples split in two (H100, 2026-11-24: 1.5-3.6 ms rows at 1680-1740 MHz had a spread of
5-12%, rows at 1980 MHz under 1%).

Launch gaps: a repetition that starts on an idle GPU (after the sync, a flush, or a call
shorter than its own launch) would fire its start event while the host is still inside the
call's Python, and the launch overhead would be timed as GPU time. So the GPU first spins (a
one-thread sleep kernel, NVBench's "blocking kernel") for twice the host time of issuing every
repetition, and the repetitions are queued behind it: the GPU then runs them back to back as in
a model (H100, 2026-11-24: FA3 causal S 1k, a 0.16 ms kernel, measured 0.25-0.31 ms with a
10-12% spread without it). One spin up front, not one per repetition: idle gaps between
repetitions let the clock swing (H100: 8 rows of 0.4-1.8 ms noisy with a spin before each).

Noise: `measure_steady` re-takes a measurement whose interquartile spread exceeds a fraction of
its median (a clock drop, another process on the GPU), after a pause, up to a few attempts, and
keeps the tightest attempt; the caller marks a measurement still noisy after every attempt.
What stays noisy is a kernel that holds the GPU at its power limit: its SM clock swings for
hundreds of milliseconds (H100, 2026-11-25, scripts/clock_trace.py: FA2 at S 16k at 703 W of
700, clock 1545-1860 MHz, repetitions 8.65 ms down to a flat 7.02 ms and up to 7.39 again), and
neither re-measures nor a warm-up three times longer per re-measure tightened those rows.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread_ms: float  # interquartile range
    repeats: int
    samples_ms: tuple[float, ...]


    @property
    def relative_spread(self) -> float:
        """Interquartile range / median (inf for a zero or NaN median)."""
        if not self.median_ms > 0:
            return math.inf
        return self.spread_ms / self.median_ms


@dataclass(frozen=True)
class NoisePolicy:
    """When a measurement is re-taken: spread above `threshold` x median; at most `attempts`
    attempts in all, `pause_s` apart (time for clocks and other processes to settle)."""

    threshold: float = 0.05
    attempts: int = 3
    pause_s: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"noise threshold must be a number > 0, got {self.threshold!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) \
                or self.attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {self.attempts!r}")
        if not (math.isfinite(self.pause_s) and self.pause_s >= 0):
            raise ValueError(f"pause must be a number of seconds >= 0, got {self.pause_s!r}")


@dataclass(frozen=True)
class Steady:
    """The tightest of `attempts` timings; `noisy` when even that one is above the threshold."""

    timing: Timing
    attempts: int
    noisy: bool


def measure_steady(measure_once: Callable[[], Timing], policy: NoisePolicy = NoisePolicy(), *,
                   sleep: Callable[[float], None] = time.sleep) -> Steady:
    """Call `measure_once` until its spread is within `policy.threshold` of the median, at most
    `policy.attempts` times with `policy.pause_s` between calls; keep the tightest timing."""
    best: Timing | None = None
    for attempt in range(1, policy.attempts + 1):
        if attempt > 1 and policy.pause_s:
            sleep(policy.pause_s)
        timing = measure_once()
        if best is None or timing.relative_spread < best.relative_spread:
            best = timing
        if timing.relative_spread <= policy.threshold:
            return Steady(best, attempt, noisy=False)
    assert best is not None
    return Steady(best, policy.attempts, noisy=True)


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


WARMUP_MS = 200.0  # least device time of warm-up calls on CUDA (see the module docstring)
_MAX_WARMUP_CALLS = 10_000


def call_ms(fn: Callable[[], object], sync: Callable[[], None],
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Wall time of one call of `fn` in milliseconds, from a `sync` before it to one after."""
    sync()
    t0 = clock()
    fn()
    sync()
    return (clock() - t0) * 1e3


def warm_up(fn: Callable[[], object], *, calls: int, min_ms: float,
            sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> int:
    """`calls` calls of `fn`, then more until `min_ms` milliseconds have passed (by `clock`,
    after `sync`), issued back to back in one batch sized from a timed call. Returns the
    number of calls made."""
    for _ in range(calls):
        fn()
    done = calls
    if min_ms <= 0:
        return done
    one_ms = call_ms(fn, sync, clock)
    done += 1
    left = min_ms - one_ms
    if left > 0:
        n = min(_MAX_WARMUP_CALLS, math.ceil(left / max(one_ms, 1e-3)))
        for _ in range(n):
            fn()
        sync()
        done += n
    return done


def measure(fn: Callable[[], object], *, device: str, repeats: int = 30, warmup: int = 3,
            flush: Callable[[], None] | None = None, warmup_ms: float = WARMUP_MS,
            stream: Stream | None = None) -> Timing:
    """Time `fn()`: `warmup` untimed calls (on CUDA, then more up to `warmup_ms` of device
    time), then `repeats` timed ones (flushing before each when `flush` is given, CUDA only).
    `stream` replaces the CUDA primitives (tests)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not (math.isfinite(warmup_ms) and warmup_ms >= 0):
        raise ValueError(f"warmup_ms must be a number >= 0, got {warmup_ms!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        stream = stream or cuda_stream()
        warm_up(fn, calls=warmup, min_ms=warmup_ms, sync=stream.sync, clock=stream.host_clock)
        return _measure_queued(fn, repeats, flush, stream)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


class Event(Protocol):
    def record(self) -> None: ...
    def elapsed_time(self, end: Event) -> float: ...


@dataclass(frozen=True)
class Stream:
    """The device primitives a timed loop uses: timing events, a GPU spin of some milliseconds,
    a host-device sync and the host clock (seconds)."""

    event: Callable[[], Event]
    spin: Callable[[float], None]
    sync: Callable[[], None]
    host_clock: Callable[[], float] = time.perf_counter


_HOLD_MAX_MS = 200.0  # a call that syncs inside is not helped by a longer hold


def hold_ms(launch_ms: float, repeats: int) -> float:
    """GPU spin before the timed repetitions: twice the host time to issue all of them (the
    clock may change between calibration and use, a launch may be slower now and then) plus
    0.1 ms for the flushes and events, capped."""
    return min(2.0 * launch_ms * repeats + 0.1, _HOLD_MAX_MS)


def launch_ms(fn: Callable[[], object], stream: Stream, calls: int = 3) -> float:
    """Host time to issue one call (the longest of `calls`); calls return once their kernels
    are queued, so this is the host's share alone unless the call syncs inside."""
    stream.sync()
    longest = 0.0
    for _ in range(calls):
        t0 = stream.host_clock()
        fn()
        longest = max(longest, (stream.host_clock() - t0) * 1e3)
    stream.sync()
    return longest


def _measure_queued(fn, repeats, flush, stream: Stream) -> Timing:
    hold = hold_ms(launch_ms(fn, stream), repeats)
    starts = [stream.event() for _ in range(repeats)]
    ends = [stream.event() for _ in range(repeats)]
    stream.spin(hold)
    for i in range(repeats):
        if flush is not None:
            flush()
        starts[i].record()
        fn()
        ends[i].record()
    stream.sync()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


_cycles_per_ms: dict[int, float] = {}


def _cuda_spin(ms: float) -> None:
    dev = torch.cuda.current_device()
    if dev not in _cycles_per_ms:
        _cycles_per_ms[dev] = _calibrate_sleep()
    torch.cuda._sleep(max(1, int(ms * _cycles_per_ms[dev])))


def _calibrate_sleep(cycles: int = 1_000_000) -> float:
    """SM cycles per millisecond of `torch.cuda._sleep` (the clock it counts in varies)."""
    torch.cuda._sleep(cycles)  # first launch loads the kernel
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def cuda_stream() -> Stream:
    return Stream(event=lambda: torch.cuda.Event(enable_timing=True), spin=_cuda_spin,
                  sync=torch.cuda.synchronize)
