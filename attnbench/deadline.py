"""A wall-clock deadline for a block of GPU work in the probing scripts: a kernel that never
ends (a deadlock) blocks the synchronisation after it for ever, and a script waiting on it
returns nothing before the device call's own limit cuts everything (results/NOTES.md 202)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

EXIT_STATUS = 124  # as coreutils `timeout` reports a command it stopped


def _expire(what: str, seconds: float) -> None:
    print(f"{what}: not finished after {seconds:.0f} s (a kernel that never ends?); exiting",
          file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)  # the main thread is stuck in CUDA: no exception would reach it


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """End the process with EXIT_STATUS and a message naming `what` if the block runs past
    `seconds` (what the script wrote before stays: its records are written as it goes)."""
    timer = threading.Timer(seconds, _expire, (what, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
