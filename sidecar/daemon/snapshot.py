"""The frozen view of a sidecar that its loop publishes each tick. Readers on other threads
(``/metrics``) and the status control read a snapshot, never live state.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sidecar.ingest.streams import Registry
from sidecar.model.aggregator import RankAggregator
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor, SplitResources
from sidecar.resources.samplers.nvml import GpuSample


@dataclass(frozen=True)
class RunView:
    """One training process (stream) as the status view shows it."""

    run_id: str  # hex
    out_dir: str
    split: int
    rank: int
    pid: int
    host: str
    records: int  # records received from it
    status: str  # running, completed, failed, incomplete
    write_error: str | None
    job_id: str | None  # the Slurm job id the run reported
    user: str | None  # the kernel's word on an ipc socket, else what the run reported


@dataclass(frozen=True)
class Snapshot:
    """The sidecar at one turn of its loop. Counts are records since the sidecar started."""

    pid: int
    endpoint: str
    root: str | None
    taken_unix: float  # wall clock when taken
    loop_monotonic: float  # time.monotonic() of the loop turn that took it
    sampler_round_monotonic: float | None  # when the samplers last completed a round
    samplers_started: bool  # every sampler is set up (NVML opened, or found unavailable)
    records: int
    dropped: int
    lost: int
    rejected: int
    rejected_by_kind: dict[str, int]
    last_error: str | None
    records_per_s: float  # over the trailing window below
    rate_window_s: float  # seconds the record rate covers (up to RATE_WINDOW_S)
    samplers: dict[str, Any]  # host, gpu (on / off with the reason), interval_s
    runs: tuple[RunView, ...]
    splits: tuple[SplitView, ...] = ()  # what /metrics exports

    def as_status(self) -> dict[str, Any]:
        """The status view (``sidecar status --json``): JSON-compatible."""
        view = {name: value for name, value in vars(self).items() if name != "splits"}
        view["runs"] = [asdict(run) for run in self.runs]
        return view


@dataclass(frozen=True)
class PhaseStats:
    """Streaming figures of one phase of one rank: every post-warmup measurement."""

    phase: int  # wire id
    name: str  # the user's name of a custom phase, '' for a standard one
    count: int
    sum_s: float
    gpu_count: int
    gpu_sum_s: float


@dataclass(frozen=True)
class RankView:
    """One rank of a split: its phases, Training time and the samples of its measured
    iterations (each with its own batch size, × accumulation per step; across resumes;
    None while no batch size is known)."""

    rank: int
    phases: tuple[PhaseStats, ...]
    training_s: float
    train_samples: int | None
    val_samples: int | None


@dataclass(frozen=True)
class GpuView:
    """The latest sample of one GPU of a split (None where unsupported) and its energy
    since the split's first sample of it."""

    index: int
    uuid: str
    model: str
    util_pct: float | None
    mem_used_mib: float | None
    job_mem_mib: float | None
    power_w: float | None
    energy_j: float | None
    temperature_c: float | None


@dataclass(frozen=True)
class SplitView:
    """One split (one run folder and split) with what ``/metrics`` exports of it. ``run_id``
    is the run id of the split's first process (the ``run_id`` of its run.json)."""

    run_id: str
    user: str
    host: str
    slurm_job_id: str
    split: int
    status: str
    ranks: tuple[RankView, ...]
    records: dict[str, int]  # received, dropped, lost, rejected
    gpus: tuple[GpuView, ...]
    cpu_s: float | None  # CPU time of the job's process tree since it was first sampled
    rss_mib: float | None  # latest RSS of the job's process tree


def _rank_view(agg: RankAggregator) -> RankView:
    phases = tuple(
        PhaseStats(phase, agg.custom_names.get(phase, ""), s.wall.count,
                   s.wall.mean * s.wall.count, s.gpu.count, s.gpu.mean * s.gpu.count)
        for phase, s in sorted(agg.series.items()))
    return RankView(agg.rank, phases, agg.training_s(), agg.samples[False], agg.samples[True])


def _gpu_view(sample: GpuSample, first_energy_j: float | None) -> GpuView:
    energy = sample.energy_j
    since_start = (energy - first_energy_j if energy is not None and first_energy_j is not None
                   and energy >= first_energy_j else None)
    return GpuView(sample.gpu_index, sample.uuid, sample.name, sample.util_pct,
                   sample.mem_used_mib, sample.job_mem_mib, sample.power_w, since_start,
                   sample.temperature_c)


def split_view(split: Split, resources: SplitResources | None) -> SplitView:
    """The view of ``split`` with its running resource figures (loop thread only)."""
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    counts = split.record_counts()
    info = split.info
    gpus: tuple[GpuView, ...] = ()
    cpu_s = rss_mib = None
    if resources is not None:
        gpus = tuple(_gpu_view(s, resources.first_energy_j.get(uuid))
                     for uuid, s in sorted(resources.latest_gpu.items()))
        if resources.host_samples:
            cpu_s, rss_mib = resources.cpu_s, resources.host_samples[-1].rss_mib
    return SplitView(
        run_id=first.sessions[0].run_id if first and first.sessions else "",
        user=str(info.get("user") or ""), host=str(info.get("host") or ""),
        slurm_job_id=str(info.get("job_id") or ""), split=split.split, status=split.status,
        ranks=tuple(_rank_view(split.ranks[r]) for r in sorted(split.ranks)),
        records={"received": counts.received, "dropped": counts.dropped,
                 "lost": counts.lost, "rejected": counts.rejected},
        gpus=gpus, cpu_s=cpu_s, rss_mib=rss_mib)


def take(registry: Registry, monitor: ResourceMonitor, endpoint: str, root: Path | None,
         interval_s: float, rate_since: tuple[float, int]) -> Snapshot:
    """The snapshot of this moment (loop thread only). ``rate_since`` is (monotonic s,
    records received then): the record rate is the mean since that point."""
    now = time.monotonic()
    then, before = rate_since
    gpu_off = monitor.gpu_off_reason
    counts = registry.status()
    return Snapshot(
        pid=os.getpid(), endpoint=endpoint, root=str(root) if root else None,
        taken_unix=time.time(), loop_monotonic=now,
        sampler_round_monotonic=monitor.last_round_monotonic,
        samplers_started=monitor.started(),
        records=registry.records_received, dropped=counts["dropped"],
        lost=counts["lost"], rejected=counts["rejected"],
        rejected_by_kind=counts["rejected_by_kind"], last_error=registry.last_error,
        records_per_s=(registry.records_received - before) / (now - then)
        if now > then else 0.0,
        rate_window_s=now - then,
        samplers={"host": "on", "gpu": "on" if gpu_off is None else f"off ({gpu_off})",
                  "interval_s": interval_s, "gpus": monitor.gpu_status()},
        runs=tuple(RunView(**run) for run in counts["runs"]),
        splits=tuple(split_view(split, monitor.live(split))
                     for split in registry.splits.values()))
