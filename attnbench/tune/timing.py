"""CUDA-event timing for tuning trials (GPU only; torch is imported by the caller's process).

Used only until attnbench/timing.py (the suite runner's timer) exists; EngineObjective prefers
that one when it can be imported.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > H100's 50 MB L2, so every rep starts cold


def time_cuda(fn: Callable[[], object], *, reps: int = 30, warmup: int = 5,
              flush_l2: bool = True) -> list[float]:
    """Per-repetition times of `fn()` in milliseconds (CUDA events, L2 flushed before each)."""
    import torch

    if reps < 1:
        raise ValueError(f"reps={reps}: expected >= 1")
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def median_ms(times: list[float]) -> float:
    return statistics.median(times)
