"""One sampling round of one GPU (or MIG instance) through NVML, every call guarded.

Runs on the sampler's worker thread. Each call goes through ``GpuReader.read``: a failure
switches off or backs off that call for that GPU only (``nvml_guard``), or marks the GPU
lost, or, when the device stops answering, backs the whole GPU off; it never stops the
round. Which readings:

* memory: ``nvmlDeviceGetMemoryInfo`` with the v2 struct, whose ``used`` leaves out the
  memory the driver reserves (v1 counts it as used); v1 where v2 is not available.
* power: the mean over the window since the last round, ΔE/Δt of the energy counter
  (``source "energy"``), where the GPU has one and it moved; else the instant power
  field, else NVML's averaged power (point readings, said so in ``power_source``).
* utilization: ``nvmlDeviceGetUtilizationRates`` covers only the driver's last sample
  period (1/6 s to 1 s by product), not the round; ``nvmlDeviceGetSamples`` gives each
  driver sample since the last round with its timestamp, kept as ``util_windows`` for
  the per-phase attribution (``summary.attribute_phases``), and the round's ``util_pct``
  is their mean, each weighted by its period: the whole round as the driver saw it, so
  the run's mean (weighted by the rounds) is not the last period's of each round.
* MIG instances: memory, process lists and utilization of the instance; power, energy,
  temperature, SM clock and throttle reasons are the whole GPU's, shared with every other
  instance on it (``whole_gpu_uuid`` names that GPU).
* the job's processes: matched through every pid alias (``pids``); no new per-process
  sample (``NOT_FOUND``) is "no sample", not 0 %; pids of another namespace with none of
  the job's among them are "unknown", not 0.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.model.units import BYTES_PER_MIB
from sidecar.resources.samplers.nvml_guard import BadValue, CallGuard, classify
from sidecar.resources.samplers.pids import PidAliases

# nvmlValueType_t -> the member of the c_nvmlValue_t union that holds the value.
# The shortest energy window whose ΔE/Δt is a power: NVML's energy counter steps about
# every 100 ms (docs/samplers.md), so a shorter window holds one whole step or none.
MIN_ENERGY_WINDOW_NS = 150_000_000
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_NAMESPACE_NOTE = (
    "NVML reports pids of another pid namespace (a container?) and none of "
    "the job's: job figures unknown"
)


@dataclass(frozen=True)
class GpuSample:
    """One reading of one job GPU. A field is None where the GPU or driver does not
    support it. ``gpu_index`` is the position in the job's GPU list, not an NVML index."""

    t_ns: int
    gpu_index: int
    uuid: str
    name: str
    util_pct: float | None  # the driver samples' mean since the last round, where any
    mem_util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    power_w: float | None
    power_source: str | None  # "energy" (ΔE/Δt), "instant" or "average"
    energy_j: float | None  # counter since the driver was loaded
    temperature_c: float | None
    sm_clock_mhz: float | None
    sm_activity_pct: float | None  # GPM SM activity (Hopper+), not the utilization above
    job_mem_mib: float | None
    job_sm_util_pct: float | None
    # A MIG instance: the whole GPU whose power, energy, temperature and clock these are,
    # shared with its other instances. None for a whole GPU.
    whole_gpu_uuid: str | None = None
    # The driver's own utilization samples since the previous round, each over its own
    # sample period: (start_ns, end_ns, %) on the monotonic clock. None where the driver
    # gives none (nvmlDeviceGetSamples unsupported or failing), or () when no new one:
    # then ``util_pct``, the driver's last period only, stands for the whole round.
    util_windows: tuple[tuple[int, int, float], ...] | None = None
    # NVML's clocks event (throttle) reasons bitmask at the round, the whole GPU's
    # (``sidecar.model.straggler_gpu.reason_names`` names the bits)
    throttle_reasons: int | None = None
    # The job's pids (our namespace) on this GPU's process lists this round; None when the
    # lists were not read. Which split uses the GPU, for a process on several GPUs.
    job_pids: tuple[int, ...] | None = None

    @property
    def mem_used_pct(self) -> float | None:
        """Memory used of the GPU's total, % (None when either is unknown): what
        InnerEye's MemUtil_Percent and the trackers' GPU memory percentages mean."""
        used, total = self.mem_used_mib, self.mem_total_mib
        return None if used is None or not total else used / total * 100


class GpuLost(Exception):
    """The GPU no longer answers for good: skip it."""


class GpuSilent(Exception):
    """The GPU did not answer this round: back it off and try again later."""


@dataclass
class Gpu:
    """What the sampler keeps per job GPU between rounds."""

    index: int
    uuid: str
    name: str
    handle: Any
    whole_handle: Any  # the handle of the whole GPU (itself, or a MIG instance's parent)
    whole_uuid: str | None  # set for a MIG instance
    proc_seen_us: int  # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization (µs, CPU clock)
    util_seen_us: int = 0  # lastSeenTimeStamp for nvmlDeviceGetSamples (µs, CPU clock)
    util_period_us: int = 0  # the driver's utilization sample period, from its spacing
    util_sampled: bool = False  # util_seen_us is a driver sample's (not the time added)
    guard: CallGuard = field(default_factory=CallGuard)
    lost: str | None = None
    power_source: str | None = None
    energy_at: tuple[int, float] | None = None  # (t_ns, mJ): where the energy window starts
    energy_power_w: float | None = None  # the last window's mean power from the counter
    gpm: list[Any] | None = None  # [previous, current] GPM sample buffers; None: no GPM
    gpm_primed: bool = False
    notes: dict[str, str] = field(default_factory=dict)  # figures unknown this round, why
    slow_at_ns: int | None = None  # the round that last made the expensive calls


class Cancelled(Exception):
    """The round was given up by the sampler (it timed out): stop touching the GPUs."""


class GpuReader:
    """Reads one GPU per call of ``sample``; ``calling`` names the call under way (for a
    caller that timed out waiting), ``cancel()`` makes the next call raise Cancelled (a
    thread that comes back from a slow call must not go on next to its successor)."""

    def __init__(self, api: Any, pids: PidAliases) -> None:
        self._api = api
        self._pids = pids
        self.calling: tuple[Gpu, str] | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def read(
        self,
        gpu: Gpu,
        call: str,
        fn: Callable[..., Any],
        *args: Any,
        round_no: int,
        whole: bool = False,
    ) -> Any:
        """``fn(handle, *args)`` (the whole GPU's handle with ``whole``), or None when the
        call is off or backing off for this GPU, or fails now. Raises GpuLost / GpuSilent
        when the device itself no longer answers."""
        if self._cancelled:
            raise Cancelled
        if not gpu.guard.allowed(call, round_no):
            return None
        self.calling = (gpu, call)
        try:
            value = fn(gpu.whole_handle if whole else gpu.handle, *args)
        except Exception as exc:
            self._failed(gpu, call, exc, round_no)
            return None
        finally:
            self.calling = None
        gpu.guard.succeeded(call)
        return value

    def _failed(self, gpu: Gpu, call: str, exc: Exception, round_no: int) -> None:
        api = self._api
        kind = classify(api, exc)
        reason = str(exc) or type(exc).__name__
        if kind == "lost":
            raise GpuLost(f"{call}: {reason}") from None
        if isinstance(exc, api.NVMLError) and exc.value != api.NVML_ERROR_NOT_SUPPORTED:
            try:  # is it this call, or the whole device?
                api.nvmlDeviceGetUUID(gpu.handle)
            except Exception as probe:
                why = f"{call}: {reason}; the device no longer answers: {probe}"
                if classify(api, probe) == "lost":
                    raise GpuLost(why) from None
                raise GpuSilent(why) from None
        gpu.guard.failed(call, kind, reason, round_no)

    def sample(
        self,
        gpu: Gpu,
        aliases: dict[int, int],
        now_ns: int,
        round_no: int,
        entered_ns: int,
        slow: bool = True,
    ) -> GpuSample:
        """One GpuSample of ``gpu``; ``aliases`` maps every pid alias of the job's
        processes to its pid (empty: the job fields are None and not queried).
        ``entered_ns`` is ``time.monotonic_ns()`` when the round stamped ``now_ns`` began
        here: the energy counter's reading is stamped ``now_ns`` plus the time since.
        Without ``slow`` the expensive calls (process lists, per-process utilization,
        GPM) are not made and their fields are None."""
        api = self._api

        def read(call: str, fn: Callable[..., Any], *args: Any, whole: bool = False) -> Any:
            return self.read(gpu, call, fn, *args, round_no=round_no, whole=whole)

        gpu.notes.clear()
        util = read("utilization", api.nvmlDeviceGetUtilizationRates)
        windows = read("utilization samples", self._util_windows, gpu)
        mem = read("memory v2", self._memory_v2)
        if mem is None:
            mem = read("memory", api.nvmlDeviceGetMemoryInfo)
        energy_mj = read("energy", api.nvmlDeviceGetTotalEnergyConsumption, whole=True)
        # The window's mean power divides by the time between two counter readings: a
        # slow call before this one (or a worker thread woken late on a busy machine)
        # would put its delay into the energy and not into the time, so the reading is
        # stamped when it was taken, not when the round began.
        energy_ns = now_ns + time.monotonic_ns() - entered_ns
        power_w, power_source = self._power(gpu, read, energy_mj, energy_ns)
        temp = read(
            "temperature", api.nvmlDeviceGetTemperature, api.NVML_TEMPERATURE_GPU, whole=True
        )
        clock = read("sm clock", api.nvmlDeviceGetClockInfo, api.NVML_CLOCK_SM, whole=True)
        throttle = read("throttle reasons", self._throttle_reasons, whole=True)
        sm_activity = None if gpu.gpm is None or not slow else read("sm activity", self._gpm, gpu)
        job = aliases if slow else {}
        job_mem = self._job_memory(gpu, read, job) if job else (None, None)
        return GpuSample(
            t_ns=now_ns,
            gpu_index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            util_pct=_windows_mean(windows)
            if windows
            else None
            if util is None
            else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            mem_used_mib=None if mem is None else mem.used / BYTES_PER_MIB,
            mem_total_mib=None if mem is None else mem.total / BYTES_PER_MIB,
            power_w=power_w,
            power_source=power_source,
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
            temperature_c=None if temp is None else float(temp),
            sm_clock_mhz=None if clock is None else float(clock),
            sm_activity_pct=sm_activity,
            job_mem_mib=job_mem[0],
            job_sm_util_pct=self._job_sm_util(gpu, read, job) if job else None,
            whole_gpu_uuid=gpu.whole_uuid,
            util_windows=windows,
            throttle_reasons=None if throttle is None else int(throttle),
            job_pids=job_mem[1],
        )

    def _util_windows(self, handle: Any, gpu: Gpu) -> tuple[tuple[int, int, float], ...]:
        """The driver's utilization samples newer than the last seen, as (start_ns, end_ns,
        %) windows on the monotonic clock; () when there is none new (``NOT_FOUND``).

        Each sample covers the driver's sample period before its timestamp (1/6 s to 1 s by
        product), taken from the spacing of the samples (their median gap, kept from round
        to round), and never reaches back past the sample before it."""
        api = self._api
        try:
            value_type, samples = api.nvmlDeviceGetSamples(
                handle, api.NVML_GPU_UTILIZATION_SAMPLES, gpu.util_seen_us
            )
        except api.NVMLError as exc:
            if exc.value == api.NVML_ERROR_NOT_FOUND:
                return ()
            raise
        if not 0 <= value_type < len(_VALUE_MEMBERS):
            raise BadValue(f"unknown NVML value type {value_type}")
        member = _VALUE_MEMBERS[value_type]
        points = sorted(
            (int(s.timeStamp), float(getattr(s.sampleValue, member)))
            for s in samples
            if int(s.timeStamp) > gpu.util_seen_us
        )
        if not points:
            return ()
        # The timestamps are on the CPU's wall clock (µs): move them onto the monotonic one.
        offset_ns = time.monotonic_ns() - time.time_ns()
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(points)]
        if gpu.util_sampled:  # the last seen is a driver sample too: one more spacing
            gaps.append(points[0][0] - gpu.util_seen_us)
        if gaps:
            gpu.util_period_us = int(statistics.median(gaps))
        elif not gpu.util_period_us:  # one sample since the GPU was added: at most that
            gpu.util_period_us = points[0][0] - gpu.util_seen_us
        gpu.util_sampled = True
        period_us = gpu.util_period_us
        windows = []
        previous_us = gpu.util_seen_us
        for stamp_us, value in points:
            start_us = max(previous_us, stamp_us - period_us)
            windows.append((start_us * 1000 + offset_ns, stamp_us * 1000 + offset_ns, value))
            previous_us = stamp_us
        gpu.util_seen_us = points[-1][0]
        return tuple(windows)

    def _throttle_reasons(self, handle: Any) -> Any:
        """The clocks event reasons bitmask; bindings before NVML 12.2 name the call
        ``...ClocksThrottleReasons`` (the same bits)."""
        api = self._api
        call = getattr(api, "nvmlDeviceGetCurrentClocksEventReasons", None)
        return (call or api.nvmlDeviceGetCurrentClocksThrottleReasons)(handle)

    def _memory_v2(self, handle: Any) -> Any:
        api = self._api
        return api.nvmlDeviceGetMemoryInfo(handle, api.nvmlMemory_v2)

    def _power(
        self, gpu: Gpu, read: Callable[..., Any], energy_mj: float | None, now_ns: int
    ) -> tuple[float | None, str | None]:
        """The window's mean power from the energy counter, else a power reading; W.

        A window shorter than ``MIN_ENERGY_WINDOW_NS`` (an extra round right after a
        scheduled one) keeps the previous reading as the window's start and gives the
        last window's mean: the counter steps about every 100 ms, so such a window holds
        one whole step or none, and a 5 ms window after a step read 6 kW for a 300 W GPU.
        """
        previous = gpu.energy_at
        if (
            previous is not None
            and energy_mj is not None
            and energy_mj >= previous[1]
            and now_ns - previous[0] < MIN_ENERGY_WINDOW_NS
        ):
            if gpu.energy_power_w is not None:
                return gpu.energy_power_w, "energy"
        else:
            gpu.energy_at = None if energy_mj is None else (now_ns, float(energy_mj))
            gpu.energy_power_w = None
            if (
                previous is not None
                and energy_mj is not None
                and now_ns > previous[0]
                and energy_mj > previous[1]
            ):  # a counter that did not move says nothing
                gpu.power_source = "energy"
                watts = (energy_mj - previous[1]) / 1000.0 / ((now_ns - previous[0]) / 1e9)
                gpu.energy_power_w = watts
                return watts, "energy"
        milliwatts = read("instant power", self._instant_power_mw, whole=True)
        source = "instant"
        if milliwatts is None:
            milliwatts = read("average power", self._api.nvmlDeviceGetPowerUsage, whole=True)
            source = "average"
        if milliwatts is None:
            return None, None
        gpu.power_source = source
        return milliwatts / 1000.0, source

    def _instant_power_mw(self, handle: Any) -> float:
        api = self._api
        value = api.nvmlDeviceGetFieldValues(handle, [api.NVML_FI_DEV_POWER_INSTANT])[0]
        if value.nvmlReturn != api.NVML_SUCCESS:
            raise api.NVMLError(value.nvmlReturn)
        if not 0 <= value.valueType < len(_VALUE_MEMBERS):
            raise BadValue(f"unknown NVML value type {value.valueType}")
        return float(getattr(value.value, _VALUE_MEMBERS[value.valueType]))

    def _gpm(self, handle: Any, gpu: Gpu) -> float | None:
        """SM activity between the previous GPM sample and a new one; None on the first."""
        api = self._api
        assert gpu.gpm is not None
        previous, current = gpu.gpm
        api.nvmlGpmSampleGet(handle, current)
        gpu.gpm = [current, previous]
        if not gpu.gpm_primed:
            gpu.gpm_primed = True
            return None
        request = api.c_nvmlGpmMetricsGet_t()
        request.version = api.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = current
        request.metrics[0].metricId = api.NVML_GPM_METRIC_SM_UTIL
        metric = api.nvmlGpmMetricsGet(request).metrics[0]
        if metric.nvmlReturn != api.NVML_SUCCESS:
            raise api.NVMLError(metric.nvmlReturn)
        return float(metric.value)

    def _unknown_namespace(self, gpu: Gpu, listed: list[int]) -> bool:
        """None of the job's pids listed, and some listed pid is not of our namespace."""
        if any(self._pids.is_foreign(pid) for pid in listed):
            gpu.notes["job pids"] = _NAMESPACE_NOTE
            return True
        return False

    def _job_memory(
        self, gpu: Gpu, read: Callable[..., Any], aliases: dict[int, int]
    ) -> tuple[float | None, tuple[int, ...] | None]:
        """GPU memory used by the job's processes, MiB, and the job's pids listed; None,
        None if neither list is readable or the lists speak another pid namespace."""
        api = self._api
        used: dict[int, int] = {}
        seen: set[int] = set()  # the job's pids listed, with or without a memory figure
        listed: list[int] = []
        answered = False
        for call, fn in (
            ("compute processes", api.nvmlDeviceGetComputeRunningProcesses),
            ("graphics processes", api.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            processes = read(call, fn)
            if processes is None:
                continue
            answered = True
            for proc in processes:
                listed.append(proc.pid)
                pid = aliases.get(proc.pid)
                if pid is not None:
                    seen.add(pid)
                if pid is not None and proc.usedGpuMemory is not None:
                    used[pid] = max(used.get(pid, 0), proc.usedGpuMemory)
        if not answered or (not used and self._unknown_namespace(gpu, listed)):
            return None, None
        return sum(used.values()) / BYTES_PER_MIB, tuple(sorted(seen))

    def _job_sm_util(
        self, gpu: Gpu, read: Callable[..., Any], aliases: dict[int, int]
    ) -> float | None:
        """SM utilization of the job's processes since the last call, % (capped at 100).

        Per process, the mean of the samples NVML returns newer than the last-seen
        timestamp; a job process absent while others have samples counts 0 % (NVML leaves
        idle processes out). None when NVML has no new sample at all (``NOT_FOUND``), and
        when its pids are of another namespace."""
        samples = read("process utilization", self._process_samples, gpu.proc_seen_us)
        if not samples:
            return None
        per_pid: dict[int, list[int]] = {}
        for sample in samples:
            gpu.proc_seen_us = max(gpu.proc_seen_us, int(sample.timeStamp))
            pid = aliases.get(sample.pid)
            if pid is not None:
                per_pid.setdefault(pid, []).append(sample.smUtil)
        if not per_pid and self._unknown_namespace(gpu, [s.pid for s in samples]):
            return None
        return float(min(100.0, sum(sum(v) / len(v) for v in per_pid.values())))

    def _process_samples(self, handle: Any, since_us: int) -> list[Any]:
        """Samples newer than ``since_us``; [] when there is none (``NOT_FOUND``, or
        pynvml's empty SUCCESS)."""
        api = self._api
        try:
            return list(api.nvmlDeviceGetProcessUtilization(handle, since_us))
        except api.NVMLError as exc:
            if exc.value in (api.NVML_ERROR_NOT_FOUND, api.NVML_SUCCESS):
                return []
            raise


def _windows_mean(windows: tuple[tuple[int, int, float], ...]) -> float:
    """The mean of driver utilization samples (start_ns, end_ns, %), each weighted by its
    length (their plain mean where every length is 0)."""
    total_ns = sum(end - start for start, end, _ in windows)
    if total_ns <= 0:
        return sum(value for _, _, value in windows) / len(windows)
    return sum((end - start) * value for start, end, value in windows) / total_ns


def now_us() -> int:
    """The CPU clock in µs, the clock of NVML's per-process sample timestamps."""
    return time.time_ns() // 1000
