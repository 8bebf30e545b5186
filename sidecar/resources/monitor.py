"""Resource sampling for the splits a sidecar serves: NVML and the jobs' process trees on
one drift-free schedule, kept per split, with the GPU utilization and power during each
phase attributed as the records arrive (``docs/samplers.md``).

NVML is opened on a background thread (``nvmlInit`` can take seconds), so a sidecar
answers its first hello at once; until it is open, GPU sampling is pending.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from markers import wire
from markers.wire import P_END, P_PHASE, P_START
from sidecar.model.split import Split
from sidecar.resources.samplers import nvml
from sidecar.resources.samplers.host import HostSample, HostSampler
from sidecar.resources.samplers.schedule import Schedule
from sidecar.resources.samplers.summary import (
    GpuSummary,
    HostSummary,
    PhaseAttribution,
    attribute_phases,
)
from sidecar.resources.sessions import summarize_gpus_over_sessions, summarize_host_over_sessions

log = logging.getLogger("sidecar")

# Records reach the sidecar up to the markers' flush age (50 ms) after they end, GPU
# phases later still; a sampling window is attributed once it is this old.
SETTLE_NS = 2_000_000_000
# Sampling rounds kept per split; past it every other round is dropped (resolution halves).
MAX_ROUNDS = 50_000


@dataclass
class _Attribution:
    """Running sums of the per-phase attribution of one split."""

    covered_s: float = 0.0
    n_samples: int = 0
    util: list[float] = field(default_factory=lambda: [0.0, 0.0])  # weighted sum, weight
    power: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def add(self, part: PhaseAttribution) -> None:
        self.covered_s += part.covered_s
        self.n_samples += part.n_samples
        for acc, value in ((self.util, part.util_mean_pct), (self.power, part.power_mean_w)):
            if value is not None:
                acc[0] += value * part.covered_s
                acc[1] += part.covered_s

    def result(self) -> PhaseAttribution:
        return PhaseAttribution(
            covered_s=self.covered_s, n_samples=self.n_samples,
            util_mean_pct=self.util[0] / self.util[1] if self.util[1] else None,
            power_mean_w=self.power[0] / self.power[1] if self.power[1] else None)


class SplitResources:
    """Samples of one split's processes and GPUs, and its phase attribution so far."""

    def __init__(self, pid: int) -> None:
        self.host = HostSampler([pid])
        self.host_samples: list[HostSample] = []
        self.gpu_samples: list[nvml.GpuSample] = []
        self.intervals: deque[tuple[str, int, int]] = deque()  # rank 0's recent phases
        self.attributed_ns = 0  # rounds up to this time are attributed
        self.attribution: dict[str, _Attribution] = {}
        self.closed = False  # the split ended and its last round was taken
        # running figures for the live view (/metrics), kept past thinning
        self.cpu_s = 0.0  # CPU time of the job's tree: cpu_pct integrated over the rounds
        self.latest_gpu: dict[str, nvml.GpuSample] = {}  # per UUID
        self.first_energy_j: dict[str, float] = {}  # per UUID: the first counter reading

    def add_host(self, sample: HostSample) -> None:
        """Keep a host sample and add its CPU time (psutil's cpu_percent is the mean over
        the time since the previous reading, so percent × window is CPU seconds)."""
        if self.host_samples:
            window_s = (sample.t_ns - self.host_samples[-1].t_ns) / 1e9
            self.cpu_s += sample.cpu_pct / 100.0 * window_s
        self.host_samples.append(sample)

    def add_gpus(self, samples: list[nvml.GpuSample]) -> None:
        """Keep GPU samples and note each GPU's latest and first energy reading."""
        self.gpu_samples += samples
        for sample in samples:
            self.latest_gpu[sample.uuid] = sample
            if sample.energy_j is not None:
                self.first_energy_j.setdefault(sample.uuid, sample.energy_j)

    def thin(self) -> None:
        """Halve the rounds kept once there are MAX_ROUNDS (bounded memory on long runs)."""
        if len(self.host_samples) < MAX_ROUNDS:
            return
        kept = {s.t_ns for s in self.host_samples[::2]}
        self.host_samples = [s for s in self.host_samples if s.t_ns in kept]
        self.gpu_samples = [s for s in self.gpu_samples if s.t_ns in kept]

    def attribute(self, until_ns: int) -> None:
        """Fold the sampling windows that end by ``until_ns`` into the attribution."""
        rounds = sorted({s.t_ns for s in self.gpu_samples if s.t_ns > self.attributed_ns
                         and s.t_ns <= until_ns})
        if not rounds:
            return
        opening = self.attributed_ns or rounds[0]
        chunk = [s for s in self.gpu_samples if opening <= s.t_ns <= rounds[-1]]
        intervals = [i for i in self.intervals if i[2] > opening and i[1] < rounds[-1]]
        for label, part in attribute_phases(chunk, intervals).items():
            self.attribution.setdefault(label, _Attribution()).add(part)
        self.attributed_ns = rounds[-1]
        while self.intervals and self.intervals[0][2] <= self.attributed_ns:
            self.intervals.popleft()


@dataclass(frozen=True)
class ResourceFigures:
    """What the monitor knows of one split's resources, for the writers to lay out.

    ``gpu_off_reason`` set means GPU sampling was off (or stopped); ``run_start_ns`` is the
    monotonic time (ns) of the run's start, the origin of resources.tsv's time column;
    ``session_starts_ns`` when each session (process) of rank 0 started, on that clock.
    Samples of earlier sessions (restored on resume) are included; the summaries are
    taken per session and merged (``sidecar.resources.sessions``).
    """

    gpus: list[GpuSummary]
    host: HostSummary | None
    gpu_off_reason: str | None
    attribution: dict[str, PhaseAttribution]
    gpu_samples: list[nvml.GpuSample]
    host_samples: list[HostSample]
    run_start_ns: int
    session_starts_ns: list[int] = field(default_factory=list)


class ResourceMonitor:
    """Samples on a schedule for every split it watches.

    ``visible_devices`` is the job's CUDA_VISIBLE_DEVICES (a job's own sidecar) or None
    (every GPU); ``all_splits_share_gpus`` says whether a split without reported GPUs
    takes every sampled one (a job's own sidecar) or none (the node daemon).
    """

    def __init__(self, interval_s: float, visible_devices: str | None,
                 all_splits_share_gpus: bool,
                 open_gpus: Callable[[str | None], Any] = nvml.open_nvml) -> None:
        self.interval_s = interval_s
        self.all_splits_share_gpus = all_splits_share_gpus
        self.splits: dict[int, tuple[Split, SplitResources]] = {}
        self.gpus: nvml.NvmlSampler | None = None
        self.gpu_off_reason: str | None = "starting NVML"
        self._schedule = Schedule(interval_s, time.monotonic_ns())
        self._pending_uuids: set[str] = set()
        self.last_round_monotonic: float | None = None  # when the last due round completed
        # Set once an NVML call hung: rounds no longer count as complete, so the node
        # daemon's watchdog stops and systemd restarts it (a fresh NVML in a new process).
        self.hung_reason: str | None = None
        self._opener = threading.Thread(target=self._open, args=(visible_devices, open_gpus),
                                        name="nvml-open", daemon=True)
        self._opener.start()

    def _open(self, visible_devices: str | None, open_gpus: Callable[[str | None], Any]) -> None:
        result = open_gpus(visible_devices)
        if isinstance(result, nvml.NvmlSampler):
            self.gpus, self.gpu_off_reason = result, None
            log.info("GPU sampling on: %s", ", ".join(result.uuids))
        else:
            self.gpu_off_reason = result.reason
            log.warning("GPU sampling off: %s", result.reason)

    # -- what to watch --------------------------------------------------------------

    def watch(self, split: Split, pid: int) -> bool:
        """Sample ``pid``'s process tree (with the split's GPUs) for ``split``; True when
        the split is new to the monitor (its earlier sessions' samples are not here)."""
        entry = self.splits.get(id(split))
        if entry is None:
            resources = SplitResources(pid)
            # A first host round now: the baseline of CPU time and the starting memory.
            resources.add_host(resources.host.sample(time.monotonic_ns()))
            self.splits[id(split)] = (split, resources)
            return True
        entry[1].host.add_root(pid)
        return False

    def restore(self, split: Split, gpu_samples: list[nvml.GpuSample],
                host_samples: list[HostSample]) -> None:
        """Put the samples of ``split``'s earlier sessions (read back from its folder on a
        resume) before the ones taken here; they are never attributed to phases again."""
        entry = self.splits.get(id(split))
        if entry is None:
            return
        resources = entry[1]
        resources.gpu_samples[:0] = gpu_samples
        resources.host_samples[:0] = host_samples
        # The first window of this session opens at its own first round, not at the last
        # restored one (the downtime between them is nobody's).
        resources.attributed_ns = max([resources.attributed_ns]
                                      + [s.t_ns + 1 for s in gpu_samples])

    def forget(self, split: Split) -> None:
        """Stop keeping ``split``'s samples (it ended and was written)."""
        self.splits.pop(id(split), None)

    def add_gpu(self, uuid: str) -> None:
        """A GPU a job reported using: sample it too."""
        self._pending_uuids.add(uuid)

    def note_records(self, split: Split, rank: int, values: np.ndarray) -> None:
        """Keep rank 0's phase intervals for the attribution (called per RECORDS message
        with its decoded records, see ``sidecar.ingest.records``)."""
        entry = self.splits.get(id(split))
        if entry is None or rank != 0 or self.gpus is None:
            return
        names = split.rank(0).custom_names
        phases = values[:, P_PHASE].tolist()
        labels = {phase: wire.phase_label(phase, names) for phase in set(phases)}
        entry[1].intervals.extend(zip(map(labels.__getitem__, phases),
                                      values[:, P_START].tolist(), values[:, P_END].tolist(),
                                      strict=True))

    # -- sampling -------------------------------------------------------------------

    def wait_s(self) -> float:
        """Seconds until the next round is due."""
        return self._schedule.wait_s(time.monotonic_ns())

    def tick(self) -> None:
        """Take a sampling round if one is due (host for every live split, GPUs once)."""
        now_ns = time.monotonic_ns()
        if not self._schedule.due(now_ns):
            return
        self._schedule.advance(now_ns)
        self._sample([(s, r) for s, r in self.splits.values() if s.status == "running"],
                     now_ns)
        if self.hung_reason is None:
            self.last_round_monotonic = time.monotonic()

    def _sample(self, live: list[tuple[Split, SplitResources]], now_ns: int) -> None:
        if not live:
            return
        gpu_samples = self._sample_gpus(live, now_ns)
        for split, resources in live:
            resources.add_host(resources.host.sample(now_ns))
            resources.add_gpus(self._for_split(split, gpu_samples))
            resources.thin()
            resources.attribute(now_ns - SETTLE_NS)

    def _sample_gpus(self, live: list[tuple[Split, SplitResources]],
                     now_ns: int) -> list[nvml.GpuSample]:
        gpus = self.gpus
        if gpus is None:
            return []
        if self._pending_uuids:
            gpus.add_uuids(self._pending_uuids)
            self._pending_uuids.clear()
        pids = set().union(*(r.host.pids for _, r in live))
        samples = gpus.sample(pids, now_ns)
        if gpus.failed:
            self.gpu_off_reason = f"stopped: {gpus.reason}"
            log.error("GPU sampling %s", self.gpu_off_reason)
            self.gpus = None
            if gpus.hung:
                self.hung_reason = gpus.reason
        return samples

    def _for_split(self, split: Split, samples: list[nvml.GpuSample]) -> list[nvml.GpuSample]:
        if split.gpus:
            uuids = {uuid for uuid, _ in split.gpus}
            return [s for s in samples if s.uuid in uuids]
        return samples if self.all_splits_share_gpus else []

    # -- reporting ------------------------------------------------------------------

    def final_round(self, split: Split) -> None:
        """A last sampling round for a split that ended, and the attribution of all it
        sampled, once: a run shorter than the interval gets figures too."""
        entry = self.splits.get(id(split))
        if entry is None or entry[1].closed or split.status == "running":
            return
        resources = entry[1]
        resources.closed = True
        self._sample([entry], time.monotonic_ns())
        resources.attribute(time.monotonic_ns())

    def figures(self, split: Split) -> ResourceFigures:
        """Everything sampled for ``split`` so far, summarized; takes no sample itself."""
        entry = self.splits.get(id(split))
        if entry is None:
            return ResourceFigures([], None, "no process of this run was watched", {}, [], [],
                                   0)
        resources = entry[1]
        off_reason = self.gpu_off_reason
        if off_reason is None and not resources.gpu_samples and not split.gpus:
            off_reason = "the job used no GPU"
        run_start_ns, starts_ns = self.session_starts_ns(split)
        return ResourceFigures(
            summarize_gpus_over_sessions(resources.gpu_samples, starts_ns),
            summarize_host_over_sessions(resources.host_samples, starts_ns)
            if resources.host_samples else None,
            off_reason, {label: a.result() for label, a in resources.attribution.items()},
            resources.gpu_samples, resources.host_samples, run_start_ns, starts_ns)

    @staticmethod
    def session_starts_ns(split: Split) -> tuple[int, list[int]]:
        """The run's start and each session's start of ``split``'s rank 0 on this process's
        monotonic clock (ns); (0, []) before rank 0 said hello."""
        agg = split.ranks.get(0)
        if agg is None or not agg.sessions:
            return 0, []
        session = agg.sessions[-1]
        run_start_ns = session.start_ns - int((session.start_unix - agg.run_start_unix) * 1e9)
        return run_start_ns, [run_start_ns + int((s.start_unix - agg.run_start_unix) * 1e9)
                              for s in agg.sessions]

    def live(self, split: Split) -> SplitResources | None:
        """The running samples and figures of ``split`` (None when it is not watched);
        read on the loop thread only."""
        entry = self.splits.get(id(split))
        return entry[1] if entry is not None else None

    def started(self) -> bool:
        """True once NVML is opened or found unavailable (its opener thread ended)."""
        return not self._opener.is_alive()

    def gpu_status(self) -> list[dict[str, Any]]:
        """Per sampled GPU: index, uuid, name, whether NVML still answers for it (``lost``
        and why) and the calls it does not support, with NVML's reason
        (``NvmlSampler.status``); [] while GPU sampling is off."""
        gpus = self.gpus
        return gpus.status()["gpus"] if gpus is not None else []

    def close(self) -> None:
        """Stop GPU sampling (NVML shutdown, bounded)."""
        if self.gpus is not None:
            self.gpus.close()
