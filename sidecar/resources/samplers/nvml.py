"""GPU telemetry of the job's GPUs through NVML (NVIDIA's nvidia-ml-py, ``import pynvml``).

``open_nvml`` initialises NVML and maps the job's ``CUDA_VISIBLE_DEVICES`` to NVML devices
by UUID; it returns an ``NvmlSampler`` or, when there is nothing to sample, an
``NvmlUnavailable`` with a one-line reason. ``pynvml`` is imported inside ``open_nvml``,
so importing this module never needs a driver.

Guards, so that NVML can never take the sidecar down:

* Every NVML call runs on one dedicated daemon thread (``worker.Worker``); the caller
  waits at most a timeout. A call that does not return in time marks the sampler
  ``failed`` (and ``hung``) with a reason and GPU sampling stops for good (host sampling
  goes on; the node daemon's watchdog stops, so systemd restarts it).
* A call that raises ``NVMLError_NotSupported`` (or any other NVMLError while the device
  still answers) leaves its fields None, and that call is never made again for that GPU.
* A GPU that stops answering (``GpuIsLost``, ``Unknown``, ``ResetRequired``,
  ``GpuNotFound``, or any error after which ``nvmlDeviceGetUUID`` fails too) is marked
  lost and skipped; the other GPUs go on.

Units: MiB = bytes / 1024², W, J, °C, MHz, %. Sample times are the caller's
``time.monotonic_ns()`` (the markers' ``perf_counter_ns`` is the same clock on Linux).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.model.units import BYTES_PER_MIB
from sidecar.resources.samplers.worker import CallTimeout, Worker

# nvmlValueType_t -> the member of the c_nvmlValue_t union that holds the value.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


@dataclass(frozen=True)
class GpuSample:
    """One reading of one job GPU. A field is None where the GPU or driver does not
    support it. ``gpu_index`` is the position in the job's GPU list, not an NVML index."""

    t_ns: int
    gpu_index: int
    uuid: str
    name: str
    util_pct: float | None
    mem_util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    power_w: float | None
    power_source: str | None  # "instant" (NVML_FI_DEV_POWER_INSTANT) or "average"
    energy_j: float | None  # counter since the driver was loaded
    temperature_c: float | None
    sm_clock_mhz: float | None
    sm_activity_pct: float | None  # GPM SM activity (Hopper+), not the utilization above
    job_mem_mib: float | None
    job_sm_util_pct: float | None


@dataclass(frozen=True)
class NvmlUnavailable:
    """GPU sampling is off; ``reason`` says why in one line."""

    reason: str

    def status(self) -> dict[str, Any]:
        """The same shape as ``NvmlSampler.status()``: off, the reason, no GPUs."""
        return {"gpu_sampling": "off", "reason": self.reason, "gpus": []}


class _GpuLost(Exception):
    """Raised inside a sampling round when a GPU no longer answers."""


@dataclass
class _Gpu:
    index: int
    uuid: str
    name: str
    handle: Any
    proc_seen_us: int  # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization (µs, CPU clock)
    off: dict[str, str] = field(default_factory=dict)  # call name -> why it is not made
    lost: str | None = None
    power_source: str | None = None
    gpm: list[Any] | None = None  # [previous, current] GPM sample buffers; None: no GPM
    gpm_primed: bool = False


def open_nvml(visible_devices: str | None, timeout_s: float = 5.0, api: Any = None,
              round_timeout_s: float = 1.0) -> NvmlSampler | NvmlUnavailable:
    """Initialise NVML and select the job's GPUs.

    ``visible_devices`` is the job's ``CUDA_VISIBLE_DEVICES`` (see
    ``resolve_visible_devices``); None means every GPU. ``api`` is the ``pynvml`` module,
    or a stand-in with the same functions in tests. ``timeout_s`` bounds initialisation
    and device enumeration (nvmlInit can take seconds without persistence mode);
    ``round_timeout_s`` bounds each later call (a sampling round, adding GPUs, closing).
    Never raises for a missing library, driver or GPU: returns NvmlUnavailable instead.
    """
    if api is None:
        try:
            import pynvml as api
        except ImportError as exc:
            return NvmlUnavailable(f"nvidia-ml-py not installed: {exc}")
    worker = Worker("nvml-sampler")
    try:
        devices = worker.call(lambda: _init_and_list(api), timeout_s)
    except CallTimeout:
        return NvmlUnavailable(f"nvmlInit timed out after {timeout_s:g} s")
    except api.NVMLError as exc:
        worker.stop()
        return NvmlUnavailable(_init_failure(api, exc))
    sampler = NvmlSampler(api, worker, devices, round_timeout_s)
    if not devices:
        sampler.close()
        return NvmlUnavailable("no GPU: NVML lists no device")
    wanted = resolve_visible_devices(visible_devices, {i: uuid for i, uuid, _ in devices})
    sampler.add_uuids(wanted)
    if sampler.failed:
        sampler.close()
        return NvmlUnavailable(str(sampler.reason))
    if not wanted:
        sampler.close()
        return NvmlUnavailable(f"no GPU: CUDA_VISIBLE_DEVICES={visible_devices!r} names none "
                               f"of the {len(devices)} GPUs")
    return sampler


def resolve_visible_devices(visible_devices: str | None, uuids: dict[int, str]) -> list[str]:
    """UUIDs of the GPUs that ``CUDA_VISIBLE_DEVICES`` makes visible, in CUDA order.

    ``uuids`` maps NVML index to UUID. Entries are indices or UUIDs ("GPU-..." or a unique
    prefix of one; the "GPU-" may be left out). As CUDA does, the list ends at the first
    entry that names no GPU; duplicates are dropped; an empty string means no GPU. Indices
    are taken as NVML (PCI bus) indices, which is CUDA's order only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs; the UUIDs the training process
    reports through ``NvmlSampler.add_uuids`` settle it. MIG entries name no GPU here.
    """
    if visible_devices is None:
        return [uuids[i] for i in sorted(uuids)]
    chosen: list[str] = []
    for entry in (e.strip() for e in visible_devices.split(",")):
        uuid = uuids.get(int(entry)) if entry.isdigit() else _match_uuid(entry, uuids.values())
        if uuid is None:
            break
        if uuid not in chosen:
            chosen.append(uuid)
    return chosen


def _match_uuid(entry: str, known: Iterable[str]) -> str | None:
    """The one known UUID that ``entry`` (a UUID or a prefix, "GPU-" optional) names."""
    text = entry.lower()
    if not text:
        return None
    if not text.startswith(("gpu-", "mig-")):
        text = "gpu-" + text
    hits = [uuid for uuid in known if uuid.lower().startswith(text)]
    return hits[0] if len(hits) == 1 else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _init_and_list(api: Any) -> list[tuple[int, str, Any]]:
    """nvmlInit, then (NVML index, UUID, handle) of every device that answers."""
    api.nvmlInit()
    devices = []
    for index in range(api.nvmlDeviceGetCount()):
        try:
            handle = api.nvmlDeviceGetHandleByIndex(index)
            devices.append((index, _text(api.nvmlDeviceGetUUID(handle)), handle))
        except api.NVMLError:
            continue  # a device that does not answer at start is not ours to sample
    return devices


def _init_failure(api: Any, exc: Exception) -> str:
    if isinstance(exc, (api.NVMLError_LibraryNotFound, api.NVMLError_DriverNotLoaded)):
        return f"no NVIDIA driver: {exc}"
    return f"NVML initialisation failed: {exc}"


class NvmlSampler:
    """Samples the job's GPUs; built by ``open_nvml``. Not thread-safe: one caller."""

    def __init__(self, api: Any, worker: Worker, devices: list[tuple[int, str, Any]],
                 timeout_s: float) -> None:
        self._api = api
        self._worker = worker
        self._handles = {uuid: handle for _, uuid, handle in devices}
        self._timeout_s = timeout_s
        self._gpus: list[_Gpu] = []
        self._lost_errors = (api.NVMLError_GpuIsLost, api.NVMLError_Unknown,
                             api.NVMLError_ResetRequired, api.NVMLError_GpuNotFound)
        self._closed = False
        self.failed = False
        self.hung = False  # failed because a call never returned (NVML is wedged)
        self.reason: str | None = None

    @property
    def uuids(self) -> list[str]:
        """UUIDs of the job's GPUs, in ``gpu_index`` order (lost ones included)."""
        return [gpu.uuid for gpu in self._gpus]

    def add_uuids(self, uuids: Iterable[str]) -> list[str]:
        """Add the GPUs with these UUIDs (as reported by the training process; "GPU-"
        optional, unique prefixes accepted) to the job's list, after those already there.

        Returns the UUIDs newly added; unknown ones and ones already listed are ignored.
        Does nothing once the sampler has failed.
        """
        wanted = []
        for entry in uuids:
            uuid = _match_uuid(entry.strip(), self._handles)
            if uuid is not None and uuid not in wanted and uuid not in self.uuids:
                wanted.append(uuid)
        if not wanted:
            return []
        added = self._run("adding GPUs", lambda: [self._add(uuid) for uuid in wanted])
        return added or []

    def _add(self, uuid: str) -> str:
        api = self._api
        handle = self._handles[uuid]
        try:
            name = _text(api.nvmlDeviceGetName(handle))
        except api.NVMLError:
            name = "unknown"
        gpu = _Gpu(index=len(self._gpus), uuid=uuid, name=name, handle=handle,
                   proc_seen_us=time.time_ns() // 1000)
        try:
            if api.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                gpu.gpm = [api.nvmlGpmSampleAlloc(), api.nvmlGpmSampleAlloc()]
            else:
                gpu.off["sm activity"] = "GPM not supported on this GPU (Hopper and newer)"
        except api.NVMLError as exc:
            gpu.off["sm activity"] = f"GPM: {exc}"
        self._gpus.append(gpu)
        return uuid

    def sample(self, job_pids: set[int], now_ns: int) -> list[GpuSample]:
        """One sample per job GPU that is not lost, stamped ``now_ns``
        (``time.monotonic_ns()`` of this sampling round).

        ``job_pids`` are the job's processes (host pid namespace) for the job's GPU memory
        and SM utilization; with none, those two fields are None and not queried.
        Returns [] once the sampler has failed; never raises.
        """
        if self.failed or self._closed or not self._gpus:
            return []
        pids = frozenset(job_pids)
        return self._run("sampling", lambda: self._round(pids, now_ns)) or []

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the worker thread; on a timeout or an unexpected error the sampler
        fails with a reason and None is returned."""
        if self.failed:
            return None
        try:
            return self._worker.call(fn, self._timeout_s)
        except CallTimeout:
            self.hung = True
            self._fail(f"NVML {what} did not return within {self._timeout_s:g} s")
        except Exception as exc:  # a bug or an unforeseen binding error: stop GPUs, not us
            self._fail(f"NVML {what} failed: {exc!r}")
        return None

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.reason = f"{reason}; GPU sampling stopped"

    def _round(self, pids: frozenset[int], now_ns: int) -> list[GpuSample]:
        samples = []
        for gpu in self._gpus:
            if gpu.lost is not None:
                continue
            try:
                samples.append(self._sample_gpu(gpu, pids, now_ns))
            except _GpuLost as exc:
                gpu.lost = str(exc)
        return samples

    def _sample_gpu(self, gpu: _Gpu, pids: frozenset[int], now_ns: int) -> GpuSample:
        api = self._api
        util = self._read(gpu, "utilization", api.nvmlDeviceGetUtilizationRates)
        mem = self._read(gpu, "memory", api.nvmlDeviceGetMemoryInfo)
        power_w, power_source = self._power(gpu)
        energy_mj = self._read(gpu, "energy", api.nvmlDeviceGetTotalEnergyConsumption)
        temp = self._read(gpu, "temperature", api.nvmlDeviceGetTemperature,
                          api.NVML_TEMPERATURE_GPU)
        clock = self._read(gpu, "sm clock", api.nvmlDeviceGetClockInfo, api.NVML_CLOCK_SM)
        sm_activity = (None if gpu.gpm is None
                       else self._read(gpu, "sm activity", self._gpm_sm_activity, gpu))
        return GpuSample(
            t_ns=now_ns, gpu_index=gpu.index, uuid=gpu.uuid, name=gpu.name,
            util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            mem_used_mib=None if mem is None else mem.used / BYTES_PER_MIB,
            mem_total_mib=None if mem is None else mem.total / BYTES_PER_MIB,
            power_w=power_w, power_source=power_source,
            energy_j=None if energy_mj is None else energy_mj / 1000.0,
            temperature_c=None if temp is None else float(temp),
            sm_clock_mhz=None if clock is None else float(clock),
            sm_activity_pct=sm_activity,
            job_mem_mib=self._job_memory(gpu, pids) if pids else None,
            job_sm_util_pct=self._job_sm_util(gpu, pids) if pids else None,
        )

    def _read(self, gpu: _Gpu, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(handle, *args)``, or None when ``call`` is off for this GPU or fails now
        (then it stays off). Raises _GpuLost when the GPU no longer answers."""
        if call in gpu.off:
            return None
        api = self._api
        try:
            return fn(gpu.handle, *args)
        except self._lost_errors as exc:
            raise _GpuLost(f"{call}: {exc}") from None
        except api.NVMLError as exc:
            if not isinstance(exc, api.NVMLError_NotSupported):
                try:  # is it this call, or the whole device?
                    api.nvmlDeviceGetUUID(gpu.handle)
                except api.NVMLError as probe:
                    raise _GpuLost(f"{call}: {exc}; the device no longer answers: "
                                   f"{probe}") from None
            gpu.off[call] = str(exc)
            return None

    def _power(self, gpu: _Gpu) -> tuple[float | None, str | None]:
        """Instant power where the field works, else NVML's averaged power; W."""
        milliwatts = self._read(gpu, "instant power", self._instant_power_mw)
        source = "instant"
        if milliwatts is None:
            milliwatts = self._read(gpu, "average power", self._api.nvmlDeviceGetPowerUsage)
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
        return float(getattr(value.value, _VALUE_MEMBERS[value.valueType]))

    def _gpm_sm_activity(self, handle: Any, gpu: _Gpu) -> float | None:
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

    def _job_memory(self, gpu: _Gpu, pids: frozenset[int]) -> float | None:
        """GPU memory used by the job's processes, MiB; None if neither list is readable."""
        api = self._api
        used: dict[int, int] = {}
        answered = False
        for call, fn in (("compute processes", api.nvmlDeviceGetComputeRunningProcesses),
                         ("graphics processes", api.nvmlDeviceGetGraphicsRunningProcesses)):
            processes = self._read(gpu, call, fn)
            if processes is None:
                continue
            answered = True
            for proc in processes:
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    used[proc.pid] = max(used.get(proc.pid, 0), proc.usedGpuMemory)
        return sum(used.values()) / BYTES_PER_MIB if answered else None

    def _job_sm_util(self, gpu: _Gpu, pids: frozenset[int]) -> float | None:
        """SM utilization of the job's processes since the last call, % (capped at 100).

        Per process, the mean of the samples NVML returns newer than the last-seen
        timestamp; a job process with no sample counts 0 %."""
        samples = self._read(gpu, "process utilization", self._process_samples,
                             gpu.proc_seen_us)
        if samples is None:
            return None
        per_pid: dict[int, list[int]] = {}
        for sample in samples:
            gpu.proc_seen_us = max(gpu.proc_seen_us, int(sample.timeStamp))
            if sample.pid in pids:
                per_pid.setdefault(sample.pid, []).append(sample.smUtil)
        return float(min(100.0, sum(sum(v) / len(v) for v in per_pid.values())))

    def _process_samples(self, handle: Any, since_us: int) -> list[Any]:
        api = self._api
        try:
            return list(api.nvmlDeviceGetProcessUtilization(handle, since_us))
        except api.NVMLError_NotFound:
            return []  # no process had a sample newer than since_us
        except api.NVMLError as exc:
            if exc.value == api.NVML_SUCCESS:  # pynvml's way of saying "no samples"
                return []
            raise

    def status(self) -> dict[str, Any]:
        """For ``sidecar status``: on/off, the reason when off, and per GPU its UUID, name,
        lost flag and reason, power source and the calls switched off (with why)."""
        gpus = [{"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name,
                 "lost": gpu.lost is not None, "lost_reason": gpu.lost,
                 "power_source": gpu.power_source, "unsupported": dict(gpu.off)}
                for gpu in list(self._gpus)]
        reason = self.reason
        if reason is None and self._closed:
            reason = "closed"
        if reason is None and gpus and all(gpu["lost"] for gpu in gpus):
            reason = "every GPU of the job is lost"
        return {"gpu_sampling": "off" if reason else "on", "reason": reason, "gpus": gpus}

    def close(self) -> None:
        """Free GPM buffers and call nvmlShutdown, each guarded; skipped (the worker is
        stuck) after a failure. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        if not self.failed:
            self._run("shutdown", self._shutdown)
        self._worker.stop()

    def _shutdown(self) -> None:
        api = self._api
        for gpu in self._gpus:
            for buffer in gpu.gpm or ():
                with contextlib.suppress(api.NVMLError):
                    api.nvmlGpmSampleFree(buffer)
        with contextlib.suppress(api.NVMLError):
            api.nvmlShutdown()
