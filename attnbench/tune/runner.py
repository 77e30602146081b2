"""Run one study end to end: create or resume it, seed it, start one worker per GPU, show
progress, then apply the tune-file rule (publish.py), with the benchmark worker as the timer
of its A/B confirmation.

Every run first measures the baseline, the config the engine would run for the problem now
(its tune-file entry for this or the nearest tuned shape, else its default). Ctrl-C: the first
stops the search after the trials in flight, applies the tune-file rule to the best so far and
raises StudyInterrupted; a second aborts at once, writing nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import optuna
from optuna.trial import TrialState

from attnbench.tune.confirm import MARGIN, ROUNDS
from attnbench.tune.loop import (
    LoopSettings,
    StudyWorker,
    make_sampler,
    space_distributions,
    study_state,
)
from attnbench.tune.objective import Objective, TrialFailed
from attnbench.tune.problem import Problem, study_name
from attnbench.tune.progress import ProgressDisplay, Snapshot
from attnbench.tune.publish import write_best
from attnbench.tune.result import TuneResult
from attnbench.tune.space import SearchSpace
from attnbench.tune.storage import default_storage_url, make_storage, reap_dead_trials
from attnbench.tune.workers import BenchWorker, CompilePool
from engine.plan.config import KernelConfig
from engine.tuning import tune_file
from engine.tuning.select import for_shape

log = logging.getLogger(__name__)

Search = Literal["auto", "tpe", "grid"]


@dataclass(frozen=True)
class TuneOptions:
    trials: int = 64  # evaluated trials the study should reach (TPE); grid: all valid configs
    timeout_s: float | None = None  # wall-clock limit of this run
    storage: str | None = None  # SQLAlchemy URL; None: sqlite:///results/tune/studies.db
    devices: tuple[int | None, ...] = (None,)  # one worker per GPU index (None: default GPU)
    compile_jobs: int = 0  # 0: all CPU cores
    compile_timeout_s: float = 900.0
    bench_timeout_s: float = 180.0
    seed: int = 0
    search: Search = "auto"
    kind: str | None = None  # study name suffix; default "tpe" or "grid"
    tune_file: Path | None = None  # None: results/tune/<gpu>/<template>.json
    write_tune_file: bool = True
    progress: bool = True
    heartbeat_s: int = 30
    confirm_rounds: int = ROUNDS  # A/B rounds of the winner against the baseline
    confirm_margin: float = MARGIN  # least relative gain a written winner must show

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials={self.trials}: expected >= 1")
        if self.confirm_rounds < 1:
            raise ValueError(f"confirm_rounds={self.confirm_rounds}: expected >= 1")
        if not 0 <= self.confirm_margin < 1:
            raise ValueError(f"confirm_margin={self.confirm_margin}: expected a fraction in [0, 1)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout={self.timeout_s}: expected > 0 seconds")
        if not self.devices:
            raise ValueError("gpus: expected at least one GPU index")
        if self.search not in ("auto", "tpe", "grid"):
            raise ValueError(f"search={self.search!r}: expected auto, tpe or grid")


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a study; `result` holds what it measured and what the tune file got."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__("interrupted")
        self.result = result


def space_digest(space: SearchSpace) -> str:
    """A short digest of a search space's parameters and their choices."""
    return hashlib.sha256(repr(tuple(space.params)).encode()).hexdigest()[:8]


def _same_space(study: optuna.Study, space: SearchSpace) -> bool:
    """Whether every trial of `study` was drawn from `space`'s parameters and choices. A trial
    that did not complete may hold only the parameters drawn before its tuner died (SIGKILL
    mid-sampling): it matches where those agree (before, it forked a resumed study)."""
    want = space_distributions(space)

    def drawn_from(t: optuna.trial.FrozenTrial) -> bool:
        if t.state == TrialState.COMPLETE:
            return t.distributions == want
        return all(want.get(n) == d for n, d in t.distributions.items())

    return all(drawn_from(t) for t in study.get_trials(deepcopy=False) if t.distributions)


def _n_jobs(requested: int) -> int:
    if requested > 0:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _enqueue(study: optuna.Study, configs, space: SearchSpace) -> int:
    have = {
        tuple(sorted(t.params.items()))
        for t in study.get_trials(deepcopy=False)
        if t.state != TrialState.PRUNED and t.params
    }
    have |= {  # waiting trials have no params yet, only fixed_params
        tuple(sorted(t.system_attrs.get("fixed_params", {}).items()))
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    }
    n = 0
    for cfg in configs:
        params = space.params_of(cfg)
        if tuple(sorted(params.items())) not in have:
            study.enqueue_trial(params)
            n += 1
    return n


def default_config(problem, space: SearchSpace, spec=None) -> KernelConfig | None:
    """The engine's default config for this problem (and `spec`, its TracedSpec, when known;
    at its shape where the kind's default depends on it) if the space can express it, else
    None."""
    from engine.kernels.registry import KINDS

    if problem.template not in KINDS:
        return None
    try:
        cfg = problem.engine_default(spec)
    except ValueError:
        return None
    if not space.contains(cfg):
        log.warning("default config %s is outside %s: it cannot be the baseline",
                    cfg.key(), space.source)
        return None
    return cfg


def current_config(objective: Objective, space: SearchSpace, gpu: str,
                   tune_path: str | os.PathLike | None) -> KernelConfig | None:
    """What the engine would run for the objective's problem now: its tune-file entry (exact or
    nearest tuned shape) if the space can express it, else its default config. Measuring this
    as the baseline keeps a short study from writing an exact-shape entry slower than the
    nearest-shape entry the engine used before (seen on the H100: causal 4k, 8 trials)."""
    problem = objective.problem
    hit = tune_file.lookup(tune_path, template=problem.template, spec_hash=objective.spec_hash(),
                           dtype=problem.dtype, mode=problem.mode, gpu=gpu,
                           shape=problem.shape(), config_type=space.config_type)
    exact = hit is not None and bool(hit[1].get("exact"))
    if hit is not None and (exact or problem.kind.nearest):
        cfg = for_shape(hit[0], exact)  # as the engine runs the entry
        if space.contains(cfg) and not space.problems(
                cfg, problem.head_dim, problem.head_dim_v, problem.elem_bytes,
                **problem.validity_args()):
            return cfg
    return default_config(problem, space, objective.traced_spec())


def snapshot(study: optuna.Study, target: int) -> Snapshot:
    st = study_state(study)
    done = [t for t in st.evaluated if t.state == TrialState.COMPLETE]
    best = min(done, key=lambda t: t.value) if done else None
    return Snapshot(
        done=len(st.evaluated),
        target=target,
        failed=len(st.evaluated) - len(done),
        best_ms=best.value if best else None,
        best_tflops=best.user_attrs.get("tflops") if best else None,
        best_key=best.user_attrs.get("config") if best else None,
    )


def run_study(objective: Objective, space: SearchSpace, opts: TuneOptions) -> TuneResult:
    """Create or resume the study of `objective`'s problem, run it to its target (or time
    limit), and apply the tune-file rule. Ctrl-C: see the module docstring."""
    stop = threading.Event()
    interrupted = threading.Event()  # the first Ctrl-C: stop, write the best so far, re-raise
    with _first_sigint_stops(stop, interrupted):
        result = _run_study(objective, space, opts, stop, interrupted)
    if interrupted.is_set():
        raise StudyInterrupted(result)
    return result


def _run_study(objective: Objective, space: SearchSpace, opts: TuneOptions,
               stop: threading.Event, interrupted: threading.Event) -> TuneResult:
    problem = objective.problem
    valid = _valid_configs(problem, space)
    exhaustive = _exhaustive(opts, space, len(valid))
    target = len(valid) if exhaustive else opts.trials
    gpu = objective.gpu_name(opts.devices[0])
    storage_url = opts.storage or default_storage_url()
    storage = make_storage(storage_url, heartbeat_s=opts.heartbeat_s)
    study = _open_study(objective, space, opts, gpu, storage, len(valid))
    name = study.study_name
    seeds = valid if exhaustive else [c for c in space.seeds if c in set(valid)]
    baseline = current_config(objective, space, gpu, opts.tune_file)
    if baseline is not None and baseline not in set(valid):
        baseline = None
    if baseline is not None:  # measured by the baseline trial itself, not a queued one
        seeds = [c for c in seeds if c != baseline]
    _enqueue(study, seeds, space)
    run_id = uuid.uuid4().hex[:12]

    deadline = time.monotonic() + opts.timeout_s if opts.timeout_s else None
    jobs = _n_jobs(opts.compile_jobs)
    settings = LoopSettings(
        target=target,
        batch=max(1, jobs // len(opts.devices)),
        exhaustive=exhaustive,
        deadline=deadline,
        run_id=run_id,
        baseline=baseline,
    )
    compile_pool = CompilePool(jobs, opts.compile_timeout_s)
    benches: list[BenchWorker] = []
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []
    try:
        _start_workers(objective, space, opts, storage, name, settings, compile_pool, stop,
                       benches, threads, errors)
        _watch(threads, study, problem, target, opts)
        if errors:
            raise errors[0]
        result = summarize(study, name, storage_url, gpu, len(valid), exhaustive, target, run_id,
                           space.config_type)
        result.interrupted = interrupted.is_set() or (
            result.evaluated < target and deadline is not None and time.monotonic() >= deadline
        )
        if opts.write_tune_file:
            # The search is over: the GPU is free for the A/B confirmation.
            path = opts.tune_file or tune_file.default_path(gpu, problem.template)
            write_best(result, study, objective, baseline, Path(path),
                       bench_timer(benches[0], objective), rounds=opts.confirm_rounds,
                       margin=opts.confirm_margin)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=opts.bench_timeout_s + 30)
        compile_pool.close()
        for b in benches:
            b.close()
    return result


def _valid_configs(problem: Problem, space: SearchSpace) -> list:
    """The space's configs valid for the problem; a space for another template, or one with
    none valid here, refused by name."""
    if space.template != problem.template:
        raise ValueError(
            f"search space {space.source} is for template {space.template!r}, "
            f"but mode={problem.mode!r} needs {problem.template!r}"
        )
    valid = space.valid_configs(problem.head_dim, problem.head_dim_v, problem.elem_bytes,
                                **problem.validity_args())
    if not valid:
        raise ValueError(
            f"no config of {space.source} is valid for D={problem.head_dim}, "
            f"Dv={problem.head_dim_v}, dtype={problem.dtype}"
        )
    return valid


def _exhaustive(opts: TuneOptions, space: SearchSpace, n_valid: int) -> bool:
    """Whether the study measures every valid config: asked for (grid), refused (tpe), or
    (auto) where they are few."""
    if opts.search == "grid":
        return True
    if opts.search == "tpe":
        return False
    return n_valid <= max(space.exhaustive_max_valid, opts.trials)


def _start_workers(objective: Objective, space: SearchSpace, opts: TuneOptions, storage,
                   name: str, settings: LoopSettings, compile_pool: CompilePool,
                   stop: threading.Event, benches: list[BenchWorker],
                   threads: list[threading.Thread], errors: list[BaseException]) -> None:
    """A study worker thread per device, each with its bench process (appended to `benches`
    and `threads` as they start, so that the caller closes whatever started); a worker's
    error goes to `errors` and stops the others."""
    host_salt = zlib.crc32(socket.gethostname().encode()) % 10_000
    for rank, device in enumerate(opts.devices):
        bench = BenchWorker(device, opts.bench_timeout_s)
        benches.append(bench)
        # Each worker its own sampler and seed: identical samplers would propose the same
        # configs. Rank 0 on a single host keeps `seed` itself (reproducible runs).
        seed = opts.seed + 7919 * rank + (host_salt if len(opts.devices) > 1 else 0)
        worker_study = optuna.load_study(
            study_name=name, storage=storage, sampler=make_sampler(space, seed)
        )
        # The first worker measures the baseline before anything else it benchmarks.
        w_settings = settings if rank == 0 else dataclasses.replace(settings, baseline=None)
        worker = StudyWorker(worker_study, objective, space, w_settings, compile_pool, bench,
                             stop)

        def _run(w: StudyWorker = worker) -> None:
            try:
                w.run()
            except BaseException as exc:  # surfaced by the main thread below
                errors.append(exc)
                stop.set()

        th = threading.Thread(target=_run, name=f"tune-gpu{device}", daemon=True)
        threads.append(th)
        th.start()


def _open_study(objective: Objective, space: SearchSpace, opts: TuneOptions, gpu: str, storage,
                n_valid: int) -> optuna.Study:
    """The problem's study in `storage` (created, or resumed), its attributes set and the
    trials of a dead tuner re-queued."""
    problem = objective.problem
    kind = opts.kind or ("grid" if opts.search == "grid" else "tpe")
    name = study_name(problem, spec_hash=objective.spec_hash(), gpu=gpu, kind=kind)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="minimize", load_if_exists=True
    )
    if not _same_space(study, space):
        # Optuna refuses to go on with other choices for a parameter ("dynamic value space"):
        # a search space that changed since (a new field or value) gets a study of its own.
        name += ":space-" + space_digest(space)
        log.warning("study %s was drawn from another search space; using %s", study.study_name,
                    name)
        study = optuna.create_study(
            study_name=name, storage=storage, direction="minimize", load_if_exists=True
        )
    for k, v in {
        "template": problem.template, "variant": problem.variant,
        "spec_hash": objective.spec_hash(),
        "shape": problem.shape(), "dtype": problem.dtype, "mode": problem.mode, "gpu": gpu,
        "tilelang_version": tune_file.tilelang_version(), "search_space": space.source,
        "n_valid": n_valid,
    }.items():
        study.set_user_attr(k, v)
    reaped = reap_dead_trials(study)
    if reaped:
        log.warning("study %s: %d trial(s) of a dead tuner failed and re-queued", name, reaped)
    return study


def _watch(threads: list[threading.Thread], study: optuna.Study, problem, target: int,
           opts: TuneOptions) -> None:
    """Show progress until every worker thread has finished."""
    title = f"tune {problem.template} {problem.variant} {problem.dtype} {problem.mode}"
    with ProgressDisplay(title, target, opts.timeout_s, opts.progress) as display:
        while any(t.is_alive() for t in threads):
            display.update(snapshot(study, target))
            time.sleep(0.5)
        display.update(snapshot(study, target))


@contextlib.contextmanager
def _first_sigint_stops(stop: threading.Event, interrupted: threading.Event):
    """While a study runs in the main thread under Python's default SIGINT handling: the first
    Ctrl-C sets `stop` and `interrupted` (the workers finish the trials in flight and the best
    so far is written), a second one raises KeyboardInterrupt as usual (abort, nothing written).
    Worker processes ignore SIGINT (pebble), so a terminal's Ctrl-C reaches only this process."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def on_sigint(signum, frame) -> None:
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        stop.set()
        # os.write, not print: a signal handler may interrupt a print to stderr.
        os.write(2, b"\nattnbench tune: interrupted; finishing the trials in flight, then "
                    b"writing the best config so far (Ctrl-C again to abort)\n")

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def summarize(
    study: optuna.Study, name: str, storage_url: str, gpu: str, n_valid: int, exhaustive: bool,
    target: int, run_id: str = "", config_type: type = KernelConfig,
) -> TuneResult:
    st = study_state(study)
    evaluated = sorted(
        st.evaluated, key=lambda t: (t.datetime_complete or dt.datetime.min, t.number)
    )
    done = [t for t in evaluated if t.state == TrialState.COMPLETE]
    best = min(done, key=lambda t: t.value) if done else None
    res = TuneResult(
        study_name=name,
        storage=_redact(storage_url),
        gpu=gpu,
        n_valid=n_valid,
        exhaustive=exhaustive,
        target=target,
        evaluated=len(evaluated),
        failed=len(evaluated) - len(done),
        best_latency_ms=best.value if best else None,
        best_tflops=best.user_attrs.get("tflops") if best else None,
        best_config=config_type(**best.params).to_dict() if best else None,
        best_tbps=best.user_attrs.get("tbps") if best else None,
        best_trial=best.number if best else None,
        history=[t.value if t.state == TrialState.COMPLETE else math.inf for t in evaluated],
        history_keys=[config_type(**t.params).key() for t in evaluated],
        run_id=run_id,
    )
    if run_id:
        mine = [
            t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("run") == run_id
            and (t.user_attrs.get("evaluated") or t.user_attrs.get("baseline"))
        ]
        base = [t for t in mine if t.user_attrs.get("baseline")]
        if base:
            res.baseline_latency_ms = base[0].value
            res.baseline_config = config_type(**base[0].params).to_dict()
        if mine:
            top = min(mine, key=lambda t: (t.value, t.number))
            res.run_best_latency_ms = top.value
            res.run_best_config = config_type(**top.params).to_dict()
            res.run_best_tflops = top.user_attrs.get("tflops")
            res.run_best_trial = top.number
    return res


def _redact(url: str) -> str:
    # Never write a database password into a result file or a log line.
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return url


def bench_timer(bench: BenchWorker, objective: Objective):
    """One measurement (ms) of a config per call, through the benchmark worker and the
    objective's own evaluate: the call path the trials were timed on."""

    def time_ms(cfg: KernelConfig) -> float:
        outcome = bench.run(objective, cfg)
        if not outcome.ok:
            raise TrialFailed(f"{cfg.key()}: {(outcome.reason.splitlines() or [''])[0]}")
        return outcome.measurement.latency_ms

    return time_ms
