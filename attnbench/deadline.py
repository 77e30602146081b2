"""A wall-clock deadline for a block of GPU work (the probing scripts, `attnbench run`): a kernel
that never ends (a deadlock) blocks the synchronisation after it for ever, and a script waiting
on it returns nothing before the device call's own limit cuts everything (results/NOTES.md
202)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_STATUS = 124  # as coreutils `timeout` reports a command it stopped


def _expire(what: str, seconds: float, on_expire: Callable[[str], None] | None) -> None:
    message = f"{what}: not finished after {seconds:.0f} s (a kernel that never ends?)"
    if on_expire is not None:
        try:
            on_expire(message)
        except Exception as exc:  # noqa: BLE001 - exiting regardless: say why it wrote nothing
            print(f"deadline: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    print(f"{message}; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)  # the main thread is stuck in CUDA: no exception would reach it


@contextlib.contextmanager
def deadline(seconds: float | None, what: str,
             on_expire: Callable[[str], None] | None = None) -> Iterator[None]:
    """End the process with EXIT_STATUS and a message naming `what` if the block runs past
    `seconds` (None: no limit), after `on_expire(message)`, run in the timer's thread, has
    written what the block leaves unwritten."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _expire, (what, seconds, on_expire))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
