"""A small stand-in for the ``pynvml`` functions the NVML sampler calls, behaving as the
real library does where it matters.

Same names, same arguments, and the real error classes and constants of the installed
pynvml (``pynvml.NVMLError(code)`` builds the real subclass; any ``NVML_*`` name, error
class or ctypes structure not defined here is pynvml's own), so the sampler's except
clauses run for real. Per GPU a test sets values, calls that raise ``NotSupported``,
errors for good or a few times (``UNKNOWN`` that passes), calls that raise pynvml's
``NVMLLibraryMismatchError``, calls that hang until ``release`` is set or are slow, a GPU
that is lost; memory with a reserved part that v1 counts as used and v2 does not; an
energy counter that grows with real time in 100 ms steps (or stays constant); MIG
instances (``MIG-…`` UUIDs, whose power and utilization calls are not supported);
utilization and power that follow a busy timeline on the monotonic clock (the GPU's time,
not the host's), utilization as the driver samples it (``nvmlDeviceGetSamples``: one
sample per UTIL_WINDOW_S, shorter than a sampling round; ``nvmlDeviceGetUtilizationRates``
gives only the last); process samples with any pids (another namespace's too).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from sidecar.resources.samplers.nvml import NvmlSampler, open_nvml

MIB = 1024 * 1024
ENERGY_STEP_S = 0.1  # NVML's energy counter moves about every 100 ms
UTIL_WINDOW_S = 1 / 6  # the driver's utilization window on a fast product
DRIVER_SAMPLES = 100  # utilization samples the driver keeps (nvmlDeviceGetSamples)
# Per call, the time a real driver takes (s), for ``FakeNvml(latency_s=...)``: about
# 20-25 µs for most calls through pynvml, far more for power and the process lists
# (docs/samplers.md). Assumed figures until the GPU pass measures them (bench/gpu_probe.py
# prints the real ones per call kind): a benchmark that uses them says so.
DRIVER_LATENCY_S = {
    "nvmlDeviceGetUtilizationRates": 25e-6,
    "nvmlDeviceGetSamples": 50e-6,
    "nvmlDeviceGetMemoryInfo": 25e-6,
    "nvmlDeviceGetTotalEnergyConsumption": 25e-6,
    "nvmlDeviceGetFieldValues": 500e-6,
    "nvmlDeviceGetPowerUsage": 500e-6,
    "nvmlDeviceGetTemperature": 25e-6,
    "nvmlDeviceGetClockInfo": 25e-6,
    "nvmlDeviceGetCurrentClocksEventReasons": 25e-6,
    "nvmlDeviceGetComputeRunningProcesses": 1e-3,
    "nvmlDeviceGetGraphicsRunningProcesses": 1e-3,
    "nvmlDeviceGetProcessUtilization": 1e-3,
    "nvmlGpmSampleGet": 500e-6,
}


@dataclass
class FakeGpu:
    """One device. Byte and milli- units as NVML returns them."""

    uuid: str
    name: str = "NVIDIA Fake"
    util: int = 50
    mem_util: int = 20
    mem_used: int = 1000 * MIB  # what processes use, reserved memory left out
    mem_reserved: int = 0  # held by the driver: v1 counts it as used, v2 does not
    mem_total: int = 8000 * MIB
    memory_v2: bool = True  # False: an old driver without nvmlDeviceGetMemoryInfo_v2
    power_instant_mw: int | None = 250_000  # None: the field answers NOT_SUPPORTED
    power_value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    power_avg_mw: int = 200_000  # also the power the energy counter integrates
    energy_mj: int = 5_000_000
    energy_constant: bool = False  # a counter that never moves
    # the counter as a function of the monotonic clock (s -> mJ): the same for every
    # process that reads it, as a driver's counter is between two jobs
    energy_at: Callable[[float], float] | None = None
    temperature: int = 60
    sm_clock: int = 1400
    throttle_reasons: int = 0  # nvmlClocksEventReason* bits
    gpm: bool = False
    gpm_sm_util: float = 33.0
    compute_procs: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)
    graphics_procs: list[tuple[int, int]] = field(default_factory=list)
    proc_samples: list[tuple[int, int, int]] = field(default_factory=list)  # pid, µs, sm %
    unsupported: set[str] = field(default_factory=set)  # function names -> NotSupported
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    flaky: Counter[str] = field(default_factory=Counter)  # function -> UNKNOWN this often
    mismatch: set[str] = field(default_factory=set)  # -> NVMLLibraryMismatchError
    hang: set[str] = field(default_factory=set)  # function names that block until release
    slow: dict[str, float] = field(default_factory=dict)  # function name -> seconds
    lost: bool = False  # every call on the device raises GpuIsLost
    # busy intervals (monotonic ns) of the GPU's own timeline: when set, utilization is
    # the busy share of the driver window before the call, and power (and the energy
    # counter) busy_mw while busy, idle_mw otherwise
    busy: list[tuple[int, int]] | None = None
    busy_util: tuple[int, int] = (0, 100)  # utilization when idle, when busy the window
    busy_mw: int = 300_000
    idle_mw: int = 80_000
    mig: list[FakeGpu] = field(default_factory=list, compare=False, repr=False)
    parent: FakeGpu | None = field(default=None, compare=False, repr=False)  # of a MIG one
    _energy_from: float | None = None  # monotonic s the counter last counted from

    def busy_share(self, t0_ns: int, t1_ns: int) -> float:
        busy = sum(max(0, min(e, t1_ns) - max(s, t0_ns)) for s, e in self.busy or ())
        return busy / max(1, t1_ns - t0_ns)

    def energy_now(self, now_s: float) -> int:
        """The counter at ``now_s`` (monotonic s): grows by the power over time, in
        ENERGY_STEP_S steps."""
        now = now_s // ENERGY_STEP_S * ENERGY_STEP_S
        if self.energy_at is not None:
            return int(self.energy_at(now))
        if self._energy_from is None or self.energy_constant:
            self._energy_from = now
            return self.energy_mj
        t0, t1 = int(self._energy_from * 1e9), int(now * 1e9)
        if self.busy is None:
            self.energy_mj += round(self.power_avg_mw * (t1 - t0) / 1e9)
        else:
            share = self.busy_share(t0, t1)
            self.energy_mj += round(
                (share * self.busy_mw + (1 - share) * self.idle_mw) * (t1 - t0) / 1e9
            )
        self._energy_from = now
        return self.energy_mj


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

    def __init__(
        self,
        gpus: list[FakeGpu],
        init_error: int | None = None,
        init_hang: bool = False,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        latency_s: dict[str, float] | None = None,
        serialised: bool = True,
    ) -> None:
        """``latency_s``: per function name, how long each call takes (s; e.g.
        ``DRIVER_LATENCY_S``), on every GPU; with ``serialised`` the calls of all GPUs
        take turns, as they do in the driver."""
        self.latency_s = dict(latency_s or {})
        self._driver = threading.Lock() if serialised else None
        self.gpus = gpus
        self.clock_ns = clock_ns  # the busy timelines' and the energy counter's clock
        self._util_seen: dict[str, list[tuple[int, int]]] = {}  # uuid: (clock ns, util)
        # A driver stamps each sample once: the wall clock's offset is read once, so a
        # sample read twice keeps its stamp (re-reading it per call moved a sample seen
        # already past ``last_seen_us`` when the thread was preempted between the reads).
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()
        for gpu in gpus:
            for instance in gpu.mig:
                instance.parent = gpu
        self.init_error = init_error
        self.init_hang = init_hang
        self.release = threading.Event()
        self.calls: Counter[tuple[str, str | None]] = Counter()  # (function, uuid)
        self.initialised = False

    def __getattr__(self, name: str) -> Any:
        """pynvml's own constants, error classes and structures."""
        if name.startswith(("NVML", "nvmlMemory", "c_nvml")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # -- helpers ---------------------------------------------------------------------

    def _enter(self, function: str, gpu: FakeGpu | None = None) -> None:
        self.calls[(function, gpu.uuid if gpu else None)] += 1
        if gpu is None:
            return
        if function in gpu.hang:
            self.release.wait(30)
        if function in gpu.slow:
            time.sleep(gpu.slow[function])
        self._take(self.latency_s.get(function, 0.0))
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in gpu.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if function in gpu.mismatch:
            raise pynvml.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match"
            )
        if gpu.flaky[function] > 0:
            gpu.flaky[function] -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        if function in gpu.errors:
            raise pynvml.NVMLError(gpu.errors[function])

    def _take(self, latency_s: float) -> None:
        """Spend ``latency_s`` in the "driver" (its lock held when serialised) with the GIL
        released, as ctypes releases it: the bulk asleep; the last 150 µs spinning, since
        a sleep overshoots by about that much, on ``sleep(0)``, which lets the other
        threads run (a bare spin holds the GIL for up to the 5 ms switch interval and
        stalls the sidecar's loop as no real driver call does)."""
        if latency_s <= 0:
            return
        with self._driver or contextlib.nullcontext():
            end = time.perf_counter() + latency_s
            if latency_s > 150e-6:
                time.sleep(latency_s - 150e-6)
            while time.perf_counter() < end:
                time.sleep(0)

    def _whole_only(self, function: str, gpu: FakeGpu) -> None:
        """A whole-GPU call on a MIG instance: NOT_SUPPORTED, as NVML answers."""
        self._enter(function, gpu)
        if gpu.parent is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

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

    # -- MIG -------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> tuple[int, int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if handle.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return mode, mode

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if index >= len(handle.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return handle.mig[index]

    # -- device ----------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> SimpleNamespace:
        self._whole_only("nvmlDeviceGetUtilizationRates", handle)
        util = handle.util
        if handle.busy is not None:
            now = self.clock_ns()
            low, high = handle.busy_util
            util = round(
                low + (high - low) * handle.busy_share(now - int(UTIL_WINDOW_S * 1e9), now)
            )
        return SimpleNamespace(gpu=util, memory=handle.mem_util)

    def nvmlDeviceGetSamples(
        self, handle: FakeGpu, sampling_type: int, last_seen_us: int
    ) -> tuple[int, list[Any]]:
        """The driver's utilization samples: one every UTIL_WINDOW_S on the monotonic
        clock, each the utilization of the window before it, the last DRIVER_SAMPLES of
        them kept; timestamps in µs of the CPU's wall clock. NOT_FOUND when none is newer
        than ``last_seen_us``, as NVML answers."""
        self._whole_only("nvmlDeviceGetSamples", handle)
        if sampling_type != pynvml.NVML_GPU_UTILIZATION_SAMPLES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now_ns = self.clock_ns()
        wall_offset_ns = self._wall_offset_ns  # as the sampler converts back
        window_ns = int(UTIL_WINDOW_S * 1e9)
        last = now_ns // window_ns
        # A test sets ``util`` between reads: each read notes it, and a window reads what
        # was set at its middle, as a driver measures the window itself.
        history = self._util_seen.setdefault(handle.uuid, [])
        history.append((now_ns, handle.util))
        samples = []
        for k in range(last - DRIVER_SAMPLES + 1, last + 1):
            at_ns = k * window_ns
            stamp_us = (at_ns + wall_offset_ns) // 1000
            if stamp_us <= last_seen_us:
                continue
            middle_ns = at_ns - window_ns // 2
            util = next((value for seen_ns, value in history if seen_ns >= middle_ns), handle.util)
            if handle.busy is not None:
                low, high = handle.busy_util
                util = round(low + (high - low) * handle.busy_share(at_ns - window_ns, at_ns))
            samples.append(
                SimpleNamespace(timeStamp=stamp_us, sampleValue=SimpleNamespace(uiVal=util))
            )
        if not samples:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        if version is None:
            used = handle.mem_used + handle.mem_reserved
            return SimpleNamespace(total=handle.mem_total, used=used, free=handle.mem_total - used)
        if not handle.memory_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if version != pynvml.nvmlMemory_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=handle.mem_total,
            reserved=handle.mem_reserved,
            free=handle.mem_total - handle.mem_used - handle.mem_reserved,
            used=handle.mem_used,
        )

    def nvmlDeviceGetFieldValues(self, handle: FakeGpu, fieldIds: list[int]) -> Any:
        self._whole_only("nvmlDeviceGetFieldValues", handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field_id in zip(values, fieldIds, strict=True):
            value.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_POWER_INSTANT and handle.power_instant_mw is not None:
                value.valueType = handle.power_value_type
                value.value.uiVal = handle.power_instant_mw
                value.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        self._whole_only("nvmlDeviceGetPowerUsage", handle)
        return handle.power_avg_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeGpu) -> int:
        self._whole_only("nvmlDeviceGetTotalEnergyConsumption", handle)
        return handle.energy_now(self.clock_ns() / 1e9)

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        self._whole_only("nvmlDeviceGetTemperature", handle)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return handle.temperature

    def nvmlDeviceGetClockInfo(self, handle: FakeGpu, clock_type: int) -> int:
        self._whole_only("nvmlDeviceGetClockInfo", handle)
        assert clock_type == pynvml.NVML_CLOCK_SM
        return handle.sm_clock

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGpu) -> int:
        self._whole_only("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return handle.throttle_reasons

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.compute_procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in handle.graphics_procs]

    def nvmlDeviceGetProcessUtilization(self, handle: FakeGpu, timeStamp: int) -> list[Any]:
        """Samples newer than ``timeStamp``; NotFound when there are none, as NVML does."""
        self._whole_only("nvmlDeviceGetProcessUtilization", handle)
        samples = [
            pynvml.c_nvmlProcessUtilizationSample_t(pid=pid, timeStamp=ts, smUtil=sm)
            for pid, ts, sm in handle.proc_samples
            if ts > timeStamp
        ]
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


def periodic_busy(
    start_ns: int, seconds: float, period_s: float = 0.5, busy_s: float = 0.3
) -> list[tuple[int, int]]:
    """Busy intervals: the first ``busy_s`` of every ``period_s`` for ``seconds``."""
    period, busy = int(period_s * 1e9), int(busy_s * 1e9)
    first = start_ns - start_ns % period
    return [(t, t + busy) for t in range(first, start_ns + int(seconds * 1e9), period)]


def periodic_energy_mj(
    t_s: float,
    period_s: float = 0.5,
    busy_s: float = 0.3,
    busy_w: float = 300.0,
    idle_w: float = 80.0,
) -> float:
    """The energy counter of a GPU busy the first ``busy_s`` of every ``period_s`` of the
    monotonic clock since its origin (``periodic_busy``'s grid), in mJ."""
    busy_total_s = t_s // period_s * busy_s + min(t_s % period_s, busy_s)
    return 1000.0 * (idle_w * t_s + (busy_w - idle_w) * busy_total_s)


def two_busy_gpus(uuids: tuple[str, str] = ("GPU-0a0a0a0a", "GPU-1b1b1b1b")) -> FakeNvml:
    """Two GPUs busy in the first 300 ms of every 500 ms, reading 10 % idle and 90 % busy,
    their power 300 W busy and 80 W idle, and an energy counter that follows the same
    clock whoever reads it (as a driver's counter does between two jobs): the fake the test
    launcher plugs in with ``--fake-nvml two_busy_gpus``."""
    timeline = periodic_busy(time.monotonic_ns(), 3600.0)
    return FakeNvml(
        [
            FakeGpu(
                uuid=uuid,
                name=f"NVIDIA Fake {i}",
                busy=timeline,
                busy_util=(10, 90),
                energy_at=periodic_energy_mj,
            )
            for i, uuid in enumerate(uuids)
        ]
    )


def two_busy_gpus_elsewhere() -> FakeNvml:
    """``two_busy_gpus`` of another node: other devices, other UUIDs."""
    return two_busy_gpus(("GPU-7a7a7a7a", "GPU-8b8b8b8b"))


def hanging_gpu() -> FakeNvml:
    """One GPU whose utilization call blocks (30 s): a wedged driver in a sampling round."""
    return FakeNvml(
        [
            FakeGpu(
                uuid="GPU-2c2c2c2c",
                name="NVIDIA Fake Hanging",
                hang={"nvmlDeviceGetUtilizationRates"},
            )
        ]
    )


def gpu_without_energy() -> FakeNvml:
    """Two GPUs without GPM; the second one's energy counter answers NotSupported."""
    return FakeNvml(
        [
            FakeGpu(uuid="GPU-3d3d3d3d", name="NVIDIA Fake 0"),
            FakeGpu(
                uuid="GPU-4e4e4e4e",
                name="NVIDIA Fake 1",
                unsupported={"nvmlDeviceGetTotalEnergyConsumption"},
            ),
        ]
    )


def busy_and_idle_gpu() -> FakeNvml:
    """A GPU at 95 % utilization and one at 3 % (a job that holds a GPU it never uses)."""
    return FakeNvml(
        [
            FakeGpu(uuid="GPU-5f5f5f5f", name="NVIDIA Fake 0", util=95),
            FakeGpu(uuid="GPU-6a6a6a6a", name="NVIDIA Fake 1", util=3),
        ]
    )


def idle_full_gpu() -> FakeNvml:
    """One GPU 2 % busy with 7900 of its 8000 MiB used: the idle-GPU and memory-near-full
    alerts' stand-in (``--fake-nvml idle_full_gpu``)."""
    return FakeNvml(
        [
            FakeGpu(
                uuid="GPU-6f6f6f6f",
                name="NVIDIA Fake Idle",
                util=2,
                mem_used=7900 * MIB,
                mem_total=8000 * MIB,
            )
        ]
    )


RANK_GPUS = ("GPU-7a7a7a7a", "GPU-7b7b7b7b", "GPU-7c7c7c7c", "GPU-7d7d7d7d")


def rank_gpus_third_throttled() -> FakeNvml:
    """Four GPUs, one per rank of the multi-node tests' job (RANK_GPUS), at 1980 MHz,
    60 °C and 300 W, but the third (rank 2's) held at 900 MHz, 88 °C and 120 W by
    hardware slowdown and thermal slowdown; no energy counter, so power is the instant
    reading (``--fake-nvml rank_gpus_third_throttled``)."""
    gpus = [
        FakeGpu(
            uuid=uuid,
            name="NVIDIA Fake",
            sm_clock=1980,
            power_instant_mw=300_000,
            unsupported={"nvmlDeviceGetTotalEnergyConsumption"},
        )
        for uuid in RANK_GPUS
    ]
    throttled = gpus[2]
    throttled.sm_clock, throttled.temperature, throttled.power_instant_mw = 900, 88, 120_000
    throttled.throttle_reasons = (
        pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    )
    return FakeNvml(gpus)


def opened(fake: FakeNvml, visible: str | None = None, **kwargs: float) -> NvmlSampler:
    """``open_nvml`` on ``fake``, which must open. The expensive calls are made every round
    (``slow_period_s`` 0) unless given: the tests of their values sample a few rounds at
    made-up times; their period has its own test."""
    sampler = open_nvml(visible, api=fake, **{"slow_period_s": 0.0, **kwargs})
    assert isinstance(sampler, NvmlSampler), sampler
    return sampler
