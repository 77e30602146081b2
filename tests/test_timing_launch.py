"""The timed loop on a simulated GPU queue: host launch overhead must not be timed."""

from __future__ import annotations

import pytest

from attnbench.timing import Stream, hold_ms, launch_ms, measure


class SimQueue:
    """One in-order GPU queue fed by a host: an operation issued at host time h starts on the
    GPU at max(h, end of the previous operation). Times in milliseconds."""

    def __init__(self) -> None:
        self.host = 0.0
        self.gpu_free = 0.0
        self.log: list[str] = []

    def kernel(self, gpu_ms: float, host_ms: float = 0.005, name: str = "kernel") -> None:
        self.host += host_ms
        self.gpu_free = max(self.host, self.gpu_free) + gpu_ms
        self.log.append(name)

    def event(self) -> SimEvent:
        return SimEvent(self)

    def stream(self) -> Stream:
        return Stream(event=self.event, spin=lambda ms: self.kernel(ms, name="spin"),
                      sync=self.sync, host_clock=lambda: self.host / 1e3)

    def sync(self) -> None:
        self.host = max(self.host, self.gpu_free)


class SimEvent:
    def __init__(self, q: SimQueue) -> None:
        self.q, self.at = q, None

    def record(self) -> None:
        self.q.host += 0.002
        self.at = max(self.q.host, self.q.gpu_free)  # reached once the queue before it is done
        self.q.log.append("event")

    def elapsed_time(self, end: SimEvent) -> float:
        return end.at - self.at


def python_call(q: SimQueue, host_ms: float, gpu_ms: float):
    """A call that spends `host_ms` in Python before launching a `gpu_ms` kernel."""
    def fn():
        q.kernel(gpu_ms, host_ms=host_ms, name="call")
    return fn


@pytest.mark.parametrize("flushed", [True, False])
@pytest.mark.parametrize("host,gpu", [(0.10, 0.15), (0.30, 0.15), (0.02, 2.0)])
def test_launch_overhead_is_not_timed(host, gpu, flushed):
    q = SimQueue()
    flush = (lambda: q.kernel(0.03, name="flush")) if flushed else None
    t = measure(python_call(q, host, gpu), device="cuda", repeats=10, warmup=2, warmup_ms=0.0,
                flush=flush, stream=q.stream())
    assert t.median_ms == pytest.approx(gpu, abs=1e-9)
    assert t.spread_ms == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("flushed", [True, False])
def test_without_the_hold_the_overhead_would_be_timed(flushed):
    """The simulation reproduces the failure the hold exists for (so the test above can fail):
    0.3 ms of Python behind a 0.15 ms kernel, the queue drains during each launch."""
    q = SimQueue()
    s = q.stream()
    no_hold = Stream(event=s.event, spin=lambda ms: None, sync=s.sync, host_clock=s.host_clock)
    flush = (lambda: q.kernel(0.03, name="flush")) if flushed else None
    t = measure(python_call(q, 0.30, 0.15), device="cuda", repeats=10, warmup=2, warmup_ms=0.0,
                flush=flush, stream=no_hold)
    assert t.median_ms > 0.25


def test_one_spin_then_the_repetitions_back_to_back():
    q = SimQueue()
    measure(python_call(q, 0.1, 0.1), device="cuda", repeats=3, warmup=0, warmup_ms=0.0,
            flush=lambda: q.kernel(0.03, name="flush"), stream=q.stream())
    timed = q.log[q.log.index("spin"):]
    assert timed == ["spin"] + ["flush", "event", "call", "event"] * 3


def test_hold_covers_twice_the_launch_of_every_repetition_and_is_capped():
    q = SimQueue()
    assert launch_ms(python_call(q, 0.25, 1.0), q.stream()) == pytest.approx(0.25)
    assert hold_ms(0.25, repeats=30) == pytest.approx(15.1)
    assert hold_ms(500.0, repeats=30) == 200.0
