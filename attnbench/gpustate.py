"""The GPU's state at measurement time, through NVML (`pynvml`, package `nvidia-ml-py`).

`GpuMonitor.sample()` reads the SM and memory clocks, the temperature and the power draw of the
GPU the run measures on; `other_processes()` lists the compute processes NVML sees on it besides
this one. Nothing here may fail a run: without pynvml, without a driver, on a CPU or when a
query fails, samples are NaN and the process list is empty. The NVML module is a constructor
argument so that tests pass a fake.

NVML numbers its devices in PCI order and ignores CUDA_VISIBLE_DEVICES, so the device is found
by the UUID torch reports for the CUDA device in use, and by index only when that fails.
NVML may report host process ids inside a container, so our own process can show up under
another pid once it holds the GPU: take `other_processes()` before the first CUDA allocation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

NAN = math.nan


@dataclass(frozen=True)
class GpuState:
    sm_clock_mhz: float = NAN
    mem_clock_mhz: float = NAN
    gpu_temp_c: float = NAN
    gpu_power_w: float = NAN

    def columns(self) -> dict[str, float]:
        """The result-row columns (schema version 2)."""
        return {"sm_clock_mhz": self.sm_clock_mhz, "mem_clock_mhz": self.mem_clock_mhz,
                "gpu_temp_c": self.gpu_temp_c, "gpu_power_w": self.gpu_power_w}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mb: float


def _load_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuMonitor:
    """NVML queries for one CUDA device; every method degrades to NaN / [] on failure."""

    def __init__(self, cuda_index: int | None, *, uuid: str | None = None,
                 nvml: Any | None = None) -> None:
        """`cuda_index` None: no GPU (a CPU run); `uuid`: torch's UUID of that device."""
        self.nvml = None
        self.handle = None
        self.error = ""  # why there are no samples, for one line of log
        if cuda_index is None:
            return
        nvml = nvml if nvml is not None else _load_pynvml()
        if nvml is None:
            self.error = "pynvml is not installed (pip install nvidia-ml-py)"
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVML must never stop a run
            self.error = f"NVML unavailable: {exc}"
            return
        self.nvml = nvml
        self.handle = self._handle(cuda_index, uuid)

    def _handle(self, cuda_index: int, uuid: str | None):
        nvml = self.nvml
        if uuid:
            name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            try:
                return nvml.nvmlDeviceGetHandleByUUID(name)
            except Exception:  # noqa: BLE001 - fall back on the index
                pass
        try:
            return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
        except Exception as exc:  # noqa: BLE001
            self.error = f"NVML has no device {cuda_index}: {exc}"
            return None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def _query(self, fn_name: str, *args) -> float:
        try:
            return float(getattr(self.nvml, fn_name)(self.handle, *args))
        except Exception:  # noqa: BLE001 - one failed query is one NaN
            return NAN

    def sample(self) -> GpuState:
        """Clocks (MHz), temperature (C) and power (W) now; NaN where unknown."""
        if not self.available:
            return GpuState()
        nv = self.nvml
        return GpuState(
            sm_clock_mhz=self._query("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM),
            mem_clock_mhz=self._query("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM),
            gpu_temp_c=self._query("nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU),
            gpu_power_w=self._query("nvmlDeviceGetPowerUsage") / 1000.0,  # reported in mW
        )

    def other_processes(self, own_pid: int | None = None) -> list[GpuProcess]:
        """Compute processes on the device other than `own_pid` (default: this process)."""
        if not self.available:
            return []
        own = os.getpid() if own_pid is None else own_pid
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # noqa: BLE001
            return []
        out = []
        for p in procs:
            pid = int(getattr(p, "pid", -1))
            if pid == own:
                continue
            used = getattr(p, "usedGpuMemory", None)
            out.append(GpuProcess(pid, self._process_name(pid),
                                  used / 2**20 if isinstance(used, int) else NAN))
        return out

    def _process_name(self, pid: int) -> str:
        try:
            name = self.nvml.nvmlSystemGetProcessName(pid)
        except Exception:  # noqa: BLE001
            return "?"
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def busy_warning(self) -> str | None:
        """One line when another process holds the GPU (its timings would be shared), or None."""
        others = self.other_processes()
        if not others:
            return None
        listed = ", ".join(
            f"pid {p.pid} {os.path.basename(p.name)}"
            + (f" ({p.used_mb:.0f} MiB)" if math.isfinite(p.used_mb) else "")
            for p in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        return (f"warning: {len(others)} other process(es) hold the GPU ({listed}{more}); "
                "timings may be shared with them")

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nvml = self.handle = None


def monitor_for(device_type: str) -> GpuMonitor:
    """The monitor of the current CUDA device for a CUDA run; an empty one otherwise."""
    if device_type != "cuda":
        return GpuMonitor(None)
    import torch

    index = torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - older torch: find it by index
        uuid = None
    return GpuMonitor(index, uuid=uuid)
