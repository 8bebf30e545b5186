"""``/metrics`` (SPEC §7): the daemon's latest snapshot in the Prometheus text format,
through prometheus_client.

The collector reads only the frozen ``Snapshot`` the loop publishes each tick (one
reference, swapped atomically), never live state: the HTTP server runs on its own thread.
A run the daemon forgot is absent from the next snapshot, so its series disappear.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from markers import wire
from sidecar.daemon.snapshot import Snapshot, SplitView
from sidecar.model.split import SPLIT_STATUS_ORDER
from sidecar.model.units import BYTES_PER_MIB

log = logging.getLogger("sidecar")

RUN_LABELS = ["run", "user", "host", "slurm_job_id"]
PHASE_LABELS = [*RUN_LABELS, "split", "rank", "phase"]
GPU_LABELS = ["host", "gpu", "uuid", "model", "run"]
# The ``phase`` label of the standard phases; custom phases keep the user's name.
PHASE_NAMES: dict[int, str] = {
    wire.TRAINING: "training", wire.EPOCH: "epoch", wire.TRAINING_LOOP: "train_loop",
    wire.TRAINING_DATA_LOADING: "train_loading", wire.VALIDATION: "validation",
    wire.VALIDATION_LOOP: "val_loop", wire.VALIDATION_DATA_LOADING: "val_loading",
    **{phase: name for name, phase in wire.CANONICAL_PHASE_NAMES.items()},
}


def _run_labels(view: SplitView) -> list[str]:
    return [view.run_id, view.user, view.host, view.slurm_job_id]


def _gpu_gauges() -> dict[str, GaugeMetricFamily]:
    return {
        "util": GaugeMetricFamily("trainmon_gpu_utilization_ratio",
                                  "NVML GPU utilization (share of time a kernel ran), 0-1, "
                                  "latest sample", labels=GPU_LABELS),
        "used": GaugeMetricFamily("trainmon_gpu_memory_used_bytes", "device memory used",
                                  labels=GPU_LABELS),
        "job": GaugeMetricFamily("trainmon_gpu_job_memory_bytes",
                                 "device memory of the job's own processes",
                                 labels=GPU_LABELS),
        "power": GaugeMetricFamily("trainmon_gpu_power_watts", "power draw",
                                   labels=GPU_LABELS),
        "temp": GaugeMetricFamily("trainmon_gpu_temperature_celsius", "temperature",
                                  labels=GPU_LABELS),
    }


class SnapshotCollector(Collector):
    """Metric families of the snapshot ``source()`` returns (None: nothing yet)."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """Every family of SPEC §7 from one snapshot (taken once per scrape)."""
        snapshot: Snapshot | None = self._source()
        splits = snapshot.splits if snapshot is not None else ()
        wall = SummaryMetricFamily("trainmon_phase_duration_seconds", "wall time of every "
                                   "post-warmup measurement of the phase", labels=PHASE_LABELS)
        gpu = SummaryMetricFamily("trainmon_phase_gpu_duration_seconds", "GPU time of every "
                                  "post-warmup measurement of the phase", labels=PHASE_LABELS)
        samples = CounterMetricFamily("trainmon_samples", "samples of the measured "
                                      "iterations (batch x accumulation per step)",
                                      labels=[*RUN_LABELS, "split", "rank", "loop"])
        gauges = _gpu_gauges()
        energy = CounterMetricFamily("trainmon_gpu_energy_joules", "GPU energy since the "
                                     "run started", labels=GPU_LABELS)
        cpu = CounterMetricFamily("trainmon_job_cpu_seconds", "CPU time of the job's "
                                  "process tree", labels=RUN_LABELS)
        rss = GaugeMetricFamily("trainmon_job_memory_rss_bytes", "RSS of the job's process "
                                "tree", labels=RUN_LABELS)
        records = CounterMetricFamily("trainmon_records", "record accounting",
                                      labels=[*RUN_LABELS, "outcome"])
        runs = GaugeMetricFamily("trainmon_runs", "runs the sidecar knows, by status",
                                 labels=["status"])
        for view in splits:
            run = _run_labels(view)
            for rank in view.ranks:
                where = [*run, str(view.split), str(rank.rank)]
                wall.add_metric([*where, PHASE_NAMES[wire.TRAINING]], 1, rank.training_s)
                for phase in rank.phases:
                    name = PHASE_NAMES.get(phase.phase, phase.name)
                    wall.add_metric([*where, name], phase.count, phase.sum_s)
                    if phase.gpu_count:
                        gpu.add_metric([*where, name], phase.gpu_count, phase.gpu_sum_s)
                for loop, count in (("train", rank.train_samples), ("val", rank.val_samples)):
                    if count is not None:
                        samples.add_metric([*where, loop], count)
            for g in view.gpus:
                labels = [view.host, str(g.index), g.uuid, g.model, view.run_id]
                for key, value in (("util", None if g.util_pct is None else g.util_pct / 100),
                                   ("used", _bytes(g.mem_used_mib)),
                                   ("job", _bytes(g.job_mem_mib)), ("power", g.power_w),
                                   ("temp", g.temperature_c)):
                    if value is not None:
                        gauges[key].add_metric(labels, value)
                if g.energy_j is not None:
                    energy.add_metric(labels, g.energy_j)
            if view.cpu_s is not None:
                cpu.add_metric(run, view.cpu_s)
            if view.rss_mib is not None:
                rss.add_metric(run, view.rss_mib * BYTES_PER_MIB)
            for outcome, count in view.records.items():
                records.add_metric([*run, outcome], count)
        for status in SPLIT_STATUS_ORDER:
            runs.add_metric([status], sum(1 for v in splits if v.status == status))
        yield from (wall, gpu, samples, *gauges.values(), energy, cpu, rss, records, runs)


def _bytes(mib: float | None) -> float | None:
    return None if mib is None else mib * BYTES_PER_MIB


class MetricsExporter:
    """A lifecycle hook serving ``/metrics`` on ``addr:port`` from the snapshots the loop
    hands it. A port that cannot be bound is said once; the sidecar runs on without."""

    def __init__(self, port: int, addr: str) -> None:
        self.port = port
        self.addr = addr
        self._snapshot: Snapshot | None = None
        self._server: Any = None
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(lambda: self._snapshot))

    def ready(self, snapshot: Snapshot) -> None:
        """Start serving (the socket is bound and the samplers are up)."""
        self._snapshot = snapshot
        try:
            self._server, _thread = start_http_server(self.port, self.addr, self.registry)
        except OSError as exc:
            log.error("metrics: cannot serve on %s:%d (%s); running on without /metrics",
                      self.addr, self.port, exc.strerror or exc)
            return
        log.info("metrics on http://%s:%d/metrics", self.addr, self.bound_port)

    @property
    def bound_port(self) -> int | None:
        """The port served (the real one when 0 was asked), None when not serving."""
        return self._server.server_port if self._server is not None else None

    def tick(self, snapshot: Snapshot) -> None:
        """Publish the loop's latest snapshot to the scrapes (a reference swap)."""
        self._snapshot = snapshot

    def stopping(self) -> None:
        """Stop serving: the sidecar is writing its last files and exits. The server's
        loop notices within its 0.5 s poll; the loop thread does not wait for it."""
        server, self._server = self._server, None
        if server is not None:
            threading.Thread(target=_close, args=(server,), name="metrics-stop",
                             daemon=True).start()


def _close(server: Any) -> None:
    server.shutdown()
    server.server_close()
