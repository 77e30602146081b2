"""What one tuning run returns: the study's best, this run's best and baseline, and what
happened to the tune file (read by the CLI, the grid comparison and the tune-file rule)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TuneResult:
    study_name: str
    storage: str
    gpu: str
    n_valid: int
    exhaustive: bool
    target: int
    evaluated: int
    failed: int
    best_latency_ms: float | None
    best_tflops: float | None
    best_config: dict | None
    best_trial: int | None
    best_tbps: float | None = None  # decode: bytes moved / time (the trial's `tbps`)
    history: list[float] = field(default_factory=list)  # latency per evaluated trial, in order
    history_keys: list[str] = field(default_factory=list)  # config key per evaluated trial
    tune_file: str | None = None
    run_id: str = ""
    baseline_config: dict | None = None  # the engine's current choice, measured in this run
    baseline_latency_ms: float | None = None
    run_best_latency_ms: float | None = None  # fastest config measured in this run
    run_best_config: dict | None = None
    run_best_tflops: float | None = None
    run_best_trial: int | None = None
    tune_file_note: str = ""  # what happened to the tune file, and why
    interrupted: bool = False  # stopped by --timeout or Ctrl-C before reaching its target
    confirmation: dict | None = None  # the A/B timings of winner and baseline (confirm.py)
    entry: dict | None = None  # the tune file's entry for the problem after this run
