"""GPU telemetry of the job's GPUs through NVML (NVIDIA's nvidia-ml-py, ``import pynvml``).

``open_nvml`` initialises NVML and maps the job's ``CUDA_VISIBLE_DEVICES`` to NVML devices
(whole GPUs and MIG instances) by UUID; it returns an ``NvmlSampler`` or, when there is
nothing to sample, an ``NvmlUnavailable`` with a one-line reason. ``pynvml`` is imported
inside ``open_nvml``, so importing this module never needs a driver.

Guards, so that NVML can never take the sidecar down nor switch more off than failed:

* Every NVML call runs on a dedicated daemon thread (``worker.Worker``); the caller waits
  at most a timeout. A round that does not return in time is lost: the call under way
  backs off (``nvml_guard``), the stuck thread is left behind and a fresh one takes
  over. Only when ``MAX_STUCK_THREADS`` threads are stuck at once (a hung driver) does
  GPU sampling stop for good, marked ``hung`` (host sampling goes on; the node daemon's
  watchdog stops, so systemd restarts it).
* Any exception of a call (an NVMLError, ``NVMLLibraryMismatchError``, a value of an
  unknown type, ...) affects that call for that GPU only: off for good when it cannot
  work (not supported, no permission, a mismatched binding), retried with backoff when
  it may pass (``UNKNOWN``, a timeout).
* A GPU that is gone (``GpuIsLost``, ``ResetRequired``, ``GpuNotFound``) is marked lost
  and skipped; one that stops answering for a while backs off as a whole; the others
  go on.

Units: MiB = bytes / 1024², W, J, °C, MHz, %. Sample times are the caller's
``time.monotonic_ns()`` (the markers' ``perf_counter_ns`` is the same clock on Linux).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sidecar.resources.samplers.nvml_devices import (
    NvmlDevice,
    list_devices,
    match_uuid,
    resolve_visible_devices,
    text,
)
from sidecar.resources.samplers.nvml_gpu import (
    Gpu,
    GpuLost,
    GpuReader,
    GpuSample,
    GpuSilent,
    now_us,
)
from sidecar.resources.samplers.pids import PidAliases
from sidecar.resources.samplers.worker import CallTimeout, Worker

__all__ = ["GpuSample", "NvmlSampler", "NvmlUnavailable", "open_nvml", "resolve_visible_devices"]

# Worker threads left blocked in a call before sampling stops: a second call stuck while
# the first has not come back (after its backoff) means a wedged driver, not a slow round.
MAX_STUCK_THREADS = 2


@dataclass(frozen=True)
class NvmlUnavailable:
    """GPU sampling is off; ``reason`` says why in one line."""

    reason: str

    def status(self) -> dict[str, Any]:
        """The same shape as ``NvmlSampler.status()``: off, the reason, no GPUs."""
        return {"gpu_sampling": "off", "reason": self.reason, "gpus": []}


def open_nvml(
    visible_devices: str | None,
    timeout_s: float = 5.0,
    api: Any = None,
    round_timeout_s: float = 1.0,
) -> NvmlSampler | NvmlUnavailable:
    """Initialise NVML and select the job's GPUs.

    ``visible_devices`` is the job's ``CUDA_VISIBLE_DEVICES`` (see
    ``nvml_devices.resolve_visible_devices``); None means every whole GPU. ``api`` is the
    ``pynvml`` module, or a stand-in with the same functions in tests. ``timeout_s``
    bounds initialisation and device enumeration (nvmlInit can take seconds without
    persistence mode); ``round_timeout_s`` bounds each later call (a sampling round,
    adding GPUs, closing). Never raises for a missing library, driver or GPU: returns
    NvmlUnavailable instead.
    """
    if api is None:
        try:
            import pynvml
        except ImportError as exc:
            return NvmlUnavailable(f"nvidia-ml-py not installed: {exc}")
        api = pynvml
    worker = Worker("nvml-sampler")
    try:
        devices = worker.call(lambda: list_devices(api), timeout_s)
    except CallTimeout:
        return NvmlUnavailable(f"nvmlInit timed out after {timeout_s:g} s")
    except Exception as exc:
        worker.stop()
        return NvmlUnavailable(_init_failure(api, exc))
    sampler = NvmlSampler(api, worker, devices, round_timeout_s)
    if not devices:
        sampler.close()
        return NvmlUnavailable("no GPU: NVML lists no device")
    wanted = resolve_visible_devices(visible_devices, devices)
    sampler.add_uuids(wanted)
    if sampler.failed:
        sampler.close()
        return NvmlUnavailable(str(sampler.reason))
    if not wanted:
        sampler.close()
        return NvmlUnavailable(
            f"no GPU: CUDA_VISIBLE_DEVICES={visible_devices!r} names none "
            f"of the {len(devices)} devices"
        )
    return sampler


# What an NVML initialisation error means and what to do, by NVML error code: the error's
# own text ("RM has detected an NVML/RM version mismatch.") names the symptom only.
_INIT_ADVICE = {
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVIDIA kernel module and the driver's user-space library are of different "
        "versions (a driver update without a reboot?): reboot, or reload the nvidia "
        "kernel modules"
    ),
    "NVML_ERROR_NO_PERMISSION": (
        "no access to the GPU device files /dev/nvidia*: check their permissions, or the "
        "container's device access (--gpus)"
    ),
    "NVML_ERROR_FUNCTION_NOT_FOUND": (
        "the driver is older than nvidia-ml-py expects: update the driver, or install an "
        "older nvidia-ml-py"
    ),
    "NVML_ERROR_IRQ_ISSUE": (
        "the driver cannot use the GPU's interrupts: see dmesg (IOMMU and IRQ settings)"
    ),
    "NVML_ERROR_GPU_IS_LOST": (
        "a GPU has fallen off the bus: see dmesg for Xid errors; reset the GPU or reboot"
    ),
    "NVML_ERROR_TIMEOUT": (
        "the driver did not answer in time: enable persistence mode (nvidia-smi -pm 1)"
    ),
    "NVML_ERROR_UNKNOWN": "see dmesg for driver errors (Xid), and nvidia-smi",
}


def _init_failure(api: Any, exc: Exception) -> str:
    """The one-line reason for an NVML initialisation that raised ``exc``: what failed,
    what it means, what to do."""
    if isinstance(exc, (api.NVMLError_LibraryNotFound, api.NVMLError_DriverNotLoaded)):
        return f"no NVIDIA driver: {exc}"
    if isinstance(exc, api.NVMLLibraryMismatchError):
        return (
            f"NVML initialisation failed: {exc}: nvidia-ml-py is newer than the driver's "
            "NVML library: update the driver, or install an older nvidia-ml-py"
        )
    code = getattr(exc, "value", None)
    for name, advice in _INIT_ADVICE.items():
        if code is not None and code == getattr(api, name, None):
            return f"NVML initialisation failed: {type(exc).__name__} ({exc}): {advice}"
    return f"NVML initialisation failed: {exc!r}: {exc}"


class NvmlSampler:
    """Samples the job's GPUs; built by ``open_nvml``. Not thread-safe: one caller."""

    def __init__(
        self, api: Any, worker: Worker, devices: list[NvmlDevice], timeout_s: float
    ) -> None:
        self._api = api
        self._worker = worker
        self._devices = {device.uuid: device for device in devices}
        self._timeout_s = timeout_s
        self._gpus: list[Gpu] = []
        self._pids = PidAliases()
        self._reader = GpuReader(api, self._pids)
        self._round = 0
        self._stuck: list[Worker] = []  # workers left blocked in a call that timed out
        self._closed = False
        self.failed = False
        self.hung = False  # failed because a call never returned (NVML is wedged)
        self.reason: str | None = None

    @property
    def uuids(self) -> list[str]:
        """UUIDs of the job's GPUs, in ``gpu_index`` order (lost ones included)."""
        return [gpu.uuid for gpu in self._gpus]

    def add_uuids(self, uuids: Iterable[str]) -> list[str]:
        """Add the devices with these UUIDs (as reported by the training process: ``GPU-``
        or ``MIG-`` optional, unique prefixes accepted) to the job's list, after those
        already there.

        Returns the UUIDs newly added; unknown ones and ones already listed are ignored.
        Does nothing once the sampler has failed.
        """
        wanted = []
        for entry in uuids:
            uuid = match_uuid(entry, self._devices)
            if uuid is not None and uuid not in wanted and uuid not in self.uuids:
                wanted.append(uuid)
        if not wanted:
            return []
        added = self._run("adding GPUs", lambda: [self._add(uuid) for uuid in wanted])
        return added or []

    def _add(self, uuid: str) -> str:
        api = self._api
        device = self._devices[uuid]
        try:
            name = text(api.nvmlDeviceGetName(device.handle))
        except Exception:
            name = "unknown"
        mig = device.parent is not None
        gpu = Gpu(
            index=len(self._gpus),
            uuid=uuid,
            name=name,
            handle=device.handle,
            whole_handle=device.parent if mig else device.handle,
            whole_uuid=device.parent_uuid,
            proc_seen_us=now_us(),
            util_seen_us=now_us(),
        )
        if mig:
            gpu.guard.off["sm activity"] = "GPM of a MIG instance is not read"
        else:
            try:
                if api.nvmlGpmQueryDeviceSupport(device.handle).isSupportedDevice:
                    gpu.gpm = [api.nvmlGpmSampleAlloc(), api.nvmlGpmSampleAlloc()]
                else:
                    gpu.guard.off["sm activity"] = (
                        "GPM not supported on this GPU (Hopper and newer)"
                    )
            except Exception as exc:
                gpu.guard.off["sm activity"] = f"GPM: {exc}"
        self._gpus.append(gpu)
        return uuid

    def sample(self, job_pids: set[int], now_ns: int) -> list[GpuSample]:
        """One sample per job GPU that is not lost nor backing off, stamped ``now_ns``
        (``time.monotonic_ns()`` of this sampling round).

        ``job_pids`` are the job's processes (our pid namespace) for the job's GPU memory
        and SM utilization; with none, those two fields are None and not queried.
        Returns [] for a round that did not complete in time and once the sampler has
        failed; never raises.
        """
        if self.failed or self._closed or not self._gpus:
            return []
        self._round += 1
        aliases = self._pids.aliases(job_pids) if job_pids else {}
        entered_ns = time.monotonic_ns()
        return (
            self._run(
                "sampling", lambda: self._sample_all(aliases, now_ns, entered_ns), recover=True
            )
            or []
        )

    def _sample_all(self, aliases: dict[int, int], now_ns: int, entered_ns: int) -> list[GpuSample]:
        samples = []
        round_no = self._round
        for gpu in self._gpus:
            if gpu.lost is not None or not gpu.guard.allowed("device", round_no):
                continue
            try:
                samples.append(self._reader.sample(gpu, aliases, now_ns, round_no, entered_ns))
                gpu.guard.succeeded("device")
            except GpuLost as exc:
                gpu.lost = str(exc)
            except GpuSilent as exc:
                gpu.guard.failed("device", "transient", str(exc), round_no)
        return samples

    def _run(self, what: str, fn: Callable[[], Any], recover: bool = False) -> Any:
        """``fn()`` on the worker thread. A timeout of a ``recover`` call loses that call
        only (see ``_stalled``); any other timeout or unexpected error fails the sampler
        with a reason. Returns None where there is no result."""
        if self.failed:
            return None
        try:
            return self._worker.call(fn, self._timeout_s)
        except CallTimeout:
            if recover:
                self._stalled(what)
            else:
                self.hung = True
                self._fail(f"NVML {what} did not return within {self._timeout_s:g} s")
        except Exception as exc:  # a bug or an unforeseen binding error: stop GPUs, not us
            self._fail(f"NVML {what} failed: {exc!r}")
        return None

    def _stalled(self, what: str) -> None:
        """A round timed out: back off the call it was in, leave the blocked thread to
        finish on its own, go on with a fresh one (up to MAX_STUCK_THREADS stuck)."""
        calling = self._reader.calling
        if calling is not None:
            gpu, call = calling
            gpu.guard.failed(
                call,
                "transient",
                f"did not return within {self._timeout_s:g} s",
                self._round,
                weight=3,
            )
        self._reader.cancel()
        self._reader = GpuReader(self._api, self._pids)
        self._worker.stop()
        self._stuck = [w for w in (*self._stuck, self._worker) if w.alive]
        if len(self._stuck) >= MAX_STUCK_THREADS:
            self.hung = True
            self._fail(
                f"NVML {what} did not return within {self._timeout_s:g} s "
                f"({len(self._stuck)} calls stuck)"
            )
            return
        self._worker = Worker("nvml-sampler")

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.reason = f"{reason}; GPU sampling stopped"

    def status(self) -> dict[str, Any]:
        """For ``sidecar status``: on/off, the reason when off, and per GPU its UUID, name,
        lost flag and reason, power source, the calls switched off (with why), the calls
        waiting for a retry, notes on figures unknown, and for a MIG instance the whole
        GPU whose power and energy it shares."""
        gpus = [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "lost": gpu.lost is not None,
                "lost_reason": gpu.lost,
                "power_source": gpu.power_source,
                "unsupported": dict(gpu.guard.off),
                "retrying": gpu.guard.retrying(),
                "notes": dict(gpu.notes),
                "whole_gpu": gpu.whole_uuid,
            }
            for gpu in list(self._gpus)
        ]
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
                with contextlib.suppress(Exception):
                    api.nvmlGpmSampleFree(buffer)
        with contextlib.suppress(Exception):
            api.nvmlShutdown()
