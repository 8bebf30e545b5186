"""The sidecar's resource monitor: sampling per split and per-phase attribution, with the
small pynvml fake standing in for absent GPUs and this test process as the job.
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from markers import wire
from sidecar.model.aggregator import Settings
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor
from sidecar.resources.samplers.nvml import NvmlUnavailable, open_nvml
from sidecar.sinks.resources_text import resources_block, resources_frame
from tests.support.fake_pynvml import UTIL_WINDOW_S, FakeGpu, FakeNvml

INTERVAL_S = 0.05


class FakeClock:
    """The monitor's and the fake NVML's monotonic clock (ns), moved by the test only."""

    def __init__(self) -> None:
        self.now_ns = time.monotonic_ns()

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += round(seconds * 1e9)


CLOCK = FakeClock()


def make_split(tmp_path: Path) -> Split:
    split = Split(tmp_path, 0, Settings(), {"start_unix": time.time()})
    split.rank(0).begin_session(time.time(), CLOCK())
    return split


def fake_nvml(gpus: list[FakeGpu]) -> Callable[[str | None], Any]:
    """The monitor's ``open_gpus``: the fake NVML on the test's clock."""
    return lambda visible: open_nvml(visible, api=FakeNvml(gpus, clock_ns=CLOCK))


def monitor_of(
    interval_s: float, share: bool, open_gpus: Callable[[str | None], Any]
) -> ResourceMonitor:
    # NVML stamps its samples on the real wall clock and the sampler starts from "now":
    # a test clock left behind the real one would make every driver sample look older.
    CLOCK.now_ns = max(CLOCK.now_ns, time.monotonic_ns())
    return ResourceMonitor(
        interval_s, None, all_splits_share_gpus=share, open_gpus=open_gpus, clock_ns=CLOCK
    )


def wait_opened(monitor: ResourceMonitor) -> None:
    deadline = time.monotonic() + 10
    while monitor.gpu_off_reason == "starting NVML" and time.monotonic() < deadline:
        time.sleep(0.01)


def taken_in(monitor: ResourceMonitor) -> None:
    """Let the loop look until the GPU readings out are back: the test's clock does not
    move meanwhile, so each round is taken in at the time it was stamped."""
    deadline = time.monotonic() + 10
    while monitor.collecting and time.monotonic() < deadline:
        time.sleep(0.001)
        monitor.tick()


def run_phase(monitor: ResourceMonitor, seconds: float) -> tuple[int, int]:
    """Keep sampling for ``seconds`` of the test's clock, without sleeping; the interval
    it covered (ns)."""
    start = CLOCK()
    while CLOCK() - start < seconds * 1e9:
        monitor.tick()
        taken_in(monitor)
        CLOCK.advance(INTERVAL_S / 5)
    return start, CLOCK()


@dataclass(frozen=True)
class _Report:
    lines: list[str]
    frame: pd.DataFrame | None


def _report(monitor: ResourceMonitor, split: Split, records_lines: list[str]) -> _Report:
    """What the writer makes of the monitor's figures: the block's lines and the frame."""
    monitor.final_round(split)
    figures = monitor.figures(split)
    lines = resources_block(
        figures.gpus, figures.host, figures.gpu_off_reason, figures.attribution, records_lines
    )
    frame = (
        resources_frame(figures.gpu_samples, figures.host_samples, figures.run_start_ns)
        if figures.host_samples or figures.gpu_samples
        else None
    )
    return _Report(lines, frame)


def test_gpu_use_is_attributed_to_the_phases_that_ran(tmp_path: Path) -> None:
    gpus = [FakeGpu(uuid="GPU-aaaa", name="Fake A"), FakeGpu(uuid="GPU-bbbb", name="Fake B")]
    monitor = monitor_of(INTERVAL_S, True, fake_nvml(gpus))
    wait_opened(monitor)
    assert monitor.gpus is not None
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    records = array("q")
    # Phases of whole driver windows, begun on the driver's grid: a phase that began
    # mid-window would share that window with its neighbour by a share that depends on
    # where the clock happened to stand, up to a third of a short phase.
    window_ns = int(UTIL_WINDOW_S * 1e9)
    CLOCK.now_ns = -(-CLOCK.now_ns // window_ns) * window_ns
    for label_id, util, power_mw in (
        (wire.FORWARD, 95, 300_000),
        (wire.TRAINING_DATA_LOADING, 5, 80_000),
        (wire.FORWARD, 95, 300_000),
    ):
        for gpu in gpus:
            gpu.util, gpu.power_instant_mw, gpu.power_avg_mw = util, power_mw, power_mw
        start, end = run_phase(monitor, 4 * UTIL_WINDOW_S)
        records.extend(
            (label_id, 0, 0, -1, 0, start, end, -1, -1) + (0,) * (wire.RECORD_WIDTH - 9)
        )  # fields after peak_bytes
    monitor.note_records(split, 0, records)
    split.set_status("completed", None)
    report = _report(monitor, split, ["Records: test"])

    text = "\n".join(report.lines)
    assert "GPU 0: 'Fake A' GPU-aaaa" in text and "GPU 1: 'Fake B' GPU-bbbb" in text
    table = {
        line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
        for line in report.lines
        if line.count("|") == 4
    }
    forward_util, loading_util = (
        float(table["Forward"][2]),
        float(table["Training data loading"][2]),
    )
    # A phase ends on the test clock's next step after its last window (a few ms): only
    # that sliver of a neighbour's window is mixed in.
    assert forward_util > 85 and loading_util < 15
    assert float(table["Forward"][3]) > 200 > float(table["Training data loading"][3])
    assert report.lines[-1] == "Records: test"
    frame = report.frame
    assert frame is not None
    assert set(frame["gpu uuid"].dropna()) == {"GPU-aaaa", "GPU-bbbb"}
    assert (frame["job memory rss (MB)"].dropna() > 10).all()  # this process, in MiB


def test_a_split_takes_only_the_gpus_its_job_reported(tmp_path: Path) -> None:
    gpus = [FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")]
    monitor = monitor_of(INTERVAL_S, False, fake_nvml(gpus))
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


def test_a_mig_instance_the_job_reported_is_sampled_for_its_split(tmp_path: Path) -> None:
    whole = FakeGpu(uuid="GPU-aaaa", mig=[FakeGpu(uuid="MIG-cccc", name="Fake MIG 1g.5gb")])
    monitor = monitor_of(INTERVAL_S, False, fake_nvml([whole]))
    wait_opened(monitor)
    split = make_split(tmp_path)
    split.add_gpu("GPU-cccc", "Fake MIG 1g.5gb")  # an older marker's spelling of a MIG UUID
    monitor.add_gpu("GPU-cccc")
    monitor.watch(split, os.getpid())
    run_phase(monitor, 0.2)
    split.set_status("completed", None)
    report = _report(monitor, split, [])
    assert report.frame is not None and set(report.frame["gpu uuid"].dropna()) == {"MIG-cccc"}
    assert "shared by its MIG instances" in "\n".join(report.lines)


def test_without_a_driver_gpu_sampling_is_off_and_host_sampling_goes_on(tmp_path: Path) -> None:
    monitor = monitor_of(
        INTERVAL_S, True, lambda visible: NvmlUnavailable("no NVIDIA driver: test")
    )
    wait_opened(monitor)
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    run_phase(monitor, 0.2)
    split.set_status("incomplete", "test")
    report = _report(monitor, split, [])
    assert "GPU sampling: off (no NVIDIA driver: test)" in report.lines
    assert report.frame is not None and len(report.frame) >= 2
    assert report.frame["gpu index"].isna().all()


def test_utilization_and_power_go_to_the_phase_the_gpu_was_running(tmp_path: Path) -> None:
    """The GPU runs a forward's work long after the host launched it (the host meanwhile
    waits in "metrics"), and the records arrive seconds late. Attributed on GPU time,
    Forward gets the busy GPU and the data loading the idle one; on host time Forward
    would read idle (its host interval is a 10 ms launch), and late records were lost."""
    cycle_s, cycles = 1.5, 2
    gpus = [FakeGpu(uuid="GPU-aaaa", name="Fake A", busy=[])]
    # 0.2 s rounds: two 100 ms steps of the energy counter per window, as in real use
    monitor = monitor_of(0.2, True, fake_nvml(gpus))
    wait_opened(monitor)
    # the timeline from the clock the monitor started on (monitor_of may move it up to
    # the real one, which tests run before on this worker left behind)
    origin = CLOCK() + 200_000_000
    ns = 1_000_000_000
    gpus[0].busy = [
        (origin + int((c * cycle_s + 0.2) * ns), origin + int((c * cycle_s + 0.8) * ns))
        for c in range(cycles)
    ]
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    records = array("q")
    for c in range(cycles):
        at = origin + int(c * cycle_s * ns)
        ms = 1_000_000
        records.extend((wire.FORWARD, 0, 0, -1, 0, at, at + 10 * ms, 600 * ms, -1, 0, 200 * ms))
        records.extend(
            (wire.METRICS, 0, 0, -1, 0, at + 10 * ms, at + 800 * ms, 10 * ms, -1, 0, 790 * ms)
        )
        records.extend(
            (wire.TRAINING_DATA_LOADING, 0, 0, -1, 0, at + 800 * ms, at + 1500 * ms, -1, -1, 0, 0)
        )
    run_phase(monitor, 0.2 + cycle_s * cycles + 0.3)
    CLOCK.advance(2.2)  # the records come more than 2 s after their phases
    monitor.note_records(split, 0, records)
    split.set_status("completed", None)
    monitor.final_round(split)
    attribution = monitor.figures(split).attribution
    forward, loading = attribution["Forward"], attribution["Training data loading"]
    assert abs(forward.covered_s - 1.2) < 0.05  # both cycles' GPU time, none dropped
    assert forward.util_mean_pct is not None and loading.util_mean_pct is not None
    assert forward.util_mean_pct > 70 and loading.util_mean_pct < 25
    assert forward.power_mean_w is not None and loading.power_mean_w is not None
    assert forward.power_mean_w > 200 > loading.power_mean_w  # 300 W busy, 80 W idle
    assert attribution["Metrics computation"].covered_s < 0.05  # its own 10 ms of GPU


def test_samples_restored_from_an_earlier_session_open_no_attribution_window(
    tmp_path: Path,
) -> None:
    gpus = [FakeGpu(uuid="GPU-aaaa", name="Fake A")]
    monitor = monitor_of(INTERVAL_S, True, fake_nvml(gpus))
    wait_opened(monitor)
    earlier = make_split(tmp_path / "earlier")
    monitor.watch(earlier, os.getpid())
    gpus[0].util = 100  # the earlier session: the GPU fully busy
    run_phase(monitor, 0.4)
    old_gpu = list(monitor.splits[id(earlier)][1].gpu_samples)
    old_host = list(monitor.splits[id(earlier)][1].host_samples)
    split = make_split(tmp_path / "now")
    monitor.watch(split, os.getpid())
    monitor.restore(split, old_gpu, old_host)
    gpus[0].util = 0  # this session: idle
    # A resume starts after some downtime; one driver window of it keeps the window that
    # saw the earlier session's last busy moments out of this session's phases.
    CLOCK.advance(UTIL_WINDOW_S)
    start, end = run_phase(monitor, 0.6)
    monitor.note_records(
        split,
        0,
        array(
            "q", (wire.FORWARD, 0, 0, -1, 0, start, end, -1, -1) + (0,) * (wire.RECORD_WIDTH - 9)
        ),
    )
    split.set_status("completed", None)
    monitor.final_round(split)
    figures = monitor.figures(split)
    assert len(figures.gpu_samples) > len(old_gpu)  # the earlier samples are kept
    # Forward ran only in this session: the busy rounds restored before it do not count.
    assert figures.attribution["Forward"].util_mean_pct == 0.0


def _eight_gpus(on: dict[int, int]) -> list[FakeGpu]:
    """8 GPUs of a node; ``on`` maps a GPU index to a pid listed on it (1 GiB)."""
    return [
        FakeGpu(
            uuid=f"GPU-{i}{i}{i}{i}cccc-0000-0000-0000-00000000000{i}",
            compute_procs=[(on[i], 1 << 30)] if i in on else [(1, 1 << 20)],
        )
        for i in range(8)
    ]


def test_a_ranks_private_sidecar_opens_only_its_gpus(tmp_path: Path) -> None:
    gpus = _eight_gpus({3: os.getpid()})  # this rank's process runs on GPU 3 only
    fake = FakeNvml(gpus, clock_ns=CLOCK)
    CLOCK.now_ns = max(CLOCK.now_ns, time.monotonic_ns())
    monitor = ResourceMonitor(
        INTERVAL_S,
        None,  # CUDA_VISIBLE_DEVICES unset: all 8 visible, as under torchrun
        all_splits_share_gpus=True,
        open_gpus=lambda visible, **kw: open_nvml(visible, api=fake, **kw),
        clock_ns=CLOCK,
        private=True,
    )
    split = make_split(tmp_path)
    monitor.watch(split, os.getpid())
    wait_opened(monitor)
    run_phase(monitor, 1.0)
    assert monitor.gpus is not None and monitor.gpus.uuids == [gpus[3].uuid]
    per_gpu = [fake.count("nvmlDeviceGetUtilizationRates", gpu) for gpu in gpus]
    assert per_gpu[3] > 0 and sum(per_gpu) == per_gpu[3]  # no other GPU is sampled
    assert [uuid for uuid, _ in split.gpus] == [gpus[3].uuid]
    [summary] = monitor.figures(split).gpus
    assert summary.uuid == gpus[3].uuid


def test_a_two_gpu_process_reports_both(tmp_path: Path) -> None:
    """device_map / DataParallel: one process on GPUs 0 and 1 reports only GPU 0 (its
    markers' device); the run's GPU list, utilization, power and energy cover both."""
    gpus = _eight_gpus({0: os.getpid(), 1: os.getpid()})
    gpus[1].util = 90
    monitor = monitor_of(INTERVAL_S, False, fake_nvml(gpus))  # the node daemon's way
    split = make_split(tmp_path)
    split.add_gpu(gpus[0].uuid, gpus[0].name)
    monitor.add_gpu(gpus[0].uuid)
    monitor.watch(split, os.getpid())
    wait_opened(monitor)
    run_phase(monitor, 1.0)
    assert [uuid for uuid, _ in split.gpus] == [gpus[0].uuid, gpus[1].uuid]
    summaries = {g.uuid: g for g in monitor.figures(split).gpus}
    assert set(summaries) == {gpus[0].uuid, gpus[1].uuid}
    second = summaries[gpus[1].uuid].figures
    assert second["util_mean_pct"] == 90.0
    assert second["power_mean_w"] is not None and second["energy_j"] is not None
