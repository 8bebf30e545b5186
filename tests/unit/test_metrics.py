"""The ``/metrics`` collector over snapshots: the names, types and labels of docs/contract.md,
Prometheus metrics, and a forgotten run's series gone from the next scrape. Served over real HTTP
on loopback."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from markers import wire
from sidecar.daemon.metrics import MetricsExporter
from sidecar.daemon.snapshot import GpuView, PhaseStats, RankView, SplitView
from sidecar.model.goodput import CAUSES, Account
from sidecar.model.straggler_gpu import GpuFigures
from sidecar.model.stragglers import RankStanding
from sidecar.model.units import BYTES_PER_MIB as MIB
from tests.support.contract import contract_metrics
from tests.support.snapshots import snapshot

# name: (type, labels), parsed from docs/contract.md's table: the docs and the code agree
CONTRACT_METRICS = contract_metrics()
# rank 3's GPU over the aligned iterations: throttled, slow clock; rank 0 is a CPU rank
THROTTLED = GpuFigures(
    8, 990.0, 900.0, 120.0, 88.0, {"hw_slowdown": 1.0, "sw_thermal_slowdown": 0.25}, 8
)


GOODPUT = Account(
    20.0, 12.0, {cause: 0.5 * (index + 1) for index, cause in enumerate(CAUSES)}, 50, 6.0
)


def _split(run_id: str, status: str = "running", end_unix: float | None = None) -> SplitView:
    phases = (
        PhaseStats(wire.FORWARD, "", 10, 0.5, 10, 0.25),
        PhaseStats(wire.TRAINING_LOOP, "", 10, 1.0, 0, 0.0),
        PhaseStats(wire.FIRST_CUSTOM_ID, "augment", 3, 0.3, 0, 0.0),
    )
    return SplitView(
        run_id=run_id,
        user="ada",
        host="node1",
        slurm_job_id="42",
        split=0,
        status=status,
        start_unix=1.8e9,
        end_unix=end_unix,
        ranks=(RankView(0, phases, 12.5, 80, None, GOODPUT),),
        records={"received": 100, "dropped": 1, "lost": 0, "rejected": 2},
        gpus=(
            GpuView(
                0,
                "GPU-a",
                "NVIDIA H200",
                {
                    "trainmon_gpu_utilization_ratio": 0.55,
                    "trainmon_gpu_memory_used_bytes": 1024.0 * MIB,
                    "trainmon_gpu_memory_total_bytes": 4096.0 * MIB,
                    "trainmon_gpu_job_memory_bytes": 512.0 * MIB,
                    "trainmon_gpu_power_watts": 300.0,
                    "trainmon_gpu_energy_joules": 900.0,
                    "trainmon_gpu_temperature_celsius": 60.0,
                },
            ),
        ),
        host_gauges={"trainmon_job_cpu_seconds": 3.5, "trainmon_job_memory_rss_bytes": 100.0 * MIB},
        standings=(
            RankStanding(0, "node1", 0, 0.0, 0.0, None, 4.0),
            RankStanding(3, "node2", 9, 0.9, 0.02, "data loading", 0.0, THROTTLED, THROTTLED),
        ),
        folder=f"/shared/runs/{run_id[:4]}",
    )


def _scrape(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_names_types_labels_and_forgotten_runs() -> None:
    exporter = MetricsExporter(0, "127.0.0.1")
    exporter.ready(
        snapshot(_split("a" * 32), _split("b" * 32, "completed", 1.8e9 + 60), job_ids_dropped=3)
    )
    try:
        assert exporter.bound_port
        families = _scrape(exporter.bound_port)
        assert set(families) == set(CONTRACT_METRICS)
        for name, (kind, labels) in CONTRACT_METRICS.items():
            family = families[name]
            assert family.type == kind, name
            for sample in family.samples:
                assert sorted(sample.labels) == sorted(labels), (name, sample)
        phases = {
            (s.labels["phase"], s.name.rsplit("_", 1)[1]): s.value
            for s in families["trainmon_phase_duration_seconds"].samples
            if s.labels["run"] == "a" * 32
        }
        assert phases[("forward", "sum")] == 0.5 and phases[("forward", "count")] == 10
        assert phases[("train_loop", "count")] == 10 and phases[("augment", "sum")] == 0.3
        assert phases[("training", "sum")] == 12.5
        util = families["trainmon_gpu_utilization_ratio"].samples[0]
        assert util.value == 0.55
        assert families["trainmon_gpu_memory_used_bytes"].samples[0].value == 1024**3
        parts = {
            s.labels["part"]: s.value
            for s in families["trainmon_goodput_seconds"].samples
            if s.labels["run"] == "a" * 32
        }
        assert parts == {"productive": 12.0, **GOODPUT.badput_s}  # every cause, bounded
        assert families["trainmon_goodput_wall_seconds"].samples[0].value == 20.0
        assert families["trainmon_goodput_gpu_busy_seconds"].samples[0].value == 6.0
        # run b completed
        assert [s.value for s in families["trainmon_run_running"].samples] == [1.0, 0.0]
        runs = {s.labels["status"]: s.value for s in families["trainmon_runs"].samples}
        assert runs == {"running": 1, "completed": 1, "incomplete": 0, "failed": 0}
        # how each run stands and when it started and ended
        states = {
            (s.labels["run"], s.labels["status"]): s.value
            for s in families["trainmon_run_status"].samples
        }
        assert states == {
            ("a" * 32, "running"): 1,
            ("a" * 32, "completed"): 0,
            ("a" * 32, "incomplete"): 0,
            ("a" * 32, "failed"): 0,
            ("b" * 32, "running"): 0,
            ("b" * 32, "completed"): 1,
            ("b" * 32, "incomplete"): 0,
            ("b" * 32, "failed"): 0,
        }
        assert [s.value for s in families["trainmon_run_start_timestamp_seconds"].samples] == [
            1.8e9,
            1.8e9,
        ]
        folders = {
            (s.labels["run"], s.labels["split"], s.labels["folder"]): s.value
            for s in families["trainmon_run_info"].samples
        }
        assert folders == {
            ("a" * 32, "0", "/shared/runs/aaaa"): 1,
            ("b" * 32, "0", "/shared/runs/bbbb"): 1,
        }
        ends = families["trainmon_run_end_timestamp_seconds"].samples
        assert [(s.labels["run"], s.value) for s in ends] == [("b" * 32, 1.8e9 + 60)]
        slowest = {
            (s.labels["rank"], s.labels["host"]): s.value
            for s in families["trainmon_rank_slowest_ratio"].samples
            if s.labels["run"] == "a" * 32
        }
        assert slowest == {("0", "node1"): 0.0, ("3", "node2"): 0.9}
        gpu = {
            (name, s.labels["rank"], s.labels.get("reason")): s.value
            for name in CONTRACT_METRICS
            if name.startswith("trainmon_rank_gpu_")
            for s in families[name].samples
            if s.labels["run"] == "a" * 32
        }
        assert gpu == {  # the CPU rank 0 has no GPU series
            ("trainmon_rank_gpu_sm_clock_hertz", "3", None): 990e6,
            ("trainmon_rank_gpu_power_watts", "3", None): 120.0,
            ("trainmon_rank_gpu_temperature_max_celsius", "3", None): 88.0,
            ("trainmon_rank_gpu_throttle_ratio", "3", "hw_slowdown"): 1.0,
            ("trainmon_rank_gpu_throttle_ratio", "3", "sw_thermal_slowdown"): 0.25,
        }
        assert [
            s.value
            for s in families["trainmon_job_ids_dropped"].samples
            if s.name.endswith("_total")
        ] == [3]

        exporter.tick(snapshot(_split("b" * 32)))  # the daemon forgot run a
        families = _scrape(exporter.bound_port)
        seen = {s.labels.get("run") for f in families.values() for s in f.samples}
        assert seen == {"b" * 32, None}  # None: the node-wide families have no run label
    finally:
        exporter.stopping()
