"""The tune-file rule: the best config of the whole study (every run and process of it) is
timed against the baseline, the config the engine would run now, alternately in this run
(confirm.py), and written only when it beats the baseline beyond the noise; otherwise the
baseline is recorded and an existing entry kept. An existing entry is replaced only by a winner
confirmed against it (or a re-confirmation of its own config); one with another config, which
another tuner wrote meanwhile, stays if its recorded latency is lower.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from pathlib import Path

import optuna

from attnbench.tune.confirm import MARGIN, ROUNDS, Confirmation, confirm
from attnbench.tune.objective import Objective, TrialFailed
from attnbench.tune.result import TuneResult
from engine.plan.config import KernelConfig
from engine.tuning import tune_file

log = logging.getLogger(__name__)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The study's best measured trial over all its runs (None when nothing succeeded)."""
    try:
        return study.best_trial
    except ValueError:
        return None


def write_best(result: TuneResult, study: optuna.Study, objective: Objective,
               baseline: KernelConfig | None, path: Path, timer: Callable[[KernelConfig], float],
               *, rounds: int = ROUNDS, margin: float = MARGIN) -> None:
    """Apply the tune-file rule (module docstring): confirm the study's best config against
    `baseline` with `timer` and write the entry to `path`; records the outcome in `result`
    (tune_file, tune_file_note, confirmation, entry)."""
    best = best_trial(study)
    if best is None or baseline is None:
        why = ("no config of the study was measured successfully" if best is None else
               "the engine's current config is not in the search space, so no winner can be "
               "confirmed against it")
        _note(result, f"tune file not written: {why}", logging.WARNING)
        return
    winner = objective.problem.kind.config_type(**best.params)
    conf = None
    if winner != baseline:
        try:
            conf = confirm(winner, baseline, timer, rounds=rounds, margin=margin)
        except TrialFailed as exc:
            _note(result, f"tune file not written: the A/B timing of the winner against the "
                          f"baseline failed ({exc})", logging.WARNING)
            return
        result.confirmation = conf.to_dict() | {"winner_config": winner.to_dict(),
                                                "baseline_config": baseline.to_dict()}
    if conf is not None and conf.faster:
        _store_winner(result, objective, path, best, winner, baseline, conf)
    else:
        _store_baseline(result, objective, path, best, baseline, conf)


def _entry(result: TuneResult, objective: Objective, best, cfg: KernelConfig, latency_ms: float,
           baseline: KernelConfig, baseline_ms: float, outcome: str) -> dict:
    problem = objective.problem
    flops = problem.flops(objective.unmasked_fraction())
    extra = {}
    if problem.decode:  # the cache's lengths: not part of the key (the engine cannot see them)
        extra["ragged"] = problem.ragged
    if best.user_attrs.get("bytes"):  # an objective that counts the bytes it moves (decode)
        extra["tbps"] = float(best.user_attrs["bytes"]) / (latency_ms * 1e-3) / 1e12
    return extra | {
        "template": problem.template,
        "variant": problem.variant,
        "spec_hash": objective.spec_hash(),
        "dtype": problem.dtype,
        "mode": problem.mode,
        "gpu": result.gpu,
        "shape": problem.shape(),
        "config": cfg.to_dict(),
        "latency_ms": latency_ms,
        "tflops": flops / (latency_ms * 1e-3) / 1e12,
        "default_config": baseline.to_dict(),  # the baseline: what the engine ran before
        "default_latency_ms": baseline_ms,
        # what the engine runs without an entry: the entry holds while that stays the same
        # (engine.tuning.select.is_current)
        "engine_default": _engine_default(objective),
        "outcome": outcome,  # "tuned": a confirmed winner; "baseline": the engine's choice kept
        "trial_latency_ms": best.value,  # the study's best trial, as the search timed it
        "confirm": result.confirmation,  # the A/B rounds (None: the winner was the baseline)
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tilelang_version": tune_file.tilelang_version(),
        "study": result.study_name,
        "trials": result.evaluated,
        "best_trial": best.number,
    }


def _engine_default(objective: Objective) -> dict | None:
    """The engine's default for the objective's spec, or None where the objective knows no
    spec (the engine's default depends on it) or no config fits."""
    spec = objective.traced_spec()
    if spec is None:
        return None
    try:
        return objective.problem.engine_default(spec).to_dict()
    except ValueError:
        return None


def _config_of(entry, config_type: type) -> KernelConfig | None:
    try:
        return config_type.from_dict(dict(entry["config"]))
    except Exception:  # a hand-edited or foreign entry: compared as "another config"
        return None


def _key_of(entry, config_type: type) -> str:
    cfg = _config_of(entry, config_type)
    return cfg.key() if cfg is not None else "an unreadable config"


def _store_winner(result, objective, path: Path, best, winner: KernelConfig,
                  baseline: KernelConfig, conf: Confirmation) -> None:
    entry = _entry(result, objective, best, winner, conf.winner_median_ms, baseline,
                   conf.baseline_median_ms, "tuned")
    ctype = type(winner)

    def keep_old(old, new) -> bool:
        # The old entry is the baseline just beaten (or this winner): replace it. A different
        # config means another tuner wrote meanwhile: the faster recorded latency stays.
        if _config_of(old, ctype) in (baseline, winner):
            return False
        try:
            return float(old["latency_ms"]) <= float(new["latency_ms"])
        except (KeyError, TypeError, ValueError):
            return False

    written, old = tune_file.store_unless(path, entry, keep_old, ctype)
    if written:
        result.tune_file, result.entry = str(path), entry
        _note(result, f"wrote {winner.key()} to {path}: {conf.reason()}"
              + (f"; replaced {_key_of(old, ctype)}" if old else ""))
    else:
        result.entry = old
        _note(result, f"kept the entry of {path} that another tuner wrote meanwhile "
              f"({_key_of(old, ctype)}, {old.get('latency_ms')} ms): faster than this run's confirmed "
              f"winner {winner.key()} ({conf.winner_median_ms:.4g} ms)")


def _store_baseline(result, objective, path: Path, best, baseline: KernelConfig,
                    conf: Confirmation | None) -> None:
    why = (conf.reason() if conf is not None
           else "the study's best config is the one the engine runs now")
    ms = conf.baseline_median_ms if conf is not None else best.value
    entry = _entry(result, objective, best, baseline, ms, baseline, ms, "baseline")
    # An existing entry stays: it is the baseline itself, or newer than it.
    ctype = type(baseline)
    written, old = tune_file.store_unless(path, entry, lambda old, new: True, ctype)
    if written:
        result.tune_file, result.entry = str(path), entry
        _note(result, f"recorded the engine's current config {baseline.key()} ({ms:.4g} ms) in "
                      f"{path}: {why}")
    else:
        result.entry = old
        _note(result, f"kept the entry of {path} ({_key_of(old, ctype)}): {why}")


def _note(result: TuneResult, text: str, level: int = logging.INFO) -> None:
    result.tune_file_note = text
    log.log(level, "study %s: %s", result.study_name, text)
