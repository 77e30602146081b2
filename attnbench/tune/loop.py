"""The study loop of one GPU worker: ask candidates, prune invalid ones before anything compiles,
compile a batch in parallel, benchmark one at a time on this GPU, tell results.

Trial bookkeeping (user attributes), shared by every worker of a study wherever it runs:
- `owner`: "<host>:<pid>" of the asking process (recovery, see storage.py);
- `config`: KernelConfig.key(); `candidate`: True once a trial is going to be evaluated;
- `evaluated`: True on a finished trial whose config was compiled (and benchmarked); only these
  count toward the study's trial budget;
- `invalid` (PRUNED, constraint > 0): the validity model's reasons; `duplicate_of`: a config
  already measured (its value is reused; nothing runs); `fail_reason`: why a trial FAILed;
- on success: `latency_ms`, `tflops` and whatever the objective reports (e.g. `rel_err`);
- `run`: the id of the tuner run that asked the trial; `baseline`: True on the run's measurement
  of the config the engine runs now (measured first in every run; before the tune file is
  written, publish.write_best times it against the winner again, see confirm.py);
  `baseline_rerun`: a baseline whose config the study had already measured (not counted, not
  `evaluated`).

Pipeline: a worker keeps up to `batch` configs compiling on the CPU pool while its GPU
benchmarks the ones already compiled, and asks for new candidates as soon as a slot frees (after
each result, so TPE sees every measurement before its next proposal).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import warnings
from dataclasses import dataclass

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, Trial, TrialState, create_trial

from attnbench.tune.objective import Objective
from attnbench.tune.space import SearchSpace
from attnbench.tune.storage import OWNER_ATTR, Heartbeat, ask_lock, owner_tag
from attnbench.tune.workers import BenchWorker, CompilePool
from engine.plan.config import KernelConfig

log = logging.getLogger(__name__)
# Optuna warns that heartbeats are meant for Study.optimize; this loop beats for its own trials
# (storage.Heartbeat), which is the case the warning does not know about.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed", category=UserWarning)


@dataclass(frozen=True)
class LoopSettings:
    target: int  # evaluated trials the study should reach (all workers together)
    batch: int  # candidates compiled in parallel per round
    exhaustive: bool  # evaluate only enqueued configs (all valid ones), no sampling
    deadline: float | None = None  # time.monotonic() at which to stop
    max_idle_asks: int = 300  # asks in a row yielding nothing new: the space is exhausted
    run_id: str = ""  # tags every trial this run asks (user attribute `run`)
    baseline: KernelConfig | None = None  # measured first by this worker (the engine default)


@dataclass
class StudyState:
    evaluated: list[FrozenTrial]
    in_flight: int
    waiting: int
    known: dict[str, FrozenTrial]  # config key -> evaluated trial
    running_keys: set[str]


def space_distributions(space: SearchSpace) -> dict[str, CategoricalDistribution]:
    """Optuna's distribution of each parameter of `space` (its choices, in order)."""
    return {n: CategoricalDistribution(list(c)) for n, c in space.params}


def study_state(study: optuna.Study) -> StudyState:
    evaluated, known, running_keys = [], {}, set()
    in_flight = waiting = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            waiting += 1
        elif t.state == TrialState.RUNNING and t.user_attrs.get("candidate"):
            in_flight += 1
            running_keys.add(t.user_attrs.get("config", ""))
        elif t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get("evaluated"):
            evaluated.append(t)
            key = t.user_attrs.get("config")
            # Prefer a successful measurement of a config over a failed one.
            if key and (key not in known or known[key].state != TrialState.COMPLETE):
                known[key] = t
    return StudyState(evaluated, in_flight, waiting, known, running_keys)


def make_sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(
        multivariate=True,
        n_startup_trials=space.n_startup_trials,
        seed=seed,
        constant_liar=True,  # several workers: do not all propose the same point
    )


class StudyWorker:
    """Runs the ask/compile/benchmark/tell loop of one GPU against one study."""

    def __init__(
        self,
        study: optuna.Study,
        objective: Objective,
        space: SearchSpace,
        settings: LoopSettings,
        compile_pool: CompilePool,
        bench: BenchWorker,
        stop: threading.Event,
    ) -> None:
        self.study = study
        self.objective = objective
        self.space = space
        self.settings = settings
        self.compile_pool = compile_pool
        self.bench = bench
        self.stop = stop
        self.problem = objective.problem
        self.flops = self.problem.flops(objective.unmasked_fraction())
        self.owner = owner_tag()
        self.heartbeat = Heartbeat(study._storage)

    def _should_stop(self) -> bool:
        dl = self.settings.deadline
        return self.stop.is_set() or (dl is not None and time.monotonic() >= dl)

    def run(self) -> None:
        inflight: dict[concurrent.futures.Future, tuple[Trial, KernelConfig]] = {}
        ready: list[tuple[Trial, KernelConfig]] = []  # compiled, waiting for the GPU
        baseline: int | None = None  # trial number of the baseline while it is pending
        dry = False  # nothing more to ask (space exhausted, queue empty or target reached)
        try:
            if self.settings.baseline is not None and not self._should_stop():
                trial, cfg = self._start_baseline(self.settings.baseline)
                baseline = trial.number
                inflight[self.compile_pool.submit(self.objective, cfg)] = (trial, cfg)
            while not self._should_stop():
                busy = len(inflight) + len(ready)
                if not dry and busy < self.settings.batch:
                    for trial, cfg in self._top_up(self.settings.batch - busy):
                        inflight[self.compile_pool.submit(self.objective, cfg)] = (trial, cfg)
                    dry = self._dry
                for fut in [f for f in inflight if f.done()]:
                    trial, cfg = inflight.pop(fut)
                    outcome = self.compile_pool.result(fut)
                    if outcome.ok:
                        ready.append((trial, cfg))
                    else:
                        self._fail(trial, "compile", outcome.reason)
                pick = self._next_bench(ready, inflight, baseline)
                if pick is None:
                    if not inflight:
                        if not ready and (dry or self._remaining() <= 0):
                            break
                        continue
                    concurrent.futures.wait(
                        list(inflight), timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    continue
                ready.remove(pick)
                if pick[0].number == baseline:
                    baseline = None
                self._bench(*pick)
        finally:
            for fut, (trial, _) in inflight.items():
                fut.cancel()
                self._abandon(trial)
            for trial, _ in ready:
                self._abandon(trial)
            self.heartbeat.close()

    @staticmethod
    def _next_bench(ready, inflight, baseline: int | None):
        """The baseline first (waiting for its compile); then in ask order."""
        if baseline is not None:
            for item in ready:
                if item[0].number == baseline:
                    return item
            if any(t.number == baseline for t, _ in inflight.values()):
                return None
        return min(ready, key=lambda item: item[0].number) if ready else None

    def _remaining(self, state: StudyState | None = None) -> int:
        state = state or study_state(self.study)
        return self.settings.target - len(state.evaluated) - state.in_flight

    def _top_up(self, slots: int) -> list[tuple[Trial, KernelConfig]]:
        """Up to `slots` new candidates; sets `_dry` when no more will come."""
        self._dry = False
        state = study_state(self.study)
        if self.settings.exhaustive and state.waiting == 0:
            self._dry = True
            return []
        want = min(slots, self._remaining(state))
        if want <= 0:
            return []
        cands = self._ask_candidates(want, state)
        self._dry = not cands
        return cands

    def _start_baseline(self, cfg: KernelConfig) -> tuple[Trial, KernelConfig]:
        """A RUNNING trial of the default config, created directly (not through the WAITING
        queue, which a resumed study may have filled) so that it is measured first. Other
        workers see it as a running candidate and do not measure the same config meanwhile."""
        key = cfg.key()
        state = study_state(self.study)
        rerun = key in state.known or key in state.running_keys
        params = self.space.params_of(cfg)
        dists = space_distributions(self.space)
        attrs = {OWNER_ATTR: self.owner, "config": key, "candidate": True, "baseline": True,
                 "run": self.settings.run_id}
        if rerun:
            attrs["baseline_rerun"] = True
        template = create_trial(
            state=TrialState.RUNNING, params=params, distributions=dists, user_attrs=attrs
        )
        storage = self.study._storage
        trial_id = storage.create_new_trial(self.study._study_id, template_trial=template)
        trial = Trial(self.study, trial_id)
        trial.set_constraint("validity", 0.0)
        self.heartbeat.add(trial_id)
        return trial, cfg

    def _counts(self, trial: Trial) -> bool:
        return not trial.user_attrs.get("baseline_rerun")

    def _ask_candidates(self, want: int, state: StudyState) -> list[tuple[Trial, KernelConfig]]:
        cands: list[tuple[Trial, KernelConfig]] = []
        taken = set(state.running_keys)
        idle = 0
        while len(cands) < want and idle < self.settings.max_idle_asks and not self._should_stop():
            if self.settings.exhaustive and idle and not study_state(self.study).waiting:
                break
            # Owner written under the ask lock: the reaper, holding it, can tell an ownerless
            # RUNNING trial for an orphan (its asker died between ask and this line).
            with ask_lock(self.study._storage):
                trial = self.study.ask()
                trial.set_user_attr(OWNER_ATTR, self.owner)
            trial.set_user_attr("run", self.settings.run_id)
            params = {n: trial.suggest_categorical(n, list(c)) for n, c in self.space.params}
            cfg = self.space.config(params)
            key = cfg.key()
            trial.set_user_attr("config", key)
            p = self.problem
            problems = self.space.problems(cfg, p.head_dim, p.head_dim_v, p.elem_bytes,
                                           **p.validity_args())
            # The validity model is Optuna's constraint: TPE learns to avoid infeasible regions.
            trial.set_constraint("validity", float(len(problems)))
            if problems:
                trial.set_user_attr("invalid", "; ".join(problems))
                self.study.tell(trial, state=TrialState.PRUNED)
                idle += 1
                continue
            trial.set_user_attr("candidate", True)
            self.heartbeat.add(trial._trial_id)
            prev = state.known.get(key)
            if prev is None and key not in taken:
                prev, taken_elsewhere = self._claimed(trial, key)
                if taken_elsewhere:
                    taken.add(key)
            if prev is not None or key in taken:
                idle += 1
                self._tell_duplicate(trial, prev)
                if len(state.known) >= self._n_valid():
                    break  # every valid config has been measured
                continue
            taken.add(key)
            cands.append((trial, cfg))
            idle = 0
        return cands

    def _claimed(self, trial: Trial, key: str) -> tuple[FrozenTrial | None, bool]:
        """A fresh look at the study after this trial claimed `key`: an evaluated trial of the
        same config, and whether another worker's running trial claimed it first (the lower
        trial number wins, so two workers racing for one config never both measure it)."""
        prev, taken = None, False
        for t in self.study.get_trials(deepcopy=False):
            if t.number == trial.number or t.user_attrs.get("config") != key:
                continue
            if t.state == TrialState.RUNNING and t.user_attrs.get("candidate"):
                taken = taken or t.number < trial.number
            elif t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get(
                "evaluated"
            ):
                if prev is None or prev.state != TrialState.COMPLETE:
                    prev = t
        return prev, taken

    def _n_valid(self) -> int:
        if not hasattr(self, "_valid_count"):
            p = self.problem
            valid = self.space.valid_configs(p.head_dim, p.head_dim_v, p.elem_bytes,
                                             **p.validity_args())
            self._valid_count = len(valid)
        return self._valid_count

    def _tell_duplicate(self, trial: Trial, prev: FrozenTrial | None) -> None:
        self.heartbeat.remove(trial._trial_id)
        if prev is not None and prev.state == TrialState.COMPLETE:
            trial.set_user_attr("duplicate_of", prev.number)
            self.study.tell(trial, prev.value)
            return
        # A config that failed before, or one another worker is measuring right now.
        trial.set_user_attr("duplicate_of", prev.number if prev is not None else -1)
        self.study.tell(trial, state=TrialState.PRUNED)

    def _bench(self, trial: Trial, cfg: KernelConfig) -> None:
        t0 = time.monotonic()
        outcome = self.bench.run(self.objective, cfg)
        if not outcome.ok:
            self._fail(trial, "benchmark", outcome.reason)
            return
        m = outcome.measurement
        if self._counts(trial):
            trial.set_user_attr("evaluated", True)
        trial.set_user_attr("latency_ms", m.latency_ms)
        trial.set_user_attr("tflops", self.flops / (m.latency_ms * 1e-3) / 1e12)
        trial.set_user_attr("bench_s", round(time.monotonic() - t0, 3))
        for k, v in m.info.items():
            trial.set_user_attr(k, v)
        self._tell(trial, values=m.latency_ms)

    def _fail(self, trial: Trial, step: str, reason: str) -> None:
        log.info("trial %d failed at %s: %s", trial.number, step,
                 (reason.splitlines() or [""])[0])
        if self._counts(trial):
            trial.set_user_attr("evaluated", True)
        trial.set_user_attr("fail_step", step)
        trial.set_user_attr("fail_reason", reason)
        self._tell(trial, state=TrialState.FAIL)

    def _abandon(self, trial: Trial) -> None:
        """Interrupted before it was measured: fail it (not counted) and queue its config."""
        trial.set_user_attr("fail_reason", "interrupted before evaluation")
        self._tell(trial, state=TrialState.FAIL)
        if not trial.user_attrs.get("baseline"):  # each run measures its own baseline
            self.study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})

    def _tell(self, trial: Trial, **kw) -> None:
        self.heartbeat.remove(trial._trial_id)
        self.study.tell(trial, **kw)
