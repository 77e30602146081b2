"""Device tensors a module keeps across calls (block tables, chunk tables, workspaces), built
where no CUDA-graph pool takes them.

torch.compile(mode="reduce-overhead") runs its warm-up with the calling thread's CUDA
allocations routed into its graph pool, and then refuses a pool tensor that is not one of the
graph's outputs ("tensor(s) in the cudagraph pool not tracked as outputs"). A tensor the module
keeps is built on a thread of its own instead, from the ordinary allocator, on the caller's
stream (so ordered after the caller's work, as if built inline)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-persistent")


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kept(build: Callable[[], T], device: torch.device | str) -> T:
    """build() for state the module keeps on `device`: off the calling thread on a CUDA device
    (inline elsewhere, and inside a stream capture, whose own allocations belong to its
    graph)."""
    device = torch.device(device)
    if device.type != "cuda" or capturing(device):
        return build()
    stream = torch.cuda.current_stream(device)

    def on_stream() -> T:
        with torch.cuda.stream(stream):
            return build()

    return _BUILDER.submit(on_stream).result()
