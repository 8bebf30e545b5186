"""``/metrics`` (docs/contract.md, Prometheus metrics): the daemon's latest snapshot in the
Prometheus text format, through prometheus_client.

The collector reads only the frozen ``Snapshot`` the loop publishes each tick (one
reference, swapped atomically), never live state: the HTTP server runs on its own thread.
A run the daemon forgot is absent from the next snapshot, so its series disappear.

Each scrape sees what its bearer token allows (``sidecar.daemon.viewers``): on a shared
daemon a scrape without one gets the node-wide figures only.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from markers import wire
from sidecar.daemon.snapshot import Snapshot, SplitView
from sidecar.daemon.viewers import ALL, Viewers
from sidecar.model.split import SPLIT_STATUS_ORDER
from sidecar.model.straggler_gpu import GpuFigures
from sidecar.resources import fields

log = logging.getLogger("sidecar")

RUN_LABELS = ["run", "user", "host", "slurm_job_id"]
PHASE_LABEL_NAMES = [*RUN_LABELS, "split", "rank", "phase"]  # Prometheus label names
GPU_LABELS = ["host", "gpu", "uuid", "model", "run"]
RANK_LABELS = ["run", "split", "rank", "host"]  # host: the rank's own (docs/multi-node.md)
# The ``phase`` label of the standard phases; custom phases keep the user's name.
PHASE_NAMES: dict[int, str] = {p.phase: p.metric for p in wire.PHASES}


def _run_labels(view: SplitView) -> list[str]:
    return [view.run_id, view.user, view.host, view.slurm_job_id]


def _families(table: Sequence[fields.ResourceField], labels: list[str]) -> dict[str, Any]:
    """One metric family per field of ``table`` with a gauge, by metric name."""
    families: dict[str, Any] = {}
    for field in table:
        gauge = field.gauge
        if gauge is not None:
            kind = GaugeMetricFamily if gauge.type == "gauge" else CounterMetricFamily
            families[gauge.name] = kind(gauge.name, gauge.help, labels=labels)
    return families


class SnapshotCollector(Collector):
    """Metric families of the snapshot ``source()`` returns (None: nothing yet), as
    ``viewer`` may see them (``sidecar.daemon.viewers``): ``ALL``, one user's runs, or
    None (no run's series; the counts and the GPUs without a run label)."""

    def __init__(self, source: Any, viewer: str | None = ALL) -> None:
        self._source = source
        self._viewer = viewer

    def _sees(self, view: SplitView) -> bool:
        return self._viewer == ALL or (self._viewer is not None and view.user == self._viewer)

    def collect(self) -> Iterator[Metric]:
        """Every family of docs/metrics.md from one snapshot (taken once per scrape)."""
        snapshot: Snapshot | None = self._source()
        every = snapshot.splits if snapshot is not None else ()
        splits = [view for view in every if self._sees(view)]
        wall = SummaryMetricFamily(
            "trainmon_phase_duration_seconds",
            "wall time of every post-warmup measurement of the phase",
            labels=PHASE_LABEL_NAMES,
        )
        gpu = SummaryMetricFamily(
            "trainmon_phase_gpu_duration_seconds",
            "GPU time of every post-warmup measurement of the phase",
            labels=PHASE_LABEL_NAMES,
        )
        samples = CounterMetricFamily(
            "trainmon_samples",
            "samples of the measured iterations (the sizes of the batches of each step)",
            labels=[*RUN_LABELS, "split", "rank", "loop"],
        )
        gpu_families = _families(fields.GPU_FIELDS, GPU_LABELS)
        host_families = _families(fields.HOST_FIELDS, RUN_LABELS)
        records = CounterMetricFamily(
            "trainmon_records", "record accounting", labels=[*RUN_LABELS, "outcome"]
        )
        goodput = GaugeMetricFamily(
            "trainmon_goodput_seconds",
            "the rank's wall time from its process start, by "
            "part: productive or a badput cause (docs/goodput.md)",
            labels=[*RUN_LABELS, "split", "rank", "part"],
        )
        goodput_wall = GaugeMetricFamily(
            "trainmon_goodput_wall_seconds",
            "the wall time the goodput parts add up to",
            labels=[*RUN_LABELS, "split", "rank"],
        )
        gpu_busy = GaugeMetricFamily(
            "trainmon_goodput_gpu_busy_seconds",
            "GPU time of Forward, Backward and Optimization in the productive iterations",
            labels=[*RUN_LABELS, "split", "rank"],
        )
        running = GaugeMetricFamily(
            "trainmon_run_running",
            "1 while the split runs, 0 once it ended (completed, incomplete, failed)",
            labels=[*RUN_LABELS, "split"],
        )
        runs = GaugeMetricFamily(
            "trainmon_runs", "runs the sidecar knows, by status", labels=["status"]
        )
        # a state set: every status of a run, 1 for the one it has now, so a run that ends
        # keeps the same series and its last scrape says how it ended
        state = GaugeMetricFamily(
            "trainmon_run_status",
            "1 for the run's status, 0 for the others",
            labels=[*RUN_LABELS, "status"],
        )
        info = GaugeMetricFamily(
            "trainmon_run_info",
            "1, with the run folder of the split: the same on every node of a job",
            labels=[*RUN_LABELS, "split", "folder"],
        )
        start = GaugeMetricFamily(
            "trainmon_run_start_timestamp_seconds",
            "when the run started, Unix time",
            labels=RUN_LABELS,
        )
        end = GaugeMetricFamily(
            "trainmon_run_end_timestamp_seconds",
            "when the run ended, Unix time (absent while it runs)",
            labels=RUN_LABELS,
        )
        ranks = [
            GaugeMetricFamily(name, text, labels=RANK_LABELS)
            for name, text in (
                (
                    "trainmon_rank_slowest_ratio",
                    "share of the aligned iterations in which the "
                    "rank was the slowest before the sync, by the straggler rule's margin",
                ),
                (
                    "trainmon_rank_over_median_seconds",
                    "the rank's mean excess over the median "
                    "across ranks before the sync, in the iterations it was the slowest",
                ),
                (
                    "trainmon_rank_waited_seconds",
                    "time the rank spent waiting for the slowest "
                    "rank, summed over the aligned stored iterations",
                ),
            )
        ]
        rank_gpu = _rank_gpu_families()
        for view in splits:
            run = _run_labels(view)
            for standing in view.standings:
                labels = [view.run_id, str(view.split), str(standing.rank), standing.host]
                for family, value in zip(
                    ranks,
                    (standing.slowest_share, standing.over_median_s, standing.waited_s),
                    strict=True,
                ):
                    family.add_metric(labels, value)
                _add_rank_gpu(rank_gpu, labels, standing.gpu_aligned)
            for name in SPLIT_STATUS_ORDER:
                state.add_metric([*run, name], float(name == view.status))
            for family, unix in ((start, view.start_unix), (end, view.end_unix)):
                if unix is not None:
                    family.add_metric(run, unix)
            running.add_metric([*run, str(view.split)], float(view.status == "running"))
            info.add_metric([*run, str(view.split), view.folder], 1.0)
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
                for part, value_s in rank.goodput.parts().items():
                    goodput.add_metric([*where, part], value_s)
                goodput_wall.add_metric(where, rank.goodput.wall_s)
                if rank.goodput.gpu_busy_s is not None:
                    gpu_busy.add_metric(where, rank.goodput.gpu_busy_s)
            _add_gpus(gpu_families, view, view.run_id)
            for name, value in view.host_gauges.items():
                host_families[name].add_metric(run, value)
            for outcome, count in view.records.items():
                records.add_metric([*run, outcome], count)
        # the node's GPUs that the viewer's runs do not show, once each, without a run
        shown = {g.uuid for view in splits for g in view.gpus}
        for view in every:
            if not self._sees(view):
                _add_gpus(gpu_families, view, "", shown)
        for status in SPLIT_STATUS_ORDER:  # node-wide: every run counts
            runs.add_metric([status], sum(1 for v in every if v.status == status))
        job_ids = CounterMetricFamily(
            "trainmon_job_ids_dropped",
            "Slurm job ids of hellos not believed: the process belongs to no such job",
        )
        job_ids.add_metric([], snapshot.job_ids_dropped if snapshot is not None else 0)
        yield from (
            wall,
            gpu,
            samples,
            *gpu_families.values(),
            *host_families.values(),
            records,
            goodput,
            goodput_wall,
            gpu_busy,
            running,
            runs,
            state,
            info,
            start,
            end,
            *ranks,
            *rank_gpu.values(),
            job_ids,
        )


def _rank_gpu_families() -> dict[str, GaugeMetricFamily]:
    """The families of what each rank's GPU showed over the aligned iterations
    (docs/multi-node.md), by the GpuFigures attribute each exports (throttle: by reason)."""
    over = "over the aligned iterations of the straggler rule"
    return {
        "sm_clock_median_mhz": GaugeMetricFamily(
            "trainmon_rank_gpu_sm_clock_hertz",
            f"median SM clock of the rank's GPU in its samples {over}",
            labels=RANK_LABELS,
        ),
        "power_mean_w": GaugeMetricFamily(
            "trainmon_rank_gpu_power_watts",
            f"mean power of the rank's GPU in its samples {over}",
            labels=RANK_LABELS,
        ),
        "temperature_max_c": GaugeMetricFamily(
            "trainmon_rank_gpu_temperature_max_celsius",
            f"largest temperature of the rank's GPU in its samples {over}",
            labels=RANK_LABELS,
        ),
        "throttle": GaugeMetricFamily(
            "trainmon_rank_gpu_throttle_ratio",
            f"share of the rank's GPU samples {over} in which NVML named the reason",
            labels=[*RANK_LABELS, "reason"],
        ),
    }


def _add_rank_gpu(
    families: dict[str, GaugeMetricFamily], labels: list[str], gpu: GpuFigures | None
) -> None:
    """One rank's GPU series (none for a CPU rank, nor for a figure no sample gave)."""
    if gpu is None:
        return
    for attribute, scale in (
        ("sm_clock_median_mhz", 1e6),
        ("power_mean_w", 1.0),
        ("temperature_max_c", 1.0),
    ):
        value = getattr(gpu, attribute)
        if value is not None:
            families[attribute].add_metric(labels, value * scale)
    for reason, share in gpu.throttle.items():
        families["throttle"].add_metric([*labels, reason], share)


def _add_gpus(
    families: dict[str, Any], view: SplitView, run: str, shown: set[str] | None = None
) -> None:
    """The GPU gauges of ``view`` labelled with ``run``; with ``shown``, only GPUs not in
    it (each then added to it)."""
    for g in view.gpus:
        if shown is not None:
            if g.uuid in shown:
                continue
            shown.add(g.uuid)
        labels = [view.host, str(g.index), g.uuid, g.model, run]
        for name, value in g.gauges.items():
            families[name].add_metric(labels, value)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape."""


class MetricsExporter:
    """A lifecycle hook serving ``/metrics`` on ``addr:port`` from the snapshots the loop
    hands it, each scrape as ``viewers`` allows (default: every run). A port that cannot
    be bound is said once; the sidecar runs on without."""

    def __init__(self, port: int, addr: str, viewers: Viewers | None = None) -> None:
        self.port = port
        self.addr = addr
        self.viewers = viewers or Viewers(shared=False)
        self._snapshot: Snapshot | None = None
        self._server: Any = None
        self.registry = CollectorRegistry()  # every run: for tests and in-process readers
        self.registry.register(SnapshotCollector(lambda: self._snapshot))

    def _app(
        self,
        environ: dict[str, Any],
        start_response: Callable[..., Any],
    ) -> Iterable[bytes]:
        """One scrape, as its ``Authorization`` header allows."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(
            SnapshotCollector(
                lambda: self._snapshot, self.viewers.viewer(environ.get("HTTP_AUTHORIZATION"))
            )
        )
        return make_wsgi_app(registry)(environ, start_response)

    def _serve(self) -> Any:
        class MetricsHTTPServer(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in self.addr else socket.AF_INET

        server = make_server(
            self.addr, self.port, self._app, MetricsHTTPServer, handler_class=_Quiet
        )
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server

    def ready(self, snapshot: Snapshot) -> None:
        """Start serving (the socket is bound and the samplers are up)."""
        self._snapshot = snapshot
        try:
            self._server = self._serve()
        except OSError as exc:
            log.error(
                "metrics: cannot serve on %s:%d (%s); running on without /metrics",
                self.addr,
                self.port,
                exc.strerror or exc,
            )
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
        """Nothing yet: scrapes go on while the last files are written, and the tick after
        that writing hands the final state (``stopped`` ends the serving)."""

    def stopped(self) -> None:
        """Stop serving: the sidecar wrote its last files and exits. The server's loop
        notices within its 0.5 s poll; the loop thread does not wait for it."""
        server, self._server = self._server, None
        if server is not None:
            threading.Thread(
                target=_close, args=(server,), name="metrics-stop", daemon=True
            ).start()


def _close(server: Any) -> None:
    server.shutdown()
    server.server_close()
