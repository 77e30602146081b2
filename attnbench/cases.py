"""Case: one benchmark problem of a suite (variant x shape x dtype, its modes and the
implementations to run). Suites make cases; implementations and the runner read them, so it
lives apart from both (suites.py and impls/ import it, never each other for it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    variant: str
    shape: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    kind: str
    modes: tuple[str, ...]
    impls: tuple[str, ...]
    baseline: str
