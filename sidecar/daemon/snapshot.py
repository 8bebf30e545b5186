"""The frozen view of a sidecar that its loop publishes each tick. Readers on other threads
(``/metrics``) and the status control read a snapshot, never live state.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sidecar.daemon.derivations import Derivations
from sidecar.ingest.streams import Registry
from sidecar.model.aggregator import RankAggregator
from sidecar.model.derived import SplitFigures
from sidecar.model.goodput import Account
from sidecar.model.split import Split
from sidecar.model.stragglers import RankStanding
from sidecar.resources import fields
from sidecar.resources.monitor import ResourceMonitor, SplitResources


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
    job_ids_dropped: int = 0  # hellos' Slurm job ids not believed (shared daemon)

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
    goodput: Account  # its wall time by part (sidecar.model.goodput)
    epoch: int = -1  # the latest training epoch and iteration (optimization step) seen
    iteration: int = -1


@dataclass(frozen=True)
class GpuView:
    """One GPU of a split: ``gauges`` maps the metric name of each GPU field with a
    gauge (``sidecar.resources.fields``) to its value in the metric's unit; a field
    unknown now (unsupported, no reading yet) is absent."""

    index: int
    uuid: str
    model: str
    gauges: dict[str, float]


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
    start_unix: float | None  # the earliest start of its ranks (as run.json's)
    end_unix: float | None  # when its last rank ended; None while running
    ranks: tuple[RankView, ...]
    records: dict[str, int]  # received, dropped, lost, rejected
    gpus: tuple[GpuView, ...]
    host_gauges: dict[str, float]  # metric name -> value, of each host field's gauge
    # every rank of the split compared (the sidecar serving rank 0, docs/multi-node.md)
    standings: tuple[RankStanding, ...] = ()
    # the run folder: the same on every node of a job (a shared filesystem), so it names
    # the job across the nodes' sidecars, whose run ids differ (docs/multi-node.md)
    folder: str = ""


def _rank_view(agg: RankAggregator, straggler_per_iteration_s: float) -> RankView:
    phases = tuple(
        PhaseStats(
            phase,
            agg.custom_names.get(phase, ""),
            s.wall.count,
            s.wall.mean * s.wall.count,
            s.gpu.count,
            s.gpu.mean * s.gpu.count,
        )
        for phase, s in sorted(agg.series.items())
    )
    return RankView(
        agg.rank,
        phases,
        agg.training_s(),
        agg.samples[False],
        agg.samples[True],
        agg.goodput_account(straggler_per_iteration_s),
        agg.epoch,
        agg.iteration,
    )


def split_view(
    split: Split, resources: SplitResources | None, figures: SplitFigures | None = None
) -> SplitView:
    """The view of ``split`` with its running resource figures and its derived
    ``figures`` (``daemon/derivations.py``: each rank's wait for the slowest one and the
    standings; None: no rank compared yet). Loop thread only."""
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    counts = split.record_counts()
    waits = figures.waits_s if figures is not None else {}
    info = split.info
    gpus: tuple[GpuView, ...] = ()
    host_gauges: dict[str, float] = {}
    if resources is not None:
        gpus = tuple(
            GpuView(
                s.gpu_index,
                s.uuid,
                s.name,
                fields.gauge_values(fields.GPU_FIELDS, s, resources.first_gpu.get(uuid, {}), {}),
            )
            for uuid, s in sorted(resources.latest_gpu.items())
        )
        if resources.host_samples:
            host_gauges = fields.gauge_values(
                fields.HOST_FIELDS, resources.host_samples[-1], {}, resources.integrals
            )
    span = split.span_unix()  # as run.json states it
    return SplitView(
        run_id=first.sessions[0].run_id if first and first.sessions else "",
        user=str(info.get("user") or ""),
        host=str(info.get("host") or ""),
        slurm_job_id=str(info.get("job_id") or ""),
        split=split.split,
        status=split.status,
        start_unix=span[0],
        end_unix=span[1],
        ranks=tuple(
            _rank_view(split.ranks[r], waits.get(r, 0.0))
            for r in sorted(split.ranks)
            if split.ranks[r].sessions
        ),
        records={
            "received": counts.received,
            "dropped": counts.dropped,
            "lost": counts.lost,
            "rejected": counts.rejected,
        },
        gpus=gpus,
        host_gauges=host_gauges,
        standings=figures.standings if figures is not None else (),
        folder=str(split.out_dir),
    )


def take(
    registry: Registry,
    monitor: ResourceMonitor,
    endpoint: str,
    root: Path | None,
    interval_s: float,
    rate_since: tuple[float, int],
    derivations: Derivations,
    job_ids_dropped: int = 0,
) -> Snapshot:
    """The snapshot of this moment (loop thread only). ``rate_since`` is (monotonic s,
    records received then): the record rate is the mean since that point;
    ``derivations`` gives each split's derived figures (refreshed there, throttled);
    ``job_ids_dropped`` counts the hellos' Slurm job ids not believed."""
    now_mono = time.monotonic()
    then, before = rate_since
    gpu_off = monitor.gpu_off_reason
    counts = registry.status()
    return Snapshot(
        pid=os.getpid(),
        endpoint=endpoint,
        root=str(root) if root else None,
        taken_unix=time.time(),
        loop_monotonic=now_mono,
        sampler_round_monotonic=monitor.last_round_monotonic,
        samplers_started=monitor.started(),
        records=registry.records_received,
        dropped=counts["dropped"],
        lost=counts["lost"],
        rejected=counts["rejected"],
        rejected_by_kind=counts["rejected_by_kind"],
        last_error=registry.last_error,
        job_ids_dropped=job_ids_dropped,
        records_per_s=(registry.records_received - before) / (now_mono - then)
        if now_mono > then
        else 0.0,
        rate_window_s=now_mono - then,
        samplers={
            "host": "on",
            "gpu": "on" if gpu_off is None else f"off ({gpu_off})",
            "interval_s": interval_s,
            "gpus": monitor.gpu_status(),
        },
        runs=tuple(RunView(**run) for run in counts["runs"]),
        splits=tuple(
            split_view(split, live, derivations.live(split, live))
            for split in registry.splits.values()
            for live in (monitor.live(split),)
        ),
    )
