"""GPU telemetry of the job's GPUs through NVML (NVIDIA's nvidia-ml-py, ``import pynvml``).

``open_nvml`` initialises NVML and maps the job's ``CUDA_VISIBLE_DEVICES`` to NVML devices
(whole GPUs and MIG instances) by UUID; it returns an ``NvmlSampler`` or, when there is
nothing to sample, an ``NvmlUnavailable`` with a one-line reason. ``pynvml`` is imported
inside ``open_nvml``, so importing this module never needs a driver.

Guards, so that NVML can never take the sidecar down nor switch more off than failed:

* Every GPU has its own daemon thread (``worker.Worker``), so the NVML calls of a round
  run off the caller's thread and a slow GPU delays no other. The caller does not wait
  for them either: ``start`` hands each GPU its reading and returns, ``collect`` (called
  whenever the caller looks, never blocking) hands back the rounds whose readings are
  all in or given up, in round order. A GPU still in an earlier round's reading when a
  round starts is not asked again: it misses that round. A reading not back
  ``round_timeout_s`` after its round began is given up: that GPU misses the round, the
  call under way backs off (``nvml_guard``), the stuck thread is left behind and a
  fresh one takes over at the next round. A GPU with ``MAX_STUCK_THREADS`` threads
  stuck at once is skipped until one of them comes back, then sampled again: a hung
  call never stops sampling for good. While every GPU is so stuck (a wedged driver)
  the sampler says ``hung`` (the node daemon's watchdog stops, so systemd restarts it).
  ``sample`` is the waiting form (start, then wait for the round up to its deadline),
  for callers that may wait: a run's last round, benchmarks, tests.
* The expensive calls (process lists, per-process utilization, GPM) are made at most
  once per ``slow_period_s`` (``SLOW_PERIOD_S``) per GPU; the cheap fields every round.
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
import functools
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
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

# Threads of one GPU left blocked in a call before that GPU is skipped (until one comes
# back): a second call stuck while the first has not returned means a wedged device, and
# more threads would only pile up behind it.
MAX_STUCK_THREADS = 2
# The process lists, per-process utilization and GPM of a GPU are read at most this
# often (s): each costs far more than the cheap fields (docs/samplers.md has the figures),
# and what they give (the job's memory, its SM share, SM activity) moves slowly or is an
# average since the previous reading anyway.
SLOW_PERIOD_S = 5.0


@dataclass
class _Lane:
    """One GPU's own thread and reader. ``worker`` is None after a call timed out there:
    a fresh thread starts at the next round, unless too many are stuck. ``reading`` is
    the reading under way (of the round that asked for it), ``missed`` counts the rounds
    this GPU had no sample in because it was late, busy with an earlier reading or stuck.
    """

    worker: Worker | None
    reader: GpuReader
    stuck: list[Worker] = field(default_factory=list)  # threads left blocked in a call
    reading: Future[GpuSample | None] | None = None  # the latest reading handed over
    missed: int = 0

    def ready(self, api: Any, pids: PidAliases, name: str) -> bool:
        """Whether the GPU can be sampled now (starting a fresh thread if needed)."""
        self.stuck = [w for w in self.stuck if w.alive]
        if self.worker is None:
            if len(self.stuck) >= MAX_STUCK_THREADS:
                return False
            self.worker = Worker(name)
            self.reader = GpuReader(api, pids)
        return True

    @property
    def wedged(self) -> bool:
        return self.worker is None and len(self.stuck) >= MAX_STUCK_THREADS


@dataclass
class _Round:
    """A round started and not handed back yet: its stamp, the time (``time.monotonic``)
    by which each reading must be back, the readings still out and the samples in."""

    t_ns: int
    deadline_s: float
    out: list[tuple[Gpu, _Lane, Future[GpuSample | None]]]
    samples: list[GpuSample] = field(default_factory=list)


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
    slow_period_s: float = SLOW_PERIOD_S,
    candidates_only: bool = False,
) -> NvmlSampler | NvmlUnavailable:
    """Initialise NVML and select the job's GPUs.

    ``visible_devices`` is the job's ``CUDA_VISIBLE_DEVICES`` (see
    ``nvml_devices.resolve_visible_devices``); None means every whole GPU. ``api`` is the
    ``pynvml`` module, or a stand-in with the same functions in tests. ``timeout_s``
    bounds initialisation and device enumeration (nvmlInit can take seconds without
    persistence mode); ``round_timeout_s`` bounds each later call (a sampling round,
    adding GPUs, closing); ``slow_period_s`` is how often the expensive calls are made
    per GPU (0: every round). With ``candidates_only`` (a private sidecar of one rank) the
    visible GPUs are only candidates: none is sampled until the job reports it
    (``add_uuids``) or its processes show up in its process lists (``discover``). Never
    raises for a missing library, driver or GPU: returns
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
    sampler = NvmlSampler(api, worker, devices, round_timeout_s, slow_period_s)
    if not devices:
        sampler.close()
        return NvmlUnavailable("no GPU: NVML lists no device")
    wanted = resolve_visible_devices(visible_devices, devices)
    if not wanted:
        sampler.close()
        return NvmlUnavailable(
            f"no GPU: CUDA_VISIBLE_DEVICES={visible_devices!r} names none "
            f"of the {len(devices)} devices"
        )
    if candidates_only:
        sampler.candidates = wanted
        return sampler
    sampler.add_uuids(wanted)
    if sampler.failed:
        sampler.close()
        return NvmlUnavailable(str(sampler.reason))
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
        self,
        api: Any,
        worker: Worker,
        devices: list[NvmlDevice],
        timeout_s: float,
        slow_period_s: float = SLOW_PERIOD_S,
    ) -> None:
        self._api = api
        self._worker = worker  # adding GPUs and shutdown; each GPU samples on its lane
        self._devices = {device.uuid: device for device in devices}
        self._timeout_s = timeout_s
        self._slow_period_ns = round(slow_period_s * 1e9)
        self._gpus: list[Gpu] = []
        self._lanes: dict[int, _Lane] = {}  # by Gpu.index
        self._pids = PidAliases()
        self._round = 0
        self._closed = False
        self._rounds: deque[_Round] = deque()  # started, not handed back yet (in order)
        self._looking: Future[list[str]] | None = None  # ``discover``'s look, while it runs
        self.candidates: list[str] = []  # visible GPUs sampled once the job is seen there
        self.failed = False
        self.hung = False  # a call hung on a control call, or every GPU is wedged now
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

    def discover(self, job_pids: set[int]) -> None:
        """Start a look for the candidate GPUs on whose process lists one of ``job_pids``
        (our pid namespace) shows up: one process-list call per candidate not sampled
        yet, on a thread of its own; ``collect`` adds those found once the look is back.
        A look stuck in a call is not repeated until it returns."""
        waiting = [uuid for uuid in self.candidates if uuid not in self.uuids]
        if not waiting or not job_pids or self.failed or self._closed:
            return
        if self._looking is not None:
            return  # the last look is still under way (or stuck in a call)
        aliases = self._pids.aliases(job_pids)
        looking = Worker("nvml-discover")
        self._looking = looking.submit(
            lambda: [uuid for uuid in waiting if self._runs_on(uuid, aliases)]
        )
        looking.stop()  # its thread ends after this look

    def _look_back(self) -> None:
        """Add the GPUs the last ``discover`` found, once it is back."""
        look = self._looking
        if look is None or not look.done():
            return
        self._looking = None
        if look.exception() is None:
            self.add_uuids(look.result())

    def _runs_on(self, uuid: str, aliases: dict[int, int]) -> bool:
        """Whether a process of the job is on the compute or graphics list of ``uuid``."""
        api, handle = self._api, self._devices[uuid].handle
        for listing in (
            api.nvmlDeviceGetComputeRunningProcesses,
            api.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                if any(proc.pid in aliases for proc in listing(handle)):
                    return True
            except Exception:  # a list this GPU does not give: the other may
                continue
        return False

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
        # its thread started now, not in its first round: a thread's start on a busy
        # machine is not to eat into that round's deadline
        self._lanes[gpu.index] = _Lane(Worker(f"nvml-gpu{gpu.index}"), GpuReader(api, self._pids))
        return uuid

    @property
    def busy(self) -> bool:
        """Whether a round or a look is still out (``collect`` has more to hand back)."""
        return bool(self._rounds) or self._looking is not None

    def start(self, job_pids: set[int], now_ns: int) -> None:
        """Start a round stamped ``now_ns`` (``time.monotonic_ns()`` of this sampling
        round): every job GPU that is not lost, backing off, stuck nor still in an
        earlier round's reading is handed its reading, on its own thread. Never waits;
        ``collect`` hands the round back. A round is started (empty) even when there is
        nothing to sample, so every ``start`` has its round in ``collect``.

        ``job_pids`` are the job's processes (our pid namespace) for the job's GPU memory
        and SM utilization; with none, those two fields are None and not queried (nor in
        rounds where the expensive calls are not due, see ``SLOW_PERIOD_S``)."""
        self._round += 1
        round_no = self._round
        out: list[tuple[Gpu, _Lane, Future[GpuSample | None]]] = []
        self._rounds.append(_Round(now_ns, time.monotonic() + self._timeout_s, out))
        if self.failed or self._closed:
            return
        aliases = self._pids.aliases(job_pids) if job_pids else {}
        entered_ns = time.monotonic_ns()
        for gpu in self._gpus:
            lane = self._lanes[gpu.index]
            if gpu.lost is not None:
                continue
            if lane.reading is not None and not lane.reading.done():
                lane.missed += 1  # still in an earlier round's reading: not waited for
                continue
            if not gpu.guard.allowed("device", round_no):
                continue
            if not lane.ready(self._api, self._pids, f"nvml-gpu{gpu.index}"):
                lane.missed += 1
                continue
            slow = gpu.slow_at_ns is None or now_ns - gpu.slow_at_ns >= self._slow_period_ns
            if slow:
                gpu.slow_at_ns = now_ns
            assert lane.worker is not None
            lane.reading = lane.worker.submit(
                functools.partial(
                    self._sample_one, lane.reader, gpu, aliases, now_ns, round_no, entered_ns, slow
                )
            )
            out.append((gpu, lane, lane.reading))

    def collect(self, wait: bool = False) -> list[tuple[int, list[GpuSample]]]:
        """The rounds whose readings are all back or given up, oldest first, each as its
        stamp and its samples (one per GPU that answered in time); what a finished look
        (``discover``) found is added to the job's GPUs. Without ``wait`` it never waits:
        a round with a reading still out, not past its deadline, stays for a later call
        (and so do the rounds after it). With ``wait`` it waits for every round, each
        reading at most until its round's deadline. Never raises."""
        rounds = []
        while self._rounds:
            current = self._rounds[0]
            self._take(current, wait)
            if current.out:
                break
            rounds.append((current.t_ns, current.samples))
            self._rounds.popleft()
        self._look_back()
        self._note_wedged()
        return rounds

    def _take(self, current: _Round, wait: bool) -> None:
        """Move ``current``'s readings that are back into its samples; give up those past
        its deadline (waiting for them until then with ``wait``)."""
        still = []
        for gpu, lane, future in current.out:
            if wait and not future.done():
                with contextlib.suppress(Exception):  # a timeout, or its error: read below
                    future.result(max(0.0, current.deadline_s - time.monotonic()))
            if not future.done():
                if not wait and time.monotonic() < current.deadline_s:
                    still.append((gpu, lane, future))
                else:
                    future.cancel()  # one still queued is dropped; a running one cannot be
                    self._stalled(gpu, lane)
                continue
            if lane.reading is future:
                lane.reading = None
            error = future.exception()
            if error is not None:  # a bug or an unforeseen binding error: this GPU only
                gpu.lost = f"sampling failed: {error!r}"
                continue
            sample = future.result()
            if sample is not None:
                current.samples.append(sample)
        current.out = still
        current.samples.sort(key=lambda sample: sample.gpu_index)

    def sample(self, job_pids: set[int], now_ns: int) -> list[GpuSample]:
        """``start`` a round and wait for it (every reading at most the round timeout):
        its samples, in ``gpu_index`` order; [] once the sampler has failed. For callers
        that may wait (a run's last round, benchmarks, tests); the sidecar's loop uses
        ``start`` and ``collect``. Never raises."""
        self.start(job_pids, now_ns)
        rounds = self.collect(wait=True)
        return [sample for _, samples in rounds for sample in samples]

    def _sample_one(
        self,
        reader: GpuReader,
        gpu: Gpu,
        aliases: dict[int, int],
        now_ns: int,
        round_no: int,
        entered_ns: int,
        slow: bool,
    ) -> GpuSample | None:
        """One GPU's reading, on its lane's thread; None when it has none this round."""
        try:
            sample = reader.sample(gpu, aliases, now_ns, round_no, entered_ns, slow)
        except GpuLost as exc:
            gpu.lost = str(exc)
            return None
        except GpuSilent as exc:
            gpu.guard.failed("device", "transient", str(exc), round_no)
            return None
        gpu.guard.succeeded("device")
        return sample

    def _stalled(self, gpu: Gpu, lane: _Lane) -> None:
        """``gpu``'s reading missed its round's deadline: back off the call it was in,
        leave its thread to finish on its own; a fresh one starts at its next round."""
        lane.reading = None
        lane.missed += 1
        calling = lane.reader.calling
        if calling is not None:
            _, call = calling
            gpu.guard.failed(
                call,
                "transient",
                f"did not return within {self._timeout_s:g} s",
                self._round,
                weight=3,
            )
        lane.reader.cancel()
        if lane.worker is not None:
            lane.worker.stop()
            lane.stuck.append(lane.worker)
            lane.worker = None

    def _note_wedged(self) -> None:
        """``hung`` while every GPU still sampled has too many calls stuck; it clears as
        soon as one of them comes back. Checked at every look: nothing to count while no
        thread is stuck; a failed sampler keeps its reason."""
        if self.failed or not (self.hung or any(lane.stuck for lane in self._lanes.values())):
            return
        live = [gpu for gpu in self._gpus if gpu.lost is None]
        wedged = [gpu for gpu in live if self._lanes[gpu.index].wedged]
        self.hung = bool(live) and len(wedged) == len(live)
        self.reason = (
            f"NVML calls did not return within {self._timeout_s:g} s on every GPU "
            f"({sum(len(self._lanes[g.index].stuck) for g in wedged)} calls stuck); "
            "retried as they come back"
            if self.hung
            else None
        )

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the control thread (adding GPUs, shutdown). A timeout or an
        unexpected error fails the sampler with a reason. Returns None where there is no
        result."""
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

    def status(self) -> dict[str, Any]:
        """For ``sidecar status``: on/off, the reason when off, and per GPU its UUID, name,
        lost flag and reason, power source, the calls switched off (with why), the calls
        waiting for a retry, notes on figures unknown, for a MIG instance the whole GPU
        whose power and energy it shares, its threads stuck in a call and the rounds it
        missed (late, still in an earlier reading, or stuck)."""
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
                "stuck_calls": len(self._lanes[gpu.index].stuck),
                "missed_rounds": self._lanes[gpu.index].missed,
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
        for lane in self._lanes.values():
            if lane.worker is not None:
                lane.worker.stop()

    def _shutdown(self) -> None:
        api = self._api
        for gpu in self._gpus:
            for buffer in gpu.gpm or ():
                with contextlib.suppress(Exception):
                    api.nvmlGpmSampleFree(buffer)
        with contextlib.suppress(Exception):
            api.nvmlShutdown()
