"""The resource-field table drives every consumer, and resources.tsv files of other
versions (older: no ``session`` column; newer: a column appended) still read back."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.daemon.metrics import MetricsExporter
from sidecar.daemon.snapshot import GpuView, SplitView, split_view
from sidecar.model.aggregator import Settings
from sidecar.model.split import Split
from sidecar.model.units import BYTES_PER_MIB as MIB
from sidecar.resources import fields
from sidecar.resources.monitor import SplitResources
from sidecar.resources.samplers.folding import summarize_gpus
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.sinks import resources_text
from sidecar.sinks.tables import to_tsv
from tests.support.snapshots import snapshot

S = 1_000_000_000
START = 1_000 * S


def _gpu(t_ns: int, cls: type[GpuSample] = GpuSample, **extra: Any) -> GpuSample:
    return cls(
        t_ns,
        0,
        "GPU-a",
        "Fake",
        50.0,
        10.0,
        100.0,
        1000.0,
        200.0,
        "instant",
        1000.0 + t_ns / S,
        60.0,
        1500.0,
        None,
        80.0,
        40.0,
        **extra,
    )


def _samples() -> tuple[list[GpuSample], list[HostSample]]:
    times = [START, START + S, START + 3 * S]
    return [_gpu(t) for t in times], [HostSample(t, 150.0, 500.0, None, 30.0, 0) for t in times]


def _write(path: Path, frame: pd.DataFrame) -> Path:
    path.write_text(to_tsv(frame, index=False))
    return path


def test_a_file_with_a_column_appended_later_still_reads(tmp_path: Path) -> None:
    gpu, host = _samples()
    frame = resources_text.resources_frame(gpu, host, START)
    frame["pcie rx (MB/s)"] = 12.5  # written by a newer version
    back = resources_text.read_samples(_write(tmp_path / "r.tsv", frame), START, 1)
    assert back == (gpu, host)


def test_a_file_from_before_the_session_column_reads_as_one_session(tmp_path: Path) -> None:
    gpu, host = _samples()
    frame = resources_text.resources_frame(gpu, host, START).drop(columns=["session"])
    back = resources_text.read_samples(_write(tmp_path / "r.tsv", frame), START, 1)
    assert back == (gpu, host)


def test_a_file_without_a_required_column_is_not_ours(tmp_path: Path) -> None:
    gpu, host = _samples()
    frame = resources_text.resources_frame(gpu, host, START).drop(columns=["power (W)"])
    assert resources_text.read_samples(_write(tmp_path / "r.tsv", frame), START, 1) == ([], [])


@dataclasses.dataclass(frozen=True)
class _PcieSample(GpuSample):
    pcie_rx_mib_s: float | None = None


PCIE = fields.ResourceField(
    "gpu",
    "pcie_rx_mib_s",
    "NVML nvmlDeviceGetPcieThroughput(RX)",
    "pcie rx (MB/s)",
    "MiB/s",
    figures=(fields.FieldFigure("pcie_rx_mean_mib_s", "mean"),),
    line=fields.Line("PCIe RX (MB/s)", "mean {pcie_rx_mean_mib_s:.1f}"),
    gauge=fields.Gauge(
        "trainmon_gpu_pcie_rx_bytes_per_second", "gauge", "PCIe receive", scale=1024 * 1024
    ),
    required=False,
)


def test_a_field_declared_in_the_table_reaches_every_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One table entry (and the sample attribute): a column, a summary figure and line,
    a /metrics family; and an older file without the column still reads."""
    monkeypatch.setattr(fields, "GPU_FIELDS", (*fields.GPU_FIELDS, PCIE))
    samples = [
        _gpu(t, _PcieSample, pcie_rx_mib_s=rx)
        for t, rx in ((START, 0.0), (START + S, 10.0), (START + 3 * S, 40.0))
    ]

    frame = resources_text.resources_frame(samples, [], START)
    assert frame["pcie rx (MB/s)"].tolist() == [0.0, 10.0, 40.0]

    [summary] = summarize_gpus(samples)
    assert summary.figures["pcie_rx_mean_mib_s"] == pytest.approx((10 * 1 + 40 * 2) / 3)
    lines = resources_text.resources_block([summary], None, None, {}, [])
    assert "  PCIe RX (MB/s)            mean 30.0" in lines

    gauges = fields.gauge_values(fields.GPU_FIELDS, samples[-1], {}, {})
    view = SplitView(
        run_id="r",
        user="u",
        host="h",
        slurm_job_id="",
        split=0,
        status="running",
        start_unix=None,
        end_unix=None,
        ranks=(),
        records={},
        gpus=(GpuView(0, "GPU-a", "Fake", gauges),),
        host_gauges={},
    )
    exporter = MetricsExporter(0, "127.0.0.1")
    exporter.tick(snapshot(view, endpoint=""))
    from prometheus_client import generate_latest

    families = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(exporter.registry).decode())
    }
    [value] = families["trainmon_gpu_pcie_rx_bytes_per_second"].samples
    assert value.value == 40.0 * 1024 * 1024

    # the column is optional: a file written before it reads back with None
    older = _write(tmp_path / "old.tsv", frame.drop(columns=["pcie rx (MB/s)"]))
    monkeypatch.setattr(resources_text, "GpuSample", _PcieSample)
    gpu, _ = resources_text.read_samples(older, START, 1)
    assert [s.pcie_rx_mib_s for s in gpu] == [None, None, None]  # type: ignore[attr-defined]


def test_the_table_and_the_samples_name_the_same_fields() -> None:
    """Every attribute of a sample that is not its stamp has a table entry, and every
    entry names an attribute: a field cannot be sampled and silently left out."""
    # kept with the sample, no column (util_windows: the driver's own utilization samples,
    # which the phase attribution reads; resources.tsv keeps the round's reading;
    # job_pids: which split uses the GPU, read by the monitor)
    stamps = {"t_ns", "whole_gpu_uuid", "n_processes", "util_windows", "job_pids"}
    for cls, table in ((GpuSample, fields.GPU_FIELDS), (HostSample, fields.HOST_FIELDS)):
        attributes = {f.name for f in dataclasses.fields(cls)} - stamps
        assert attributes == {f.attribute for f in table}, cls.__name__
    names = fields.columns()
    assert len(set(names)) == len(names)  # one column per field
    figures = [figure.name for f in fields.fields() for figure in f.figures]
    assert len(set(figures)) == len(figures)


def test_the_live_view_exports_each_gauge_by_its_rule(tmp_path: Path) -> None:
    """Through the monitor's running figures and the snapshot: latest values scaled,
    energy since the split's first reading, CPU seconds integrated over the windows."""
    split = Split(tmp_path, 0, Settings(), {"start_unix": 0.0})
    resources = SplitResources(os.getpid())
    gpu, host = _samples()  # rounds at 0, 1 and 3 s; CPU 150 %; energy 1000 J + t
    for g, h in zip(gpu, host, strict=True):
        resources.add_host(h)
        resources.add_gpus([g])
    view = split_view(split, resources)
    assert view.host_gauges == {
        "trainmon_job_cpu_seconds": pytest.approx(1.5 * 3),
        "trainmon_job_memory_rss_bytes": 500.0 * MIB,
    }
    [gauges] = [g.gauges for g in view.gpus]
    assert gauges == {
        "trainmon_gpu_utilization_ratio": 0.5,
        "trainmon_gpu_memory_used_bytes": 100.0 * MIB,
        "trainmon_gpu_memory_total_bytes": 1000.0 * MIB,
        "trainmon_gpu_power_watts": 200.0,
        "trainmon_gpu_energy_joules": pytest.approx(3.0),
        "trainmon_gpu_temperature_celsius": 60.0,
        "trainmon_gpu_job_memory_bytes": 80.0 * MIB,
    }


def test_throttle_reasons_read_back_as_the_bitmask_written(tmp_path: Path) -> None:
    gpu = [
        _gpu(START, throttle_reasons=0x48),
        _gpu(START + S),
        _gpu(START + 2 * S, throttle_reasons=0),
    ]
    frame = resources_text.resources_frame(gpu, [], START)
    assert frame["throttle reasons"].tolist() == [0x48, pd.NA, 0]
    back, _ = resources_text.read_samples(_write(tmp_path / "r.tsv", frame), START, 1)
    assert [s.throttle_reasons for s in back] == [0x48, None, 0]
    assert isinstance(back[0].throttle_reasons, int)
