"""attnbench.gpustate against a fake NVML module: values, units, failures that never raise."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

from attnbench.gpustate import GpuMonitor, monitor_for


class NVMLError(Exception):
    pass


class FakeNvml:
    """The part of pynvml the monitor uses; `broken` names the functions that raise."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, broken=(), procs=()):
        self.broken, self.procs = set(broken), list(procs)
        self.uuids_asked: list[str] = []
        self.shut = False

    def _maybe_fail(self, name):
        if name in self.broken:
            raise NVMLError(f"{name}: Not Supported")

    def nvmlInit(self):
        self._maybe_fail("nvmlInit")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.uuids_asked.append(uuid)
        self._maybe_fail("nvmlDeviceGetHandleByUUID")
        return ("handle", uuid)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._maybe_fail("nvmlDeviceGetHandleByIndex")
        return ("handle", index)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        self._maybe_fail("nvmlDeviceGetClockInfo")
        return {self.NVML_CLOCK_SM: 1980, self.NVML_CLOCK_MEM: 2619}[kind]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._maybe_fail("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 57

    def nvmlDeviceGetPowerUsage(self, handle):
        self._maybe_fail("nvmlDeviceGetPowerUsage")
        return 412_345  # milliwatts

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._maybe_fail("nvmlDeviceGetComputeRunningProcesses")
        return self.procs

    def nvmlSystemGetProcessName(self, pid):
        self._maybe_fail("nvmlSystemGetProcessName")
        return f"/usr/bin/python{pid}"


def test_sample_reads_clocks_temperature_and_watts():
    nv = FakeNvml()
    mon = GpuMonitor(0, uuid="8d3a-11", nvml=nv)
    state = mon.sample()
    assert state.columns() == {"sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0,
                               "gpu_temp_c": 57.0, "gpu_power_w": pytest.approx(412.345)}
    assert nv.uuids_asked == ["GPU-8d3a-11"]  # NVML spells torch's UUID with a prefix
    mon.close()
    assert nv.shut and not mon.available


def test_one_failing_query_is_one_nan():
    state = GpuMonitor(0, nvml=FakeNvml(broken={"nvmlDeviceGetPowerUsage"})).sample()
    assert math.isnan(state.gpu_power_w) and state.sm_clock_mhz == 1980.0


def test_uuid_lookup_failure_falls_back_on_the_index():
    mon = GpuMonitor(3, uuid="GPU-x", nvml=FakeNvml(broken={"nvmlDeviceGetHandleByUUID"}))
    assert mon.handle == ("handle", 3) and mon.sample().gpu_temp_c == 57.0


@pytest.mark.parametrize("broken", [{"nvmlInit"}, {"nvmlDeviceGetHandleByUUID",
                                                   "nvmlDeviceGetHandleByIndex"}])
def test_no_nvml_means_nan_and_no_processes(broken):
    mon = GpuMonitor(0, uuid="u", nvml=FakeNvml(broken=broken, procs=[
        SimpleNamespace(pid=1, usedGpuMemory=1)]))
    assert not mon.available and mon.error
    assert all(math.isnan(v) for v in mon.sample().columns().values())
    assert mon.other_processes() == [] and mon.busy_warning() is None


def test_cpu_monitor_is_empty():
    mon = monitor_for("cpu")
    assert not mon.available
    assert all(math.isnan(v) for v in mon.sample().columns().values())


def test_busy_warning_names_other_processes_not_ours():
    procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**30),
             SimpleNamespace(pid=4242, usedGpuMemory=3 * 2**30),
             SimpleNamespace(pid=77, usedGpuMemory=None)]
    mon = GpuMonitor(0, nvml=FakeNvml(procs=procs))
    others = mon.other_processes()
    assert [p.pid for p in others] == [4242, 77]
    assert others[0].used_mb == 3072 and math.isnan(others[1].used_mb)
    warning = mon.busy_warning()
    assert warning.count("\n") == 0 and "2 other process(es)" in warning
    assert "pid 4242 python4242 (3072 MiB)" in warning and "pid 77 python77" in warning
    assert f"pid {os.getpid()} " not in warning


def test_process_listing_failure_is_no_warning():
    mon = GpuMonitor(0, nvml=FakeNvml(broken={"nvmlDeviceGetComputeRunningProcesses"}))
    assert mon.busy_warning() is None
