"""Worker processes: a shared compile pool (CPU) and one benchmark worker per GPU.

Built on pebble's ProcessPool, which gives each task a timeout and replaces a worker that
hangs (killed at the timeout) or dies (illegal address, segfault): only that task fails.
Workers are spawned (never forked: CUDA does not survive a fork) and die with their parent, so
a SIGKILLed tuner leaves no orphan holding a GPU.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import pebble

from attnbench.tune.objective import Measurement, Objective, TrialFailed
from engine.plan.config import KernelConfig

_PARENT_POLL_S = 0.25


def _die_with_parent() -> None:
    # A watch thread, not PR_SET_PDEATHSIG: that signal fires when the *thread* that spawned
    # the worker exits, and pebble spawns workers from whichever thread first schedules (a GPU
    # worker thread that may finish before the others still using the pool).
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _init_compile_worker() -> None:
    _die_with_parent()
    # A parallel compile must not grab the GPU: compiling is host work.
    os.environ.setdefault("ATTNBENCH_TUNE_ROLE", "compile")


def _init_bench_worker(device: int | None) -> None:
    _die_with_parent()
    os.environ["ATTNBENCH_TUNE_ROLE"] = "bench"
    if device is not None:
        # Before CUDA initialises in this process: the worker sees its GPU as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(
            device, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_device(index: int, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the parent's GPU `index` (what `--gpus` and torch in
    the parent count): with CUDA_VISIBLE_DEVICES=2,3, index 0 is GPU 2, not GPU 0."""
    ids = [x.strip() for x in (visible or "").split(",") if x.strip()]
    return ids[index] if index < len(ids) else str(index)


MAX_REASON_CHARS = 4000


def _plain_error(exc: BaseException) -> Exception:
    """A picklable stand-in for `exc`. The parent receives a task's exception by pickling, and
    some cannot be pickled (tvm_ffi's ffi.Error): pebble's worker then dies, which costs a new
    process (torch and TileLang imported again) and loses the reason."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the failure
        text = repr(type(exc))
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS // 2] + "\n[...]\n" + text[-MAX_REASON_CHARS // 2 :]
    if isinstance(exc, TrialFailed):
        return TrialFailed(text)
    tb = "".join(traceback.format_exception(exc))[-MAX_REASON_CHARS:]
    return TrialFailed(f"{type(exc).__name__}: {text}\n{tb}"[: 2 * MAX_REASON_CHARS])


# A config travels to a worker as itself (a frozen dataclass of its kind: KernelConfig,
# DecodeConfig, ...), pickled like the objective.
def _compile_task(objective: Objective, cfg) -> None:
    try:
        objective.compile(cfg)
    except Exception as exc:
        raise _plain_error(exc) from None


def _bench_task(objective: Objective, cfg) -> Measurement:
    try:
        return objective.evaluate(cfg)
    except Exception as exc:
        raise _plain_error(exc) from None


@dataclass(frozen=True)
class Outcome:
    ok: bool
    measurement: Measurement | None = None
    reason: str = ""


def _outcome(future: concurrent.futures.Future, step: str, timeout: float) -> Outcome:
    try:
        result = future.result()
    except TrialFailed as exc:
        return Outcome(False, reason=str(exc))
    except concurrent.futures.TimeoutError:
        return Outcome(False, reason=f"{step} timed out after {timeout:g} s (worker replaced)")
    except pebble.ProcessExpired as exc:
        code = exc.exitcode
        what = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return Outcome(False, reason=f"{step} worker died ({what}; worker replaced)")
    except Exception as exc:  # an unexpected error in user/engine code fails only this trial
        tb = getattr(exc, "traceback", "") or traceback.format_exc()
        return Outcome(False, reason=f"{step} raised {type(exc).__name__}: {exc}\n{tb}"[-2000:])
    return Outcome(True, measurement=result)


class CompilePool:
    """Compiles candidate configs in parallel on the CPU cores."""

    def __init__(self, jobs: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pool = pebble.ProcessPool(
            max_workers=max(1, jobs),
            initializer=_init_compile_worker,
            context=multiprocessing.get_context("spawn"),
        )

    def submit(self, objective: Objective, cfg: KernelConfig) -> concurrent.futures.Future:
        # One GPU worker thread per device submits here; pebble starts its pool on the first
        # schedule, and two threads doing that at once leave it in its error state.
        with self._lock:
            return self._pool.schedule(
                _compile_task, args=(objective, cfg), timeout=self.timeout_s
            )

    def result(self, future: concurrent.futures.Future) -> Outcome:
        return _outcome(future, "compile", self.timeout_s)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()


class BenchWorker:
    """Benchmarks one config at a time on one GPU, in a replaceable process."""

    def __init__(self, device: int | None, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._pool = pebble.ProcessPool(
            max_workers=1,
            initializer=_init_bench_worker,
            initargs=(device,),
            context=multiprocessing.get_context("spawn"),
        )

    def run(self, objective: Objective, cfg: KernelConfig) -> Outcome:
        fut = self._pool.schedule(
            _bench_task, args=(objective, cfg), timeout=self.timeout_s
        )
        return _outcome(fut, "benchmark", self.timeout_s)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()
