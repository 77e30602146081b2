"""The A/B confirmation before a tune-file entry is written (attnbench/tune/confirm.py): timers
with injected noise on the CPU, then the whole study with the fake objective."""

from __future__ import annotations

import random

import pytest

from attnbench.tune.confirm import Confirmation, confirm
from attnbench.tune.objective import FakeObjective, fake_latency_ms
from attnbench.tune.problem import Problem
from attnbench.tune.runner import TuneOptions, run_study
from attnbench.tune.space import parse_space
from engine.plan.config import KernelConfig
from engine.tuning.tune_file import lookup

pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")

PROBLEM = Problem("softmax", batch=2, heads_q=32, heads_kv=8, seqlen_q=4096, seqlen_kv=4096,
                  head_dim=128, head_dim_v=128)


def _noisy(true_ms: dict[str, float], noise: float, seed: int):
    """A timer: each call the config's true latency times 1 + noise * u, u uniform in [-1, 1)."""
    rng = random.Random(seed)
    calls: list[str] = []

    def timer(cfg: str) -> float:
        calls.append(cfg)
        return true_ms[cfg] * (1 + noise * rng.uniform(-1, 1))

    timer.calls = calls  # type: ignore[attr-defined]
    return timer


def test_rounds_alternate_and_reverse_so_drift_favours_neither():
    timer = _noisy({"A": 1.0, "B": 1.2}, 0.0, 0)
    res = confirm("A", "B", timer, rounds=4)
    assert timer.calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert res.rounds == 4 and res.winner_ms == (1.0,) * 4 and res.baseline_ms == (1.2,) * 4
    assert res.faster and "beats" in res.reason()
    # Under a steady drift (each call 1% slower than the last) two equal configs measure alike.
    clock = iter(range(100))
    drift = confirm("A", "B", lambda cfg: 1.0 + 0.01 * next(clock), rounds=4)
    assert drift.winner_median_ms == pytest.approx(drift.baseline_median_ms)
    assert not drift.faster


@pytest.mark.parametrize("seed", range(40))
def test_a_winner_faster_only_by_noise_is_not_confirmed(seed):
    # Issue 22's H200 case: the study timed the winner 6% faster than the default (a lucky
    # minimum), but in the user's loop it ran 2.5% slower. Each A/B timing here moves by up to
    # +-3% (what re-timings of one config show on the H100).
    res = confirm("W", "B", _noisy({"W": 1.025, "B": 1.0}, 0.03, seed))
    assert not res.faster, res.reason()
    assert "does not beat" in res.reason()


def test_equal_configs_are_rarely_confirmed():
    """Two configs of the same true speed under +-3% noise: the rule's false positives (which
    write a config no slower than the baseline) stay near 1%."""
    wins = sum(confirm("W", "B", _noisy({"W": 1.0, "B": 1.0}, 0.03, seed)).faster
               for seed in range(1000))
    assert wins <= 20


@pytest.mark.parametrize("seed", range(40))
def test_a_clearly_faster_winner_is_confirmed_through_the_noise(seed):
    res = confirm("W", "B", _noisy({"W": 0.85, "B": 1.0}, 0.03, seed))
    assert res.faster, res.reason()
    assert res.winner_median_ms < res.baseline_median_ms - res.required_gain_ms


def test_without_noise_the_margin_decides():
    base = {"B": 1.0}
    assert not confirm("W", "B", _noisy({**base, "W": 0.995}, 0.0, 0)).faster  # 0.5% < 1%
    assert confirm("W", "B", _noisy({**base, "W": 0.98}, 0.0, 0)).faster
    assert confirm("W", "B", _noisy({**base, "W": 0.995}, 0.0, 0), margin=0.0).faster


def test_the_larger_spread_is_the_noise():
    # The baseline is steady, the winner jumps by 0.2 ms between rounds: a 0.1 ms lead of its
    # median is inside its own noise.
    res = Confirmation(winner_ms=(0.8, 1.0, 0.8, 1.0), baseline_ms=(1.0, 1.0, 1.0, 1.0))
    assert res.winner_spread_ms == pytest.approx(0.2) and res.baseline_spread_ms == 0
    assert res.required_gain_ms == pytest.approx(0.2) and not res.faster
    record = res.to_dict()
    assert record["winner_ms"] == [0.8, 1.0, 0.8, 1.0] and record["faster"] is False
    assert record["winner_median_ms"] == pytest.approx(0.9) and record["rounds"] == 4


def test_bad_arguments_and_timer_errors():
    with pytest.raises(ValueError, match="rounds=0"):
        confirm("A", "B", lambda c: 1.0, rounds=0)
    with pytest.raises(ValueError, match="margin"):
        confirm("A", "B", lambda c: 1.0, margin=1.5)
    with pytest.raises(ValueError, match="one timing each per round"):
        Confirmation(winner_ms=(1.0,), baseline_ms=())

    def failing(cfg):
        raise RuntimeError(f"{cfg} crashed")

    with pytest.raises(RuntimeError, match="A crashed"):
        confirm("A", "B", failing)


SPACE = {
    "template": "attention_fwd",
    "params": {"block_M": [64, 128, 192], "block_N": [64, 128], "num_stages": [2],
               "threads": [256, 384], "schedule": ["auto", "overlap"],
               "persistent": [False, True]},
}


def _opts(tmp_path, **kw) -> TuneOptions:
    return TuneOptions(**{**dict(storage=f"sqlite:///{tmp_path / 's.db'}", compile_jobs=1,
                                 progress=False, tune_file=tmp_path / "tune.json",
                                 bench_timeout_s=20, compile_timeout_s=20, trials=4,
                                 search="tpe"), **kw})


def _entry(tmp_path):
    return lookup(tmp_path / "tune.json", template="attention_fwd", spec_hash="fake-spec",
                  dtype="bf16", mode="fwd", gpu="Fake GPU", shape=PROBLEM.shape())


def test_study_whose_best_is_only_noise_records_the_baseline(tmp_path, caplog):
    """Every config has the same latency; the measurements move by +-8%. The study's best is
    the luckiest timing, and the A/B rounds show it for what it is: the tune file records the
    config the engine runs now, and the log says why."""
    from engine.kernels.attention_fwd.plan import default_forward_config

    default = default_forward_config(128, 128)
    obj = FakeObjective(PROBLEM, flat=True, noise=0.08)
    with caplog.at_level("INFO", logger="attnbench.tune.publish"):
        res = run_study(obj, parse_space(SPACE), _opts(tmp_path, trials=8))
    assert res.confirmation is not None, "the lucky winner must not be the default itself"
    assert res.confirmation["faster"] is False
    assert KernelConfig.from_dict(res.confirmation["winner_config"]) != default
    cfg, meta = _entry(tmp_path)
    assert cfg == default and meta["outcome"] == "baseline"
    assert meta["confirm"]["rounds"] == 4 and len(meta["confirm"]["winner_ms"]) == 4
    assert meta["latency_ms"] == meta["confirm"]["baseline_median_ms"]
    assert "does not beat" in res.tune_file_note and "does not beat" in caplog.text


def test_study_with_a_real_winner_writes_it_with_both_figures(tmp_path):
    obj = FakeObjective(PROBLEM, noise=0.01)
    res = run_study(obj, parse_space(SPACE), _opts(tmp_path, trials=8))
    cfg, meta = _entry(tmp_path)
    assert meta["outcome"] == "tuned" and cfg.to_dict() == res.confirmation["winner_config"]
    conf = meta["confirm"]
    assert conf["faster"] and conf["rounds"] == 4
    assert meta["latency_ms"] == conf["winner_median_ms"] < conf["baseline_median_ms"]
    assert meta["default_latency_ms"] == conf["baseline_median_ms"]
    assert meta["default_config"] == conf["baseline_config"] != meta["config"]
    # The winner is timed in the same worker as the trials: within the noise of its true value.
    assert meta["latency_ms"] == pytest.approx(fake_latency_ms(cfg, PROBLEM), rel=0.011)
    assert meta["trial_latency_ms"] == pytest.approx(fake_latency_ms(cfg, PROBLEM), rel=0.011)
