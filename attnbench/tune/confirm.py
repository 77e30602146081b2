"""A/B confirmation: is the tuning winner faster than the baseline beyond the noise?

A study's best trial is the minimum of many timings, so part of its lead is luck (re-timings of
one config minutes apart move by up to 4% on the H100), and a winner that only looked faster
would be written to the tune file and run slower in the user's loop. So before an entry is
written, the winner (A) and the baseline (B, the config the engine runs now) are timed
alternately through one timer, `rounds` times each, in the order A B, B A, A B, ... (each round
reversed from the last, so a steady drift of clocks or temperature favours neither). The winner
is confirmed only when its median over the rounds beats the baseline's by more than the noise:
the larger of the two spreads (max - min over the rounds) and `margin` of the baseline's median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

C = TypeVar("C")

ROUNDS = 4
MARGIN = 0.01  # the least gain worth a tune-file entry, relative to the baseline


@dataclass(frozen=True)
class Confirmation:
    """The alternating timings of a winner and a baseline (ms, in measurement order each)."""

    winner_ms: tuple[float, ...]
    baseline_ms: tuple[float, ...]
    margin: float = MARGIN

    def __post_init__(self) -> None:
        if not self.winner_ms or len(self.winner_ms) != len(self.baseline_ms):
            raise ValueError("winner_ms and baseline_ms: expected one timing each per round")

    @property
    def rounds(self) -> int:
        return len(self.winner_ms)

    @property
    def winner_median_ms(self) -> float:
        return statistics.median(self.winner_ms)

    @property
    def baseline_median_ms(self) -> float:
        return statistics.median(self.baseline_ms)

    @property
    def winner_spread_ms(self) -> float:
        return max(self.winner_ms) - min(self.winner_ms)

    @property
    def baseline_spread_ms(self) -> float:
        return max(self.baseline_ms) - min(self.baseline_ms)

    @property
    def required_gain_ms(self) -> float:
        """How much faster the winner's median must be: the noise, at least `margin`."""
        return max(self.winner_spread_ms, self.baseline_spread_ms,
                   self.margin * self.baseline_median_ms)

    @property
    def faster(self) -> bool:
        return self.baseline_median_ms - self.winner_median_ms > self.required_gain_ms

    def reason(self) -> str:
        gain = self.baseline_median_ms - self.winner_median_ms
        verdict = "beats" if self.faster else "does not beat"
        return (f"winner {self.winner_median_ms:.4g} ms {verdict} baseline "
                f"{self.baseline_median_ms:.4g} ms by more than the noise over {self.rounds} "
                f"A/B rounds (gain {gain:.3g} ms, needed > {self.required_gain_ms:.3g} ms: "
                f"spreads {self.winner_spread_ms:.3g}/{self.baseline_spread_ms:.3g} ms, "
                f"margin {self.margin:.0%})")

    def to_dict(self) -> dict[str, Any]:
        """The record kept in the tune-file entry (field `confirm`)."""
        return {
            "rounds": self.rounds,
            "order": "alternating, each round reversed (AB BA AB ...)",
            "winner_ms": list(self.winner_ms),
            "baseline_ms": list(self.baseline_ms),
            "winner_median_ms": self.winner_median_ms,
            "baseline_median_ms": self.baseline_median_ms,
            "winner_spread_ms": self.winner_spread_ms,
            "baseline_spread_ms": self.baseline_spread_ms,
            "required_gain_ms": self.required_gain_ms,
            "margin": self.margin,
            "faster": self.faster,
            "reason": self.reason(),
        }


def confirm(winner: C, baseline: C, timer: Callable[[C], float], *, rounds: int = ROUNDS,
            margin: float = MARGIN) -> Confirmation:
    """Time `winner` and `baseline` alternately with `timer` (one measurement in ms per call:
    the tuner passes its benchmark worker, i.e. the objective's own call path). Errors of the
    timer propagate: a config that cannot be timed cannot be confirmed."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected >= 1")
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin}: expected a fraction in [0, 1)")
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            a.append(timer(winner))
            b.append(timer(baseline))
        else:
            b.append(timer(baseline))
            a.append(timer(winner))
    return Confirmation(tuple(a), tuple(b), margin)
