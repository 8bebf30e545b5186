"""Summaries, phase attribution, the resources block and the resources.tsv frame, on
hand-made samples with exact expected values."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from sidecar.resources.fields import GPU_FIELDS, columns
from sidecar.resources.samplers.folding import (
    PhaseAttribution,
    attribute_phases,
    summarize_gpus,
    summarize_host,
)
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.sinks.layout import WIDTH
from sidecar.sinks.resources_text import resources_block, resources_frame

S = 1_000_000_000
START = 1_000 * S  # run start on the monotonic clock
TIMES = [START, START + 1 * S, START + 3 * S, START + 4 * S]  # uneven spacing


def gpu_sample(t_ns: int, index: int = 0, **fields: float | str | None) -> GpuSample:
    values: dict[str, float | str | None] = {
        "util_pct": 50.0,
        "mem_util_pct": 10.0,
        "mem_used_mib": 100.0,
        "mem_total_mib": 1000.0,
        "power_w": 100.0,
        "power_source": "instant",
        "energy_j": None,
        "temperature_c": 50.0,
        "sm_clock_mhz": 1000.0,
        "sm_activity_pct": None,
        "job_mem_mib": 80.0,
        "job_sm_util_pct": 40.0,
    }
    values.update(fields)
    return GpuSample(
        t_ns=t_ns, gpu_index=index, uuid=f"GPU-{index}", name=f"Fake {index}", **values
    )  # type: ignore[arg-type]


def gpu0(energy: bool = True) -> list[GpuSample]:
    """util 10, 40, 70, 100; power 100..400 W; counter 1000, 1200, 1800, 2200 J."""
    return [
        gpu_sample(
            t,
            util_pct=u,
            power_w=p,
            energy_j=e if energy else None,
            mem_used_mib=m,
            temperature_c=c,
            mem_util_pct=u / 2,
        )
        for t, u, p, e, m, c in zip(
            TIMES,
            (10.0, 40.0, 70.0, 100.0),
            (100.0, 200.0, 300.0, 400.0),
            (1000.0, 1200.0, 1800.0, 2200.0),
            (100.0, 900.0, 300.0, 200.0),
            (40.0, 70.0, 60.0, 50.0),
            strict=True,
        )
    ]


def gpu1() -> list[GpuSample]:
    return [gpu_sample(t, index=1, util_pct=0.0, power_w=50.0) for t in TIMES]


def test_time_weighted_gpu_summary() -> None:
    [summary] = summarize_gpus(gpu0())
    # Each sample weighs the window since the one before: 1 s, 2 s, 1 s; the first opens.
    assert summary.figures["util_mean_pct"] == pytest.approx((40 * 1 + 70 * 2 + 100 * 1) / 4)  # 70
    assert summary.figures["util_max_pct"] == 100.0
    assert summary.figures["mem_util_mean_pct"] == pytest.approx(35.0)
    assert summary.figures["power_mean_w"] == pytest.approx((200 + 300 * 2 + 400) / 4)  # 300
    assert (summary.figures["energy_j"], summary.figures["energy_method"]) == (1200.0, "counter")
    figures = summary.figures
    assert figures["mem_used_peak_mib"] == 900.0 and figures["mem_total_mib"] == 1000.0
    assert figures["temperature_max_c"] == 70.0 and figures["job_mem_peak_mib"] == 80.0
    assert figures["sm_activity_mean_pct"] is None
    assert (summary.n_samples, summary.duration_s, figures["power_source"]) == (4, 4.0, "instant")


def test_energy_integrated_from_power_without_a_counter() -> None:
    [summary] = summarize_gpus(gpu0(energy=False))
    assert summary.figures["energy_j"] == pytest.approx(200 * 1 + 300 * 2 + 400 * 1)
    assert summary.figures["energy_method"] == "integrated power"


def test_gpus_kept_apart_and_ordered_single_sample_plain() -> None:
    samples = (
        gpu1()
        + gpu0()
        + [gpu_sample(START, index=2, util_pct=30.0, power_source="average", sm_activity_pct=12.0)]
    )
    summaries = summarize_gpus(samples)
    assert [s.gpu_index for s in summaries] == [0, 1, 2]
    second, lone = summaries[1].figures, summaries[2].figures
    assert second["util_mean_pct"] == 0.0 and second["power_mean_w"] == 50.0
    assert (lone["util_mean_pct"], lone["sm_activity_mean_pct"], lone["energy_j"]) == (
        30.0,
        12.0,
        None,
    )
    assert lone["power_source"] == "average"


def test_host_summary() -> None:
    samples = [
        HostSample(t, cpu, rss, None, mem, 3)
        for t, cpu, rss, mem in zip(
            TIMES[:3], (0.0, 100.0, 50.0), (10.0, 30.0, 20.0), (40.0, 45.0, 42.0), strict=True
        )
    ]
    summary = summarize_host(samples[::-1])  # order does not matter
    assert summary.figures["cpu_mean_pct"] == pytest.approx((100 * 1 + 50 * 2) / 3)
    assert (summary.figures["rss_peak_mib"], summary.figures["uss_peak_mib"]) == (30.0, None)
    assert (summary.figures["system_mem_used_max_pct"], summary.n_samples) == (45.0, 3)


def attribution(
    samples: list[GpuSample],
    intervals: list[tuple[str, int, int]],
) -> dict[str, PhaseAttribution]:
    """``attribute_phases`` over (label, start, end) intervals, keyed by label."""
    labels = list(dict.fromkeys(label for label, _, _ in intervals))
    phases, starts, ends = (
        np.array(column, dtype=np.int64)
        for column in zip(
            *[(labels.index(label), start, end) for label, start, end in intervals], strict=True
        )
    )
    return {
        labels[key]: part for key, part in attribute_phases(samples, phases, starts, ends).items()
    }


def test_attribution_by_overlap() -> None:
    intervals = [
        ("Forward", START + S // 2, START + 3 * S // 2),  # 0.5-1.5 s
        ("Forward", START + 5 * S // 2, START + 7 * S // 2),  # 2.5-3.5 s
        ("Backward", START + 7 * S // 2, START + 9 * S // 2),  # 3.5-4.5 s
        ("Idle", START + 10 * S, START + 11 * S),
    ]  # after the last
    result = attribution(gpu0(), intervals)
    # Forward overlaps window (0,1] by 0.5 s (util 40), (1,3] by 1 s (70), (3,4] by 0.5 s.
    assert result["Forward"] == PhaseAttribution(
        covered_s=2.0,
        n_samples=3,
        util_mean_pct=pytest.approx(70.0),
        power_mean_w=pytest.approx(300.0),
    )
    assert result["Backward"] == PhaseAttribution(0.5, 1, 100.0, 400.0)
    assert result["Idle"] == PhaseAttribution(0.0, 0, None, None)
    assert list(result) == ["Forward", "Backward", "Idle"]
    # With a second GPU (0 %, 50 W) the means are over both GPUs; time covered is the same.
    both = attribution(gpu0() + gpu1(), intervals)["Forward"]
    assert (both.covered_s, both.n_samples) == (2.0, 3)
    assert both.util_mean_pct == pytest.approx(35.0)
    assert both.power_mean_w == pytest.approx(175.0)


def test_attribution_without_gpu_samples() -> None:
    assert attribution([], [("Forward", 0, S)]) == {"Forward": PhaseAttribution(0.0, 0, None, None)}


def test_resources_frame_gpu_rows_joined_with_host() -> None:
    host = [
        HostSample(t, 150.0, 500.0, 400.0 if i == 0 else None, 30.0, 4) for i, t in enumerate(TIMES)
    ]
    frame = resources_frame(gpu1() + gpu0(), host, START)
    assert tuple(frame.columns) == columns()
    assert len(frame) == 8
    assert list(frame["time (s)"]) == [0.0, 0.0, 1.0, 1.0, 3.0, 3.0, 4.0, 4.0]
    assert list(frame["gpu index"]) == [0, 1] * 4
    first = frame.iloc[0]
    assert (first["gpu name"], first["gpu uuid"], first["power source"]) == (
        "Fake 0",
        "GPU-0",
        "instant",
    )
    assert (first["utilization (%)"], first["energy (J)"]) == (10.0, 1000.0)
    assert list(frame["host cpu (%)"]) == [150.0] * 8
    assert frame["job memory uss (MB)"].iloc[:2].tolist() == [400.0, 400.0]
    assert frame["job memory uss (MB)"].iloc[2:].isna().all()


def test_resources_frame_cpu_only_and_empty() -> None:
    host = [HostSample(START + S // 2, 80.0, 200.0, None, 25.0, 2)]
    frame = resources_frame([], host, START)
    assert tuple(frame.columns) == columns() and len(frame) == 1
    row = frame.iloc[0]
    assert row["time (s)"] == 0.5 and row["host cpu (%)"] == 80.0
    gpu_columns = [f.column for f in GPU_FIELDS]
    assert frame[gpu_columns].isna().all(axis=None)
    empty = resources_frame([], [], START)
    assert tuple(empty.columns) == columns() and empty.empty


def test_resources_frame_host_rounds_after_gpu_sampling_stopped() -> None:
    host = [HostSample(t, 10.0, 1.0, None, 5.0, 1) for t in TIMES]
    frame = resources_frame(gpu0()[:2], host, START)
    assert list(frame["time (s)"]) == [0.0, 1.0, 3.0, 4.0]
    assert frame["gpu index"].isna().tolist() == [False, False, True, True]


def test_resources_block_with_gpu_off() -> None:
    host = summarize_host(
        [
            HostSample(START, 0.0, 10.0, None, 20.0, 1),
            HostSample(START + S, 100.0, 12.0, 11.0, 21.0, 1),
        ]
    )
    lines = resources_block(
        [],
        host,
        "no NVIDIA driver: NVML Shared Library Not Found",
        {},
        ["Records: dropped 3, rejected 2"],
    )
    assert lines[:3] == [
        "Resources",
        "-" * WIDTH,
        "GPU sampling: off (no NVIDIA driver: NVML Shared Library Not Found)",
    ]
    assert lines[-1] == "Records: dropped 3, rejected 2"
    text = "\n".join(lines)
    assert "mean 100.0 (100 = one core)" in text and "RSS peak 12, USS peak 11" in text
    assert "GPU utilization and power" not in text


def test_resources_block_with_gpus_and_attribution() -> None:
    samples = gpu0() + gpu1()
    long_label = "A custom phase with a very long name that will not fit the column"
    by_label = attribution(
        samples, [("Forward", START, START + 4 * S), (long_label, START, START + S)]
    )
    lines = resources_block(
        summarize_gpus(samples), None, None, by_label, ["Records: dropped 0, rejected 0"]
    )
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert "GPU 0: 'Fake 0' GPU-0 (4 samples over 4.0 s)" in text
    assert "mean 70.0, max 100.0" in text and "(instant)" in text
    assert "1.200e+03 (counter)" in text
    assert "GPU sampling" not in text and "Host" not in text
    row = next(line for line in lines if line.startswith("Forward "))
    cells = [cell.strip() for cell in row.split("|")]
    assert cells == ["Forward", "4.00", "3", "35.0", "175.0"]
    assert any(line.startswith(long_label[:40] + " |") for line in lines)
    assert lines[-1] == "Records: dropped 0, rejected 0"


def test_resources_block_fields_missing() -> None:
    summary = summarize_gpus(
        [gpu_sample(START, power_w=None, power_source=None, temperature_c=None)]
    )[0]
    text = "\n".join(resources_block([summary], None, None, {}, ["Records: none"]))
    assert "Power (W)" in text and "mean n/a" in text
    assert "Energy (J)                n/a" in text
    assert "SM activity" not in text  # optional field absent: no line


def test_a_mig_instance_says_its_power_and_energy_are_the_whole_gpus() -> None:
    samples = [
        gpu_sample(t, power_source="energy", energy_j=1000.0 + i, whole_gpu_uuid="GPU-whole")
        for i, t in enumerate(TIMES)
    ]
    [summary] = summarize_gpus(samples)
    assert summary.whole_gpu_uuid == "GPU-whole" and summary.figures["power_source"] == "energy"
    text = "\n".join(resources_block([summary], None, None, {}, []))
    assert "the whole GPU GPU-whole" in text and "shared by its MIG instances" in text
    assert all(len(line) <= WIDTH for line in text.splitlines())
    frame = resources_frame(samples, [], START)
    assert set(frame["power source"]) == {"energy (whole GPU, shared)"}


def test_the_power_source_is_that_of_the_weighed_samples() -> None:
    """The first sample (a point reading before any energy window) weighs nothing."""
    samples = [
        gpu_sample(t, power_source="instant" if i == 0 else "energy") for i, t in enumerate(TIMES)
    ]
    assert summarize_gpus(samples)[0].figures["power_source"] == "energy"


def overlap_by_hand(
    samples: list[GpuSample],
    intervals: list[tuple[str, int, int]],
) -> dict[str, tuple[float, int, float | None, float | None]]:
    """The attribution written the plain way: every interval against every window."""
    rounds = sorted({s.t_ns for s in samples})
    out = {}
    for label in dict.fromkeys(label for label, _, _ in intervals):
        covered, windows, util, power = 0, set(), [0.0, 0.0], [0.0, 0.0]
        for name, start, end in intervals:
            for i in range(1, len(rounds)):
                overlap = min(end, rounds[i]) - max(start, rounds[i - 1])
                if name != label or overlap <= 0:
                    continue
                covered += overlap
                windows.add(i)
                for s in samples:
                    if s.t_ns == rounds[i]:
                        for acc, value in ((util, s.util_pct), (power, s.power_w)):
                            if value is not None:
                                acc[0] += overlap * value
                                acc[1] += overlap
        out[label] = (
            covered / 1e9,
            len(windows),
            util[0] / util[1] if util[1] else None,
            power[0] / power[1] if power[1] else None,
        )
    return out


@pytest.mark.parametrize("seed", range(30))
def test_attribution_matches_the_plain_computation(seed: int) -> None:
    rng = random.Random(seed)
    times = sorted(rng.sample(range(0, 20 * S, S // 10), rng.randint(0, 12)))
    samples = [
        gpu_sample(
            t,
            index=g,
            util_pct=rng.choice([None, rng.uniform(0, 100)]),
            power_w=rng.choice([None, rng.uniform(50, 500)]),
        )
        for t in times
        for g in range(rng.randint(1, 3))
    ]
    intervals = []
    for _ in range(rng.randint(1, 40)):
        start = rng.randrange(-S, 21 * S)
        intervals.append(
            (
                rng.choice(["Forward", "Backward", "Epoch", "custom"]),
                start,
                start + rng.choice([0, rng.randrange(S // 100), rng.randrange(8 * S)]),
            )
        )
    got = attribution(samples, intervals)
    expected = overlap_by_hand(samples, intervals)
    assert list(got) == list(expected)
    for label, (covered_s, windows, util, power) in expected.items():
        part = got[label]
        assert (part.covered_s, part.n_samples) == (covered_s, windows), label
        assert part.util_mean_pct == (pytest.approx(util) if util is not None else None)
        assert part.power_mean_w == (pytest.approx(power) if power is not None else None)


def test_attribution_from_driver_samples_before_a_second_round() -> None:
    """The first round of a GPU with driver samples: no round window exists yet, the
    driver's own windows give the utilization (the sidecar's first tick after a phase)."""
    sample = dataclasses.replace(gpu_sample(START + S), util_windows=((START, START + S, 80.0),))
    result = attribution([sample], [("Forward", START + S // 4, START + 3 * S // 4)])
    assert result["Forward"].util_mean_pct == pytest.approx(80.0)
    assert result["Forward"].power_mean_w is None  # power comes by rounds: none yet
