"""The sidecar's resource monitor: sampling per split and per-phase attribution, with the
small pynvml fake standing in for absent GPUs and this test process as the job.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from markers import wire
from sidecar.model.aggregator import Settings
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor
from sidecar.resources.samplers.nvml import NvmlUnavailable, open_nvml
from sidecar.sinks.resources_text import resources_block, resources_frame
from tests.support.fake_pynvml import FakeGpu, FakeNvml

INTERVAL_S = 0.05


def make_split(tmp_path: Path) -> Split:
    split = Split(tmp_path, 0, Settings(), {"start_unix": time.time()})
    split.rank(0).begin_session(time.time(), time.monotonic_ns())
    return split


def wait_opened(monitor: ResourceMonitor) -> None:
    deadline = time.monotonic() + 10
    while monitor.gpu_off_reason == "starting NVML" and time.monotonic() < deadline:
        time.sleep(0.01)


def run_phase(monitor: ResourceMonitor, seconds: float) -> tuple[int, int]:
    """Keep sampling for ``seconds``; the interval it covered (monotonic ns)."""
    start = time.monotonic_ns()
    while time.monotonic_ns() - start < seconds * 1e9:
        monitor.tick()
        time.sleep(INTERVAL_S / 5)
    return start, time.monotonic_ns()


@dataclass(frozen=True)
class _Report:
    lines: list[str]
    frame: pd.DataFrame | None


def _report(monitor: ResourceMonitor, split: Split, records_lines: list[str]) -> _Report:
    """What the writer makes of the monitor's figures: the block's lines and the frame."""
    monitor.final_round(split)
    figures = monitor.figures(split)
    lines = resources_block(figures.gpus, figures.host, figures.gpu_off_reason,
                            figures.attribution, records_lines)
    frame = resources_frame(figures.gpu_samples, figures.host_samples, figures.run_start_ns) \
        if figures.host_samples or figures.gpu_samples else None
    return _Report(lines, frame)


def test_gpu_use_is_attributed_to_the_phases_that_ran(tmp_path: Path) -> None:
    gpus = [FakeGpu(uuid="GPU-aaaa", name="Fake A"), FakeGpu(uuid="GPU-bbbb", name="Fake B")]
    monitor = ResourceMonitor(INTERVAL_S, None, all_splits_share_gpus=True,
                              open_gpus=lambda visible: open_nvml(visible, api=FakeNvml(gpus)))
    wait_opened(monitor)
    assert monitor.gpus is not None
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    records = []
    for label_id, util, power_mw in ((wire.FORWARD, 95, 300_000),
                                     (wire.TRAINING_DATA_LOADING, 5, 80_000),
                                     (wire.FORWARD, 95, 300_000)):
        for gpu in gpus:
            gpu.util, gpu.power_instant_mw = util, power_mw
        start, end = run_phase(monitor, 0.6)
        records.append((label_id, 0, 0, -1, 0, start, end, -1, -1))
    monitor.note_records(split, 0, np.array(records, dtype=np.int64))
    split.set_status("completed", None)
    report = _report(monitor, split, ["Records: test"])

    text = "\n".join(report.lines)
    assert "GPU 0: 'Fake A' GPU-aaaa" in text and "GPU 1: 'Fake B' GPU-bbbb" in text
    table = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
             for line in report.lines if line.count("|") == 4}
    forward_util, loading_util = float(table["Forward"][2]), float(table["Training data "
                                                                         "loading"][2])
    # Windows at the phase boundaries mix both phases; the bulk of each is clean.
    assert forward_util > 75 and loading_util < 25
    assert float(table["Forward"][3]) > 200 > float(table["Training data loading"][3])
    assert report.lines[-1] == "Records: test"
    frame = report.frame
    assert frame is not None
    assert set(frame["gpu uuid"].dropna()) == {"GPU-aaaa", "GPU-bbbb"}
    assert (frame["job memory rss (MB)"].dropna() > 10).all()  # this process, in MiB


def test_a_split_takes_only_the_gpus_its_job_reported(tmp_path: Path) -> None:
    gpus = [FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")]
    monitor = ResourceMonitor(INTERVAL_S, None, all_splits_share_gpus=False,
                              open_gpus=lambda visible: open_nvml(visible, api=FakeNvml(gpus)))
    wait_opened(monitor)
    used, cpu_only = make_split(tmp_path / "a"), make_split(tmp_path / "b")
    used.add_gpu("GPU-bbbb", "NVIDIA Fake")
    for split in (used, cpu_only):
        monitor.watch(split, os.getpid())
    run_phase(monitor, 0.2)
    for split in (used, cpu_only):
        split.set_status("completed", None)
    used_frame = _report(monitor, used, []).frame
    assert used_frame is not None and set(used_frame["gpu uuid"].dropna()) == {"GPU-bbbb"}
    text = "\n".join(_report(monitor, cpu_only, []).lines)
    assert "GPU sampling: off (the job used no GPU)" in text


def test_without_a_driver_gpu_sampling_is_off_and_host_sampling_goes_on(
        tmp_path: Path) -> None:
    monitor = ResourceMonitor(
        INTERVAL_S, None, all_splits_share_gpus=True,
        open_gpus=lambda visible: NvmlUnavailable("no NVIDIA driver: test"))
    wait_opened(monitor)
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    run_phase(monitor, 0.2)
    split.set_status("incomplete", "test")
    report = _report(monitor, split, [])
    assert "GPU sampling: off (no NVIDIA driver: test)" in report.lines
    assert report.frame is not None and len(report.frame) >= 2
    assert report.frame["gpu index"].isna().all()
