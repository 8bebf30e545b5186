"""A small stand-in for the ``pynvml`` functions the NVML sampler calls.

Same names, same arguments, and the real error classes of the installed pynvml
(``pynvml.NVMLError(code)`` builds the real subclass), so the sampler's except clauses
run for real. Field values and process-utilization samples are the real ctypes
structures. Configure per GPU: values, calls that raise NotSupported, calls that hang
until ``release`` is set, a GPU that is lost from some point on; and for the library:
an nvmlInit error or hang.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

MIB = 1024 * 1024


@dataclass
class FakeGpu:
    """One device. Byte and milli- units as NVML returns them."""

    uuid: str
    name: str = "NVIDIA Fake"
    util: int = 50
    mem_util: int = 20
    mem_used: int = 1000 * MIB
    mem_total: int = 8000 * MIB
    power_instant_mw: int | None = 250_000  # None: the field answers NOT_SUPPORTED
    power_avg_mw: int = 200_000
    energy_mj: int = 5_000_000
    temperature: int = 60
    sm_clock: int = 1400
    gpm: bool = False
    gpm_sm_util: float = 33.0
    compute_procs: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)
    graphics_procs: list[tuple[int, int]] = field(default_factory=list)
    proc_samples: list[tuple[int, int, int]] = field(default_factory=list)  # pid, µs, sm %
    unsupported: set[str] = field(default_factory=set)  # function names -> NotSupported
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    hang: set[str] = field(default_factory=set)  # function names that block
    lost: bool = False  # every call on the device raises GpuIsLost


class GpmMetricsGet:
    """Plays pynvml.c_nvmlGpmMetricsGet_t (whose sample fields need real buffers)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=pynvml.NVML_SUCCESS, value=0.0)]


class FakeNvml:
    """Use an instance as the ``api`` argument of ``open_nvml``."""

    c_nvmlGpmMetricsGet_t = GpmMetricsGet
    # The names the sampler uses besides functions: the real classes and constants.
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_Unknown = pynvml.NVMLError_Unknown
    NVMLError_ResetRequired = pynvml.NVMLError_ResetRequired
    NVMLError_GpuNotFound = pynvml.NVMLError_GpuNotFound
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_FI_DEV_POWER_INSTANT = pynvml.NVML_FI_DEV_POWER_INSTANT
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None,
                 init_hang: bool = False) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.init_hang = init_hang
        self.release = threading.Event()
        self.calls: Counter[tuple[str, str | None]] = Counter()  # (function, uuid)
        self.initialised = False

    # -- helpers ---------------------------------------------------------------------

    def _enter(self, function: str, gpu: FakeGpu | None = None) -> None:
        self.calls[(function, gpu.uuid if gpu else None)] += 1
        if gpu is None:
            return
        if function in gpu.hang:
            self.release.wait(30)
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if function in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[function])

    def count(self, function: str, gpu: FakeGpu) -> int:
        """How often ``function`` was called for ``gpu``."""
        return self.calls[(function, gpu.uuid)]

    # -- library ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_hang:
            self.release.wait(30)
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    # -- device ----------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=handle.util, memory=handle.mem_util)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=handle.mem_total, used=handle.mem_used,
                               free=handle.mem_total - handle.mem_used)

    def nvmlDeviceGetFieldValues(self, handle: FakeGpu, fieldIds: list[int]) -> Any:
        self._enter("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field_id in zip(values, fieldIds, strict=True):
            value.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_POWER_INSTANT and handle.power_instant_mw is not None:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = handle.power_instant_mw
                value.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return handle.power_avg_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        return handle.energy_mj

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return handle.temperature

    def nvmlDeviceGetClockInfo(self, handle: FakeGpu, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", handle)
        assert clock_type == pynvml.NVML_CLOCK_SM
        return handle.sm_clock

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.compute_procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.graphics_procs]

    def nvmlDeviceGetProcessUtilization(self, handle: FakeGpu, timeStamp: int) -> list[Any]:
        """Samples newer than ``timeStamp``; NotFound when there are none, as NVML does."""
        self._enter("nvmlDeviceGetProcessUtilization", handle)
        samples = [pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=ts, smUtil=sm)
                   for pid, ts, sm in handle.proc_samples if ts > timeStamp]
        if not samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    # -- GPM -------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, handle: FakeGpu) -> SimpleNamespace:
        self._enter("nvmlGpmQueryDeviceSupport", handle)
        return SimpleNamespace(version=1, isSupportedDevice=int(handle.gpm))

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:
        self._enter("nvmlGpmSampleAlloc")
        return SimpleNamespace(taken_from=None)

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:
        self._enter("nvmlGpmSampleFree")

    def nvmlGpmSampleGet(self, handle: FakeGpu, sample: SimpleNamespace) -> SimpleNamespace:
        self._enter("nvmlGpmSampleGet", handle)
        sample.taken_from = handle
        return sample

    def nvmlGpmMetricsGet(self, request: GpmMetricsGet) -> GpmMetricsGet:
        self._enter("nvmlGpmMetricsGet")
        gpu = request.sample2.taken_from
        assert request.sample1 is not request.sample2 and request.sample1.taken_from is gpu
        assert request.metrics[0].metricId == pynvml.NVML_GPM_METRIC_SM_UTIL
        request.metrics[0].value = gpu.gpm_sm_util
        return request


def two_busy_gpus() -> FakeNvml:
    """Two GPUs whose utilization follows the clock (busy in the first 300 ms of every
    500 ms) and whose energy counter grows by 200 J per second of the host's monotonic
    clock, whoever reads it (as a driver's counter does between two jobs): the fake the
    test launcher plugs in with ``--fake-nvml two_busy_gpus``."""

    class ClockedGpu(FakeGpu):
        @property  # type: ignore[misc]
        def util(self) -> int:
            return 90 if time.monotonic() % 0.5 < 0.3 else 10

        @util.setter
        def util(self, _value: int) -> None:
            pass

        @property  # type: ignore[misc]
        def energy_mj(self) -> int:
            return int(time.monotonic() * 200_000)

        @energy_mj.setter
        def energy_mj(self, _value: int) -> None:
            pass

    return FakeNvml([ClockedGpu(uuid="GPU-0a0a0a0a", name="NVIDIA Fake 0"),
                     ClockedGpu(uuid="GPU-1b1b1b1b", name="NVIDIA Fake 1")])


def hanging_gpu() -> FakeNvml:
    """One GPU whose utilization call blocks (30 s): a wedged driver in a sampling round."""
    return FakeNvml([FakeGpu(uuid="GPU-2c2c2c2c", name="NVIDIA Fake Hanging",
                             hang={"nvmlDeviceGetUtilizationRates"})])


def gpu_without_energy() -> FakeNvml:
    """Two GPUs without GPM; the second one's energy counter answers NotSupported."""
    return FakeNvml([FakeGpu(uuid="GPU-3d3d3d3d", name="NVIDIA Fake 0"),
                     FakeGpu(uuid="GPU-4e4e4e4e", name="NVIDIA Fake 1",
                             unsupported={"nvmlDeviceGetTotalEnergyConsumption"})])
