"""Live progress of a study: trials done, best so far, elapsed and remaining (rich)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class Snapshot:
    done: int
    target: int
    failed: int
    best_ms: float | None
    best_tflops: float | None
    best_key: str | None


def _best_text(s: Snapshot) -> str:
    if s.best_ms is None:
        return "best: -"
    tf = f", {s.best_tflops:.0f} TFLOP/s" if s.best_tflops is not None else ""
    return f"best: {s.best_ms:.4g} ms{tf} [{s.best_key}]"


class ProgressDisplay:
    """A rich progress bar when `enabled` and stderr is a terminal; otherwise a line per change."""

    def __init__(self, title: str, target: int, deadline_s: float | None, enabled: bool) -> None:
        self.title = title
        self.target = target
        self.deadline_s = deadline_s
        self.start = time.monotonic()
        self._last_line = ""
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[best]}"),
                console=Console(stderr=True),
            )
            self._task = self._progress.add_task(title, total=target, failed=0, best="best: -")
        self.enabled = enabled

    def __enter__(self) -> ProgressDisplay:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, s: Snapshot) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task, completed=s.done, total=s.target, failed=s.failed, best=_best_text(s)
            )
            return
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        left = "?"
        if s.done:
            left_s = elapsed / s.done * max(0, s.target - s.done)
            if self.deadline_s is not None:
                left_s = min(left_s, max(0.0, self.deadline_s - elapsed))
            left = f"{left_s:.0f}s"
        line = f"{self.title}: {s.done}/{s.target} trials, failed {s.failed}, {_best_text(s)}"
        if line != self._last_line:
            self._last_line = line
            print(f"{line}, elapsed {elapsed:.0f}s, left {left}", file=sys.stderr, flush=True)
