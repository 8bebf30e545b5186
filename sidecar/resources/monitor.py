"""Resource sampling for the splits a sidecar serves: NVML and the jobs' process trees on
one drift-free schedule, kept per split, with the GPU utilization and power during each
phase attributed as the records arrive (``docs/samplers.md``).

NVML is opened on a background thread (``nvmlInit`` can take seconds), so a sidecar
answers its first hello at once; until it is open, GPU sampling is pending. A GPU round
is started when due and its samples are taken in at a later ``tick`` (the loop's next
look), never waited for: records keep being received while a GPU is slow.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from markers import wire
from markers.wire import P_END, P_GPU, P_LAG, P_PHASE, P_START
from sidecar.model.aggregator import RecordValues
from sidecar.model.split import Split
from sidecar.model.straggler_gpu import READING_COLUMNS
from sidecar.resources import fields
from sidecar.resources.samplers import nvml
from sidecar.resources.samplers.folding import (
    GpuSummary,
    HostSummary,
    PhaseAttribution,
    attribute_phases,
)
from sidecar.resources.samplers.host import HostSample, HostSampler
from sidecar.resources.samplers.nvml_devices import uuid_key
from sidecar.resources.samplers.schedule import Schedule
from sidecar.resources.sessions import summarize_gpus_over_sessions, summarize_host_over_sessions

log = logging.getLogger("sidecar")

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
            covered_s=self.covered_s,
            n_samples=self.n_samples,
            util_mean_pct=self.util[0] / self.util[1] if self.util[1] else None,
            power_mean_w=self.power[0] / self.power[1] if self.power[1] else None,
        )


class SplitResources:
    """Samples of one split's processes and GPUs, and its phase attribution so far."""

    def __init__(self, pid: int) -> None:
        self.host = HostSampler([pid])
        self.host_samples: list[HostSample] = []
        self.gpu_samples: list[nvml.GpuSample] = []
        self.gpu_ts: list[int] = []  # t_ns of gpu_samples (appended in time order)
        # rank 0's phase intervals not attributed yet (label index, start, end: arrays of
        # rows): those that end after the last round; a late record waits here at most
        # until the next round
        self.waiting: list[np.ndarray] = []
        self.labels: dict[str, int] = {}  # label -> its index in ``waiting``
        self.attribution: dict[str, _Attribution] = {}
        self.attributable_from_ns = 0  # rounds before it (earlier sessions) open no window
        self.closed = False  # the split ended and its last round was taken
        # running figures for the live view (/metrics), kept past thinning
        # per host field with an "integral" gauge: value × window summed over the rounds
        # (psutil's cpu_percent is the mean since the previous reading: % × s)
        self.integrals: dict[str, float] = {}
        self.latest_gpu: dict[str, nvml.GpuSample] = {}  # per UUID
        # per UUID, per GPU field with a "since_first" gauge: the first reading
        self.first_gpu: dict[str, dict[str, float]] = {}

    def add_host(self, sample: HostSample) -> None:
        """Keep a host sample and add to the integrals of the host fields that have one."""
        if self.host_samples:
            window_s = (sample.t_ns - self.host_samples[-1].t_ns) / 1e9
            for item in fields.HOST_FIELDS:
                value = getattr(sample, item.attribute)
                if item.gauge is not None and item.gauge.value == "integral" and value is not None:
                    self.integrals[item.attribute] = (
                        self.integrals.get(item.attribute, 0.0) + value * window_s
                    )
        self.host_samples.append(sample)

    def add_gpus(self, samples: list[nvml.GpuSample]) -> None:
        """Keep GPU samples and note each GPU's latest sample and first readings."""
        self.gpu_samples += samples
        self.gpu_ts += [s.t_ns for s in samples]
        for sample in samples:
            self.latest_gpu[sample.uuid] = sample
            first = self.first_gpu.setdefault(sample.uuid, {})
            for item in fields.GPU_FIELDS:
                value = getattr(sample, item.attribute)
                if (
                    item.gauge is not None
                    and item.gauge.value == "since_first"
                    and value is not None
                ):
                    first.setdefault(item.attribute, value)

    def thin(self, from_ns: int) -> None:
        """Halve the rounds kept before ``from_ns`` once there are MAX_ROUNDS (bounded
        memory on long runs); rounds from ``from_ns`` on (whose GPU samples may still
        come) are all kept."""
        if len(self.host_samples) < MAX_ROUNDS:
            return
        older = [s.t_ns for s in self.host_samples if s.t_ns < from_ns]
        kept = set(older[::2]) | {s.t_ns for s in self.host_samples if s.t_ns >= from_ns}
        self.host_samples = [s for s in self.host_samples if s.t_ns in kept]
        self.gpu_samples = [s for s in self.gpu_samples if s.t_ns in kept]
        self.gpu_ts = [s.t_ns for s in self.gpu_samples]

    def wait(
        self, phases: np.ndarray, names: dict[int, str], starts_ns: np.ndarray, ends_ns: np.ndarray
    ) -> None:
        """Keep intervals of ``phases`` (keys, named by ``names`` for custom ones) until
        the round after their end."""
        keys, which = np.unique(phases, return_inverse=True)
        index = np.array(
            [
                self.labels.setdefault(wire.phase_label(key, names), len(self.labels))
                for key in keys.tolist()
            ],
            dtype=np.int64,
        )
        self.waiting.append(np.column_stack((index[which], starts_ns, ends_ns)))

    def latest_end_ns(self) -> int:
        """The latest end of a waiting interval (0 when none waits)."""
        return max((int(part[:, 2].max()) for part in self.waiting if len(part)), default=0)

    def attribute(self, until_ns: int) -> None:
        """Fold the waiting intervals that end by ``until_ns`` (the last round) into the
        attribution, against the rounds around them: however late a record arrives, the
        samples of its time are still kept."""
        if not self.waiting:
            return
        waiting = np.concatenate(self.waiting)
        ends_now = waiting[:, 2] <= until_ns
        ready = waiting[ends_now]
        self.waiting = [waiting[~ends_now]] if not ends_now.all() else []
        if not len(ready):
            return
        ts = self.gpu_ts
        # the round before the earliest start opens its window; the one after the latest
        # end closes the last
        low = max(0, bisect.bisect_right(ts, int(ready[:, 1].min())) - 1)
        high = bisect.bisect_left(ts, int(ready[:, 2].max())) + 1
        while high < len(ts) and ts[high] == ts[high - 1]:
            high += 1  # every GPU of the closing round
        while low > 0 and ts[low - 1] == ts[low]:
            low -= 1
        low = max(low, bisect.bisect_left(ts, self.attributable_from_ns))
        labels = list(self.labels)
        for index, part in attribute_phases(
            self.gpu_samples[low:high], ready[:, 0], ready[:, 1], ready[:, 2]
        ).items():
            self.attribution.setdefault(labels[index], _Attribution()).add(part)


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

    def gpu_readings(self, uuid: str, from_ns: int, to_ns: int) -> np.ndarray:
        """``gpu_readings`` of these samples."""
        return gpu_readings(self.gpu_samples, uuid, from_ns, to_ns)


def gpu_readings(
    samples: Sequence[nvml.GpuSample], uuid: str, from_ns: int, to_ns: int
) -> np.ndarray:
    """The ``samples`` (in time order) of the GPU ``uuid`` (by its hex part: a MIG
    instance may be named GPU-... or MIG-...) taken from ``from_ns`` to ``to_ns``
    (monotonic ns) as the straggler view takes them (``merge.figures_of``): rows of t_ns,
    then ``straggler_gpu.READING_COLUMNS``, NaN unknown. Only that span is read, so the
    cost follows the stored iterations, not the run's length."""
    key = uuid_key(uuid)
    low = bisect.bisect_left(samples, from_ns, key=lambda s: s.t_ns)
    high = bisect.bisect_right(samples, to_ns, key=lambda s: s.t_ns)
    rows = [
        [s.t_ns, *(getattr(s, name) for name in READING_COLUMNS)]
        for s in samples[low:high]
        if uuid_key(s.uuid) == key
    ]
    return np.array(rows, dtype=float).reshape(-1, 1 + len(READING_COLUMNS))


def _claim_gpus(split: Split, pids: set[int], samples: list[nvml.GpuSample]) -> None:
    """Add to ``split``'s GPUs every sampled GPU whose process lists show one of its
    ``pids``: a process on several GPUs (``device_map``, DataParallel) reports one, and
    its run's GPU list, utilization, power and energy must cover them all."""
    known = {uuid_key(uuid) for uuid, _ in split.gpus}
    for sample in samples:
        key = uuid_key(sample.uuid)
        if sample.job_pids and pids.intersection(sample.job_pids) and key not in known:
            split.add_gpu(sample.uuid, sample.name)
            known.add(key)


class ResourceMonitor:
    """Samples on a schedule for every split it watches.

    ``visible_devices`` is the job's CUDA_VISIBLE_DEVICES (a job's own sidecar) or None
    (every GPU); ``all_splits_share_gpus`` says whether a split without reported GPUs
    takes every sampled one (a job's own sidecar) or none (the node daemon).
    ``clock_ns`` is the monotonic clock the schedule and the samples' stamps read (ns;
    the markers' records are on ``time.monotonic_ns``): a test seam, never changed in use.
    ``private``: a private sidecar of one process (one rank), which samples only the GPUs
    that process uses: those it reports and those whose process lists show it
    (``open_gpus`` is called with ``candidates_only=True``), not every GPU it may see.
    """

    def __init__(
        self,
        interval_s: float,
        visible_devices: str | None,
        all_splits_share_gpus: bool,
        open_gpus: Callable[..., Any] = nvml.open_nvml,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        private: bool = False,
    ) -> None:
        self.interval_s = interval_s
        self.private = private
        self._next_look_ns = 0  # when to look for the job on the GPUs not sampled yet
        self._clock_ns = clock_ns
        self.all_splits_share_gpus = all_splits_share_gpus
        self.splits: dict[int, tuple[Split, SplitResources]] = {}
        self.gpus: nvml.NvmlSampler | None = None
        self.gpu_off_reason: str | None = "starting NVML"
        self._schedule = Schedule(interval_s, clock_ns())
        self._pending_uuids: set[str] = set()
        # GPU rounds started and not taken in yet, in order: their stamp and the splits
        # live then (``NvmlSampler.collect`` hands them back in the same order)
        self._rounds_out: deque[tuple[int, list[tuple[Split, SplitResources]]]] = deque()
        # when the last due round started (s, on ``clock_ns``: time.monotonic's clock)
        self.last_round_monotonic: float | None = None
        # Set once an NVML call hung: rounds no longer count as complete, so the node
        # daemon's watchdog stops and systemd restarts it (a fresh NVML in a new process).
        self.hung_reason: str | None = None
        self._opener = threading.Thread(
            target=self._open, args=(visible_devices, open_gpus), name="nvml-open", daemon=True
        )
        self._opener.start()

    def _open(self, visible_devices: str | None, open_gpus: Callable[..., Any]) -> None:
        result = (
            open_gpus(visible_devices, candidates_only=True)
            if self.private
            else open_gpus(visible_devices)
        )
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
            resources.add_host(resources.host.sample(self._clock_ns()))
            self.splits[id(split)] = (split, resources)
            return True
        entry[1].host.add_root(pid)
        return False

    def restore(
        self, split: Split, gpu_samples: list[nvml.GpuSample], host_samples: list[HostSample]
    ) -> None:
        """Put the samples of ``split``'s earlier sessions (read back from its folder on a
        resume) before the ones taken here; they are never attributed to phases again."""
        entry = self.splits.get(id(split))
        if entry is None:
            return
        resources = entry[1]
        resources.gpu_samples[:0] = gpu_samples
        resources.gpu_ts[:0] = [s.t_ns for s in gpu_samples]
        resources.host_samples[:0] = host_samples
        # The first window of this session opens at its own first round, not at the last
        # restored one (the downtime between them is nobody's).
        resources.attributable_from_ns = max(
            [resources.attributable_from_ns] + [s.t_ns + 1 for s in gpu_samples]
        )

    def forget(self, split: Split) -> None:
        """Stop keeping ``split``'s samples (it ended and was written)."""
        self.splits.pop(id(split), None)

    def add_gpu(self, uuid: str) -> None:
        """A GPU a job reported using: sample it too."""
        self._pending_uuids.add(uuid)

    def note_records(self, split: Split, rank: int, values: RecordValues) -> None:
        """Keep rank 0's phase intervals for the attribution (called with the records of
        each read; records × ``wire.RECORD_WIDTH``, or flat values).

        A phase with a GPU time is placed where the GPU ran it: from its host start plus
        the GPU lag the markers measured, for its GPU time; other phases on host time.
        """
        entry = self.splits.get(id(split))
        if entry is None or rank != 0 or self.gpus is None:
            return
        records = np.asarray(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)
        if not len(records):
            return
        gpu_ns = records[:, P_GPU]
        on_gpu = gpu_ns >= 0
        # on the GPU: from the host start plus the lag, for the GPU time
        starts_ns = records[:, P_START] + np.where(on_gpu, np.maximum(records[:, P_LAG], 0), 0)
        ends_ns = np.where(on_gpu, starts_ns + gpu_ns, records[:, P_END])
        entry[1].wait(records[:, P_PHASE], split.rank(0).custom_names, starts_ns, ends_ns)

    # -- sampling -------------------------------------------------------------------

    def wait_s(self) -> float:
        """Seconds until the next round is due."""
        return self._schedule.wait_s(self._clock_ns())

    @property
    def collecting(self) -> bool:
        """Whether GPU readings are still out (a later ``tick`` takes them in)."""
        gpus = self.gpus
        return gpus is not None and gpus.busy

    def tick(self) -> None:
        """Take in the GPU readings that are back, and start a sampling round if one is
        due (host for every live split now, GPUs on their threads). Never waits for a
        GPU: a reading still out is taken in at a later call."""
        self._take_in(wait=False)
        now_ns = self._clock_ns()
        if not self._schedule.due(now_ns):
            return
        self._schedule.advance(now_ns)
        self._sample([(s, r) for s, r in self.splits.values() if s.status == "running"], now_ns)
        if self.hung_reason is None:
            self.last_round_monotonic = self._clock_ns() / 1e9

    def _sample(
        self, live: list[tuple[Split, SplitResources]], now_ns: int, last: bool = False
    ) -> None:
        """Host samples of the ``live`` splits now (with their USS when ``last``: a run's
        last round); a GPU round started for them."""
        if not live:
            return
        self._start_gpus(live, now_ns)
        from_ns = self._rounds_out[0][0] if self._rounds_out else now_ns
        for _, resources in live:
            resources.add_host(resources.host.sample(now_ns, uss=last))
            resources.thin(from_ns)
            if self.gpus is None:  # no GPU round to wait for (GPU sampling off or stopped)
                resources.attribute(now_ns)

    def _start_gpus(self, live: list[tuple[Split, SplitResources]], now_ns: int) -> None:
        gpus = self.gpus
        if gpus is None:
            return
        if self._pending_uuids:
            gpus.add_uuids(self._pending_uuids)
            self._pending_uuids.clear()
        pids = set().union(*(r.host.pids for _, r in live))
        if gpus.candidates and now_ns >= self._next_look_ns:
            self._next_look_ns = now_ns + round(nvml.SLOW_PERIOD_S * 1e9)
            gpus.discover(pids)
        gpus.start(pids, now_ns)
        self._rounds_out.append((now_ns, live))

    def _take_in(self, wait: bool) -> None:
        """Hand the GPU rounds that are back to the splits live when each started (with
        ``wait``: every round out, each reading waited for until its deadline), and note
        whether GPU sampling failed or stalled."""
        gpus = self.gpus
        if gpus is None:
            return
        for t_ns, samples in gpus.collect(wait):
            _, live = self._rounds_out.popleft()
            for split, resources in live:
                if self.splits.get(id(split)) is None:
                    continue  # forgotten since
                _claim_gpus(split, resources.host.pids, samples)
                resources.add_gpus(self._for_split(split, samples))
                resources.attribute(t_ns)
        if gpus.failed:
            self.gpu_off_reason = f"stopped: {gpus.reason}"
            log.error("GPU sampling %s", self.gpu_off_reason)
            self.gpus = None
            self._rounds_out.clear()
            if gpus.hung:
                self.hung_reason = gpus.reason
        elif gpus.hung != (self.hung_reason is not None):
            # every GPU is stuck in a call (a wedged driver), or one came back: sampling
            # resumes by itself, the watchdog pauses meanwhile
            self.hung_reason = gpus.reason if gpus.hung else None
            self.gpu_off_reason = f"stalled: {gpus.reason}" if gpus.hung else None
            log.warning("GPU sampling %s", self.gpu_off_reason or "resumed")

    def _for_split(self, split: Split, samples: list[nvml.GpuSample]) -> list[nvml.GpuSample]:
        if split.gpus:
            # by the UUID's hex part: a MIG instance may be reported as GPU-... or MIG-...
            uuids = {uuid_key(uuid) for uuid, _ in split.gpus}
            return [s for s in samples if uuid_key(s.uuid) in uuids]
        return samples if self.all_splits_share_gpus else []

    # -- reporting ------------------------------------------------------------------

    def final_round(self, split: Split) -> None:
        """A last sampling round for a split that ended, and the attribution of all it
        sampled, once: a run shorter than the interval gets figures too. The one place
        the loop waits for GPU readings (once per run, each at most the round timeout):
        the run's figures are written next."""
        entry = self.splits.get(id(split))
        if entry is None or entry[1].closed or split.status == "running":
            return
        resources = entry[1]
        resources.closed = True
        self._take_in(wait=True)
        self._sample([entry], self._clock_ns(), last=True)
        self._take_in(wait=True)
        # what ends after the last round (GPU work the markers timed beyond it) still
        # gets the overlap it has with the sampled windows
        resources.attribute(resources.latest_end_ns())

    def figures(self, split: Split) -> ResourceFigures:
        """Everything sampled for ``split`` so far, summarized; takes no sample itself."""
        entry = self.splits.get(id(split))
        if entry is None:
            return ResourceFigures([], None, "no process of this run was watched", {}, [], [], 0)
        resources = entry[1]
        off_reason = self.gpu_off_reason
        if off_reason is None and not resources.gpu_samples and not split.gpus:
            off_reason = "the job used no GPU"
        run_start_ns, starts_ns = self.session_starts_ns(split)
        return ResourceFigures(
            summarize_gpus_over_sessions(resources.gpu_samples, starts_ns),
            summarize_host_over_sessions(resources.host_samples, starts_ns)
            if resources.host_samples
            else None,
            off_reason,
            {label: a.result() for label, a in resources.attribution.items()},
            resources.gpu_samples,
            resources.host_samples,
            run_start_ns,
            starts_ns,
        )

    @staticmethod
    def session_starts_ns(split: Split) -> tuple[int, list[int]]:
        """The run's start and each session's start of ``split``'s rank 0 on this process's
        monotonic clock (ns); (0, []) before rank 0 said hello."""
        agg = split.ranks.get(0)
        if agg is None or not agg.sessions:
            return 0, []
        session = agg.sessions[-1]
        run_start_ns = session.start_ns - int((session.start_unix - agg.run_start_unix) * 1e9)
        return run_start_ns, [
            run_start_ns + int((s.start_unix - agg.run_start_unix) * 1e9) for s in agg.sessions
        ]

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
