"""Kernel-by-kernel GPU time of a call (torch.profiler's CUDA events): what bounds a row, where
`attnbench.timing` gives the call's time."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

Event = tuple[str, float, float]  # kernel name, start, GPU duration (us)


def kernel_events(fn: Callable[[], object], calls: int, warmup: int) -> list[Event]:
    """The CUDA events of `calls` back-to-back calls of `fn`, after `warmup` untraced ones."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.device_time_total)
            for e in prof.events() if e.device_type == cuda]


def aggregate(events: Iterable[Event], calls: int) -> dict:
    """(name, start, duration us) of `calls` identical calls' kernels -> each kernel's mean
    time, keyed by its place in a call's launch order and its name."""
    ordered = sorted(events, key=lambda e: e[1])
    if calls < 1 or len(ordered) % calls:
        raise ValueError(f"{len(ordered)} kernels do not split into {calls} equal calls")
    per = len(ordered) // calls
    times: dict[str, float] = collections.defaultdict(float)
    for i, (name, _, dur) in enumerate(ordered):
        times[f"{i % per}:{name[:60]}"] += dur / calls
    return {"kernels_us": round(sum(times.values()), 1),
            "kernels": {k: round(v, 1) for k, v in times.items()}}


def kernel_times(fn: Callable[[], object], calls: int = 10, warmup: int = 3) -> dict:
    """`fn`'s kernels' GPU time per call, each by its place in the launch order (aggregate)."""
    return aggregate(kernel_events(fn, calls, warmup), calls)
