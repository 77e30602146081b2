"""Noisy measurements re-taken (fake timers), per-mode capabilities, NVML columns in rows."""

from __future__ import annotations

import math

import pytest

from attnbench.gpustate import GpuState
from attnbench.impls import Impl, Unsupported
from attnbench.impls.base import GRAD_MODES
from attnbench.results.read import read_results
from attnbench.suites import parse_suite
from attnbench.timing import NoisePolicy, Timing, measure, measure_steady, summarize, warm_up
from tests.test_runner import FakeImpl, small_suite
from tests.test_runner import make_runner as _make_runner


def make_runner(suite, impls, variants, tmp_path, **kw):
    """test_runner's, with the noise rule at the suite's or default threshold."""
    kw.setdefault("noise_threshold", None)
    return _make_runner(suite, impls, variants, tmp_path, **kw)


def timing(median: float, spread: float) -> Timing:
    return Timing(median, spread, 30, (median,))


class FakeTimer:
    """Stands in for attnbench.timing.measure: hands out the given timings in turn (the last
    one again when they run out) and counts the calls; the timed function is never called."""

    def __init__(self, *timings: Timing) -> None:
        self.timings, self.calls = list(timings), 0

    def __call__(self, fn, *, device, repeats, warmup, flush=None) -> Timing:
        self.calls += 1
        return self.timings[min(self.calls, len(self.timings)) - 1]


# ---------------------------------------------------------------------- the rule itself
def test_noisy_then_quiet_keeps_the_quiet_attempt():
    pauses: list[float] = []
    timer = iter([timing(1.0, 0.30), timing(0.9, 0.009)])
    got = measure_steady(lambda: next(timer), NoisePolicy(0.05, 3, 0.7), sleep=pauses.append)
    assert (got.attempts, got.noisy) == (2, False)
    assert got.timing.median_ms == 0.9 and pauses == [0.7]


def test_always_noisy_keeps_the_tightest_of_all_attempts():
    pauses: list[float] = []
    timer = iter([timing(1.0, 0.30), timing(1.1, 0.11), timing(1.2, 0.24)])
    got = measure_steady(lambda: next(timer), NoisePolicy(0.05, 3, 1.0), sleep=pauses.append)
    assert (got.attempts, got.noisy) == (3, True)
    assert got.timing.median_ms == 1.1 and pauses == [1.0, 1.0]


def test_quiet_first_attempt_is_not_repeated():
    calls = []
    got = measure_steady(lambda: calls.append(1) or timing(2.0, 0.02), NoisePolicy(),
                         sleep=pytest.fail)
    assert (got.attempts, got.noisy, len(calls)) == (1, False, 1)


def test_relative_spread_and_policy_checks():
    assert summarize([1.0, 2.0, 3.0, 4.0, 5.0]).relative_spread == pytest.approx(2 / 3)
    assert timing(0.0, 0.0).relative_spread == math.inf
    for bad in (dict(threshold=0), dict(threshold=math.nan), dict(attempts=0),
                dict(pause_s=-1.0)):
        with pytest.raises(ValueError):
            NoisePolicy(**bad)


# ---------------------------------------------------------------------- through the runner
def test_runner_re_measures_a_noisy_row(variants, tmp_path):
    impls = {"base": FakeImpl("base")}
    timer = FakeTimer(timing(1.0, 0.4), timing(0.8, 0.004))
    runner = make_runner(small_suite(impls, "base", modes=("fwd",), variants=("softmax",)),
                         impls, variants, tmp_path, measure=timer)
    (row,) = runner.run().rows
    assert (row["status"], row["attempts"], timer.calls) == ("ok", 2, 2)
    assert row["latency_ms"] == 0.8 and row["latency_spread_ms"] == 0.004
    assert row["tflops"] == pytest.approx(row["flops"] / 0.8e-3 / 1e12)


def test_runner_marks_a_row_noisy_after_every_attempt(variants, tmp_path):
    impls = {"base": FakeImpl("base"), "other": FakeImpl("other")}
    timer = FakeTimer(timing(1.0, 0.3), timing(1.0, 0.2), timing(1.0, 0.25),  # base
                      timing(0.5, 0.001))  # other: quiet
    runner = make_runner(small_suite(impls, "base", modes=("fwd",), variants=("softmax",)),
                         impls, variants, tmp_path, measure=timer)
    rows = {r["impl"]: r for r in runner.run().rows}
    base = rows["base"]
    assert (base["status"], base["attempts"]) == ("noisy", 3)
    assert base["latency_spread_ms"] == 0.2 and "20.0%" in base["reason"]
    assert (rows["other"]["status"], rows["other"]["attempts"]) == ("ok", 1)
    assert rows["other"]["speedup"] == pytest.approx(2.0)  # against the noisy baseline's
    back = read_results(runner.path).set_index("impl")
    assert back.loc["base", "status"] == "noisy" and back.loc["base", "attempts"] == 3
    assert back.loc["base", "latency_ms"] == 1.0


def test_threshold_from_option_then_suite(variants, tmp_path):
    impls = {"base": FakeImpl("base")}
    noisy = timing(1.0, 0.08)  # 8%: noisy at the default 5%, fine at 10%
    data = {"impls": ["base"], "modes": ["fwd"], "dtypes": ["float32"], "repeats": 3,
            "warmup": 0, "noise_threshold": 0.1,
            "cases": [{"variants": ["softmax"], "shapes": ["smoke-gqa"], "seqlens": [32]}]}
    suite = parse_suite(data, name="unit", variant_names=["softmax"], impl_names=["base"])
    row = make_runner(suite, impls, variants, tmp_path, measure=FakeTimer(noisy)).run().rows[0]
    assert (row["status"], row["attempts"]) == ("ok", 1)
    row = make_runner(suite, impls, variants, tmp_path / "b", measure=FakeTimer(noisy),
                      noise_threshold=0.05, attempts=2).run().rows[0]
    assert (row["status"], row["attempts"]) == ("noisy", 2)


def test_unmeasured_rows_have_no_attempts(variants, tmp_path):
    impls = {"base": FakeImpl("base"), "boom": FakeImpl("boom", "crash"),
             "nope": FakeImpl("nope", "unsupported")}
    rows = _make_runner(small_suite(impls, "base", modes=("fwd",), variants=("softmax",)),
                       impls, variants, tmp_path).run().rows
    assert {r["impl"]: r["attempts"] for r in rows}["boom"] == 0
    assert {r["impl"]: r["attempts"] for r in rows}["nope"] == 0
    assert all(math.isnan(r["sm_clock_mhz"]) for r in rows)  # a CPU run: no NVML


class FixedMonitor:
    def __init__(self) -> None:
        self.samples = 0

    def sample(self) -> GpuState:
        self.samples += 1
        return GpuState(1755.0, 2619.0, 41.0 + self.samples, 312.5)


def test_rows_carry_the_gpu_state_sampled_after_each_measurement(variants, tmp_path):
    impls = {"base": FakeImpl("base")}
    mon = FixedMonitor()
    runner = make_runner(small_suite(impls, "base", variants=("softmax",)), impls, variants,
                         tmp_path, monitor=mon)
    rows = runner.run().rows
    assert mon.samples == 2
    assert [r["gpu_temp_c"] for r in rows] == [42.0, 43.0]
    assert rows[0]["sm_clock_mhz"] == 1755.0 and rows[1]["gpu_power_w"] == 312.5
    back = read_results(runner.path)
    assert back["mem_clock_mhz"].tolist() == [2619.0, 2619.0]


# ---------------------------------------------------------------------- per-mode capabilities
class ForwardOnly(FakeImpl):
    """Like the engine at D = 256: the forward runs, the backward has no kernel."""

    def __init__(self, name):
        super().__init__(name)
        self.grad_asks: list[bool] = []

    def prepare(self, case, variant, inputs, needs_grad):
        self.grad_asks.append(needs_grad)
        if needs_grad:
            raise Unsupported("no valid backward kernel config for head dims D=256",
                              modes=GRAD_MODES)
        return super().prepare(case, variant, inputs, needs_grad)


def test_a_backward_refusal_skips_only_the_backward_modes(variants, tmp_path):
    impls = {"base": FakeImpl("base"), "fwdonly": ForwardOnly("fwdonly")}
    rows = _make_runner(small_suite(impls, "base", modes=("fwd", "bwd", "fwd+bwd"),
                                   variants=("softmax",)), impls, variants, tmp_path).run().rows
    got = {r["mode"]: r for r in rows if r["impl"] == "fwdonly"}
    assert got["fwd"]["status"] == "ok" and got["fwd"]["latency_ms"] > 0
    for mode in ("bwd", "fwd+bwd"):
        assert got[mode]["status"] == "skipped"
        assert "no valid backward kernel config" in got[mode]["reason"]
    assert impls["fwdonly"].grad_asks == [True, False]


def test_an_unsupported_without_modes_still_skips_every_mode(variants, tmp_path):
    impls = {"base": FakeImpl("base"), "nope": FakeImpl("nope", "unsupported")}
    rows = _make_runner(small_suite(impls, "base", variants=("softmax",)), impls, variants,
                       tmp_path).run().rows
    assert [r["status"] for r in rows if r["impl"] == "nope"] == ["skipped", "skipped"]
    assert impls["nope"].calls == 1


class NoBackwardForLongRows(FakeImpl):
    """A per-mode rule known before any tensor: check_modes overridden."""

    def check_modes(self, case, variant, device):
        out = super().check_modes(case, variant, device)
        return {m: r or ("no backward here" if m != "fwd" else None) for m, r in out.items()}


def test_check_modes_plans_per_mode_and_dry_run_summary(variants, tmp_path):
    impls = {"base": FakeImpl("base"), "half": NoBackwardForLongRows("half")}
    runner = _make_runner(small_suite(impls, "base", variants=("softmax",)), impls, variants,
                         tmp_path)
    assert runner.plan(runner.suite.cases[0])["half"] == {"fwd": None, "bwd": "no backward here"}
    assert runner.skip_summary() == [("half", "no backward here", 1, 2)]
    assert runner.measurements(runner.suite.cases[0]) == 3
    rows = {(r["impl"], r["mode"]): r for r in runner.run().rows}
    assert rows[("half", "fwd")]["status"] == "ok"
    assert rows[("half", "bwd")]["reason"] == "no backward here"


def test_engine_refuses_its_missing_backward_per_mode(variants, monkeypatch):
    """The engine's own prepare where the module has no backward kernel (every head dim has
    one now, so the module says so here): the refusal names the backward modes only."""
    import torch

    from attnbench.impls import get_impl
    from engine.api import AttentionEngine
    from tests.test_impls import case

    if "softmax" not in variants or not hasattr(variants["softmax"], "spec_parts"):
        pytest.skip("needs the engine's variants")
    c = case(dtype="bfloat16", head_dim=128, head_dim_v=128, heads_q=2, heads_kv=2,
             modes=("fwd", "bwd"))
    v = variants["softmax"]
    inputs = v.make_inputs(batch=1, heads_q=2, heads_kv=2, seqlen_q=128, seqlen_kv=128,
                           head_dim=128, head_dim_v=128, dtype=torch.bfloat16)
    engine = get_impl("engine")
    if "bwd" not in engine.caps.modes:
        pytest.skip("kernel backward switched off (ATTNBENCH_KERNEL_BACKWARD=0)")
    monkeypatch.setattr(AttentionEngine, "backward_problem",
                        lambda self, custom_grads=(): "no valid backward kernel config")
    with pytest.raises(Unsupported, match="backward kernel config") as err:
        engine.prepare(c, v, inputs, needs_grad=True)
    assert err.value.modes == GRAD_MODES and not err.value.rules_out("fwd")
    assert engine.prepare(c, v, inputs, needs_grad=False).forward is not None


def test_impl_check_modes_default_combines_case_and_mode_reasons():
    from attnbench.impls import Capabilities, DeviceInfo
    from tests.test_impls import case

    class Fwd(Impl):
        caps = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                            modes=frozenset({"fwd"}))

    c = case(modes=("fwd", "bwd"))
    got = Fwd().check_modes(c, None, DeviceInfo("cpu"))
    assert got["fwd"] is None and "mode bwd not supported" in got["bwd"]
    assert set(Fwd().check_modes(c, None, DeviceInfo("cuda")).values()) == {"runs on ['cpu']"}


def test_prepare_on_a_gpu_warns_once_when_another_process_holds_it(variants, tmp_path,
                                                                   monkeypatch):
    """The CUDA branch of Runner.prepare with NVML and the L2 flusher faked."""
    import attnbench.runner
    from attnbench.gpustate import GpuMonitor
    from attnbench.impls import DeviceInfo
    from tests.test_gpustate import FakeNvml

    class Proc:
        pid, usedGpuMemory = 999_999, 2**30

    monkeypatch.setattr(attnbench.runner, "L2Flusher", lambda device: "flusher")
    impls = {"base": FakeImpl("base")}
    logged: list[str] = []
    runner = _make_runner(small_suite(impls, "base", variants=("softmax",)), impls, variants,
                          tmp_path, monitor=GpuMonitor(0, nvml=FakeNvml(procs=[Proc()])))
    runner.log = logged.append
    runner.device = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    notes = runner.prepare()
    assert len(notes) == 1 and "pid 999999" in notes[0] and "1024 MiB" in notes[0]
    assert runner._flusher == "flusher" and runner.prepare() == []
    runner.device = DeviceInfo("cpu")  # measure on the CPU from here
    list(runner.iter_cases())
    assert logged == []  # prepared once: the warning is not repeated


def test_prepare_says_when_nvml_is_missing_on_a_gpu(variants, tmp_path, monkeypatch):
    import attnbench.runner
    from attnbench.gpustate import GpuMonitor
    from attnbench.impls import DeviceInfo
    from tests.test_gpustate import FakeNvml

    monkeypatch.setattr(attnbench.runner, "L2Flusher", lambda device: None)
    impls = {"base": FakeImpl("base")}
    runner = _make_runner(small_suite(impls, "base", variants=("softmax",)), impls, variants,
                          tmp_path, monitor=GpuMonitor(0, nvml=FakeNvml(broken={"nvmlInit"})))
    runner.device = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
    (note,) = runner.prepare()
    assert note.startswith("no GPU clocks/temperature/power in the rows: NVML unavailable")


@pytest.mark.parametrize("bad", [0, -0.1, "5%", True, float("nan")])
def test_suite_noise_threshold_must_be_a_positive_number(bad):
    from attnbench.suites import SuiteError

    data = {"impls": ["base"], "modes": ["fwd"], "dtypes": ["float32"], "noise_threshold": bad,
            "cases": [{"variants": ["softmax"], "shapes": ["smoke-gqa"], "seqlens": [32]}]}
    with pytest.raises(SuiteError, match="noise_threshold must be a number > 0"):
        parse_suite(data, name="unit", variant_names=["softmax"], impl_names=["base"])


class FakeDevice:
    """A device whose calls each take `call_ms` of a fake clock; `sync` is a no-op."""

    def __init__(self, call_ms: float) -> None:
        self.call_ms, self.now, self.calls = call_ms, 0.0, 0

    def fn(self) -> None:
        self.calls += 1
        self.now += self.call_ms / 1e3

    def clock(self) -> float:
        return self.now


@pytest.mark.parametrize("call_ms", [0.05, 0.6, 3.5, 400.0])
def test_warm_up_lasts_at_least_its_time_whatever_the_call_length(call_ms):
    dev = FakeDevice(call_ms)
    n = warm_up(dev.fn, calls=5, min_ms=200.0, sync=lambda: None, clock=dev.clock)
    assert n == dev.calls
    # the counted calls, then enough for 200 ms from the timed call on (one call over at most)
    assert (dev.calls - 5) * call_ms >= 200.0 or dev.calls == 6
    assert (dev.calls - 5) * call_ms < 200.0 + 2 * call_ms


def test_warm_up_by_count_only_when_no_time_is_asked():
    dev = FakeDevice(3.5)
    assert warm_up(dev.fn, calls=4, min_ms=0.0, sync=lambda: None, clock=dev.clock) == 4


def test_warm_up_is_capped_for_calls_too_short_to_time():
    dev = FakeDevice(0.0)
    n = warm_up(dev.fn, calls=0, min_ms=200.0, sync=lambda: None, clock=dev.clock)
    assert n == dev.calls <= 10_001


def test_measure_checks_warmup_ms_and_device_before_calling():
    calls = []
    with pytest.raises(ValueError, match="warmup_ms"):
        measure(lambda: calls.append(1), device="cpu", warmup_ms=-1.0)
    with pytest.raises(ValueError, match="device"):
        measure(lambda: calls.append(1), device="tpu")
    assert calls == []
