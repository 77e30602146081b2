"""Why a long kernel's timing is noisy: its repetitions timed back to back while a thread samples
the GPU's SM clock and power through NVML, for SDPA's cuDNN and flash back ends at the `paper`
suite's noisiest shape (B 1, S 16k, 32 heads, D 64, bf16, forward).

Usage (a CUDA GPU with pynvml): python scripts/clock_trace.py OUT.json
Prints one line per back end: repetition times (median, IQR, range) and, while they ran, power
against the enforced limit and the SM clock's range.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import pynvml
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnbench.timing import WARMUP_MS, summarize, warm_up

B, H, S, D, REPEATS = 1, 32, 16384, 64, 100
BACKENDS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


class Sampler(threading.Thread):
    """SM clock (MHz) and power (W) every `period_s` until stopped."""

    def __init__(self, handle, period_s: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.handle, self.period_s = handle, period_s
        self.samples: list[tuple[float, int, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            clock = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
            power = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            self.samples.append((time.perf_counter(), clock, power))
            time.sleep(self.period_s)

    def stop(self) -> list[tuple[float, int, float]]:
        self._done.set()
        self.join()
        return self.samples


def trace(backend: SDPBackend, handle) -> dict:
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    warm_up(fn, calls=3, min_ms=WARMUP_MS, sync=torch.cuda.synchronize)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(REPEATS)]
    sampler = Sampler(handle)
    sampler.start()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    samples = sampler.stop()
    times = [s.elapsed_time(e) for s, e in events]
    t = summarize(times)
    clocks, powers = [c for _, c, _ in samples], [p for _, _, p in samples]
    return {"median_ms": t.median_ms, "iqr_pct": 100 * t.relative_spread,
            "min_ms": min(times), "max_ms": max(times), "times_ms": times,
            "sm_clock_mhz": [min(clocks), statistics.median(clocks), max(clocks)],
            "power_w": [min(powers), statistics.median(powers), max(powers)],
            "nvml_samples": len(samples)}


def main(out: str) -> int:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    record = {"gpu": torch.cuda.get_device_name(), "power_limit_w": limit_w,
              "shape": {"batch": B, "heads": H, "seqlen": S, "head_dim": D}, "traces": {}}
    for name, backend in BACKENDS.items():
        r = trace(backend, handle)
        record["traces"][name] = r
        print(f"{name:11s} median {r['median_ms']:.3f} ms  IQR {r['iqr_pct']:.1f}%  "
              f"range {r['min_ms']:.3f}-{r['max_ms']:.3f} ms  power {r['power_w'][1]:.0f} W "
              f"(max {r['power_w'][2]:.0f} of {limit_w:.0f})  SM clock "
              f"{r['sm_clock_mhz'][0]}-{r['sm_clock_mhz'][2]} MHz", flush=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
