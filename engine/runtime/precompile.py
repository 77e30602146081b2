"""Compile many generated kernels in parallel worker processes (nvcc is CPU-bound), filling
TileLang's disk cache so that the process that runs them only loads them."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed


def _compile_one(source: str) -> str | None:
    try:
        from engine.runtime.compile import compile_source

        compile_source(source)
        return None
    except Exception as exc:  # reported to the caller, never raised across processes
        return f"{type(exc).__name__}: {exc}"


def precompile(sources: Iterable[str], workers: int | None = None) -> dict[str, str]:
    """Compile each distinct source; returns {source: error} for the ones that failed."""
    todo = list(dict.fromkeys(sources))
    if not todo:
        return {}
    workers = workers or max(1, min(len(todo), (os.cpu_count() or 2) - 1))
    errors: dict[str, str] = {}
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(_compile_one, s): s for s in todo}
        for f in as_completed(futs):
            err = f.result()
            if err:
                errors[futs[f]] = err
    return errors
