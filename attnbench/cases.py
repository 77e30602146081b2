"""Case: one benchmark problem of a suite (variant x shape x dtype, its modes and the
implementations to run). Suites make cases; implementations and the runner read them, so it
lives apart from both (suites.py and impls/ import it, never each other for it)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.problem import Problem


@dataclass(frozen=True)
class Case(Problem):
    """The problem's sizes (engine.problem.Problem) and the suite's choices for it."""

    suite: str
    name: str
    variant: str
    shape: str
    dtype: str
    kind: str
    modes: tuple[str, ...]
    impls: tuple[str, ...]
    baseline: str
    # decode cases only (kind "decode", attnbench.decode): differing valid lengths per
    # sequence, and the paged cache's page size (0: contiguous)
    ragged: bool = False
    page_size: int = 0
    # linear cases only (kind "linear", attnbench.linear): the value (and output) heads H, which
    # heads_q (HQ) and heads_kv (HK) divide; 0 for the other kinds
    heads: int = 0
