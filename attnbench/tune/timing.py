"""How the tuner times a trial: the suite runner's timer and L2 policy (attnbench.timing), so a
tuned config's latency and a suite row's are measured the same way.

`measure` with CUDA events, and `L2Flusher` (a buffer twice the device's L2) before each
repetition when the working set fits in L2, as attnbench.runner does: a repeated call would
otherwise find its inputs in L2 and look faster than in a model. Runs in the benchmark worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from attnbench.timing import L2Flusher, Timing, measure

_FLUSHERS: dict[int, L2Flusher] = {}  # per worker process, one per device


def _flusher() -> L2Flusher:
    index = torch.cuda.current_device()
    if index not in _FLUSHERS:
        _FLUSHERS[index] = L2Flusher(torch.device("cuda", index))
    return _FLUSHERS[index]


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the tensors among `tensors` (other values are ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def working_set_bytes(problem, tensors: Iterable[object]) -> int:
    """A call's working set as the runner counts it: its inputs, and an output and its gradient
    of `problem`'s output shape."""
    p = problem
    return tensor_bytes(tensors) + 2 * p.batch * p.seqlen_q * p.heads_q * p.head_dim_v * p.elem_bytes


def time_step(step: Callable[[], object], *, reps: int, warmup: int, working_set_bytes: int,
              device: str | None = None) -> Timing:
    """Time `step()` on `device` (default: CUDA when there is one, else the CPU timer), flushing
    L2 before each repetition when `working_set_bytes` fit in it (the runner's policy)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    flush = None
    if device == "cuda":
        flusher = _flusher()
        flush = flusher if flusher.fits(working_set_bytes) else None
    return measure(step, device=device, repeats=reps, warmup=warmup, flush=flush)
