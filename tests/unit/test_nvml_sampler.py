"""The NVML sampler against the fake NVML: every field, every failure, the GPU mapping."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import numpy as np
import pynvml
import pytest

from sidecar.resources.samplers.folding import attribute_phases, summarize_gpus
from sidecar.resources.samplers.nvml import GpuSample, NvmlUnavailable, open_nvml
from sidecar.resources.samplers.nvml_devices import NvmlDevice, resolve_visible_devices
from tests.support.fake_pynvml import MIB, FakeGpu, FakeNvml, opened, periodic_busy

UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(4)]
# Pids that exist in this pid namespace (this test, its parent, init) and one that cannot
ME, PARENT, INIT, FOREIGN = os.getpid(), os.getppid(), 1, 99_999_999


def now_us() -> int:
    return time.time_ns() // 1000


@pytest.fixture
def nvml() -> Iterator[FakeNvml]:
    fake = FakeNvml([FakeGpu(uuid=u, name=f"Fake {i}") for i, u in enumerate(UUIDS)])
    yield fake
    fake.release.set()  # let a thread blocked in a "hung" call finish


def test_every_field_with_units(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[1]
    gpu.compute_procs = [(ME, 300 * MIB), (INIT, 700 * MIB)]
    gpu.mem_reserved = 500 * MIB  # held by the driver: not "used" (memory v2)
    gpu.throttle_reasons = 0x8 | 0x40  # hw slowdown, hw thermal slowdown
    sampler = opened(nvml, "1")
    [sample] = sampler.sample({ME}, 123)
    assert sample.util_windows is not None  # the driver's samples: tested on their own
    assert dataclasses.replace(sample, util_windows=None) == GpuSample(
        t_ns=123,
        gpu_index=0,
        uuid=UUIDS[1],
        name="Fake 1",
        util_pct=50.0,
        mem_util_pct=20.0,
        mem_used_mib=1000.0,
        mem_total_mib=8000.0,
        power_w=250.0,
        power_source="instant",
        energy_j=5000.0,
        temperature_c=60.0,
        sm_clock_mhz=1400.0,
        sm_activity_pct=None,
        job_mem_mib=300.0,
        job_sm_util_pct=None,
        throttle_reasons=0x48,
        job_pids=(ME,),  # the job's pid on its process list (INIT is not the job's)
    )  # no per-process sample yet: unknown
    assert sampler.status() == {
        "gpu_sampling": "on",
        "reason": None,
        "gpus": [
            {
                "index": 0,
                "uuid": UUIDS[1],
                "name": "Fake 1",
                "lost": False,
                "lost_reason": None,
                "power_source": "instant",
                "unsupported": {"sm activity": "GPM not supported on this GPU (Hopper and newer)"},
                "retrying": {},
                "notes": {},
                "whole_gpu": None,
                "stuck_calls": 0,
                "missed_rounds": 0,
            }
        ],
    }
    sampler.close()
    assert nvml.calls[("nvmlShutdown", None)] == 1
    assert sampler.status()["gpu_sampling"] == "off"


def test_job_memory_only_from_the_jobs_pids(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.compute_procs = [(ME, 100 * MIB), (PARENT, 200 * MIB), (INIT, 4000 * MIB)]
    gpu.graphics_procs = [(ME, 100 * MIB)]  # in both lists: once
    sampler = opened(nvml, "0")
    assert sampler.sample({ME, PARENT}, 1)[0].job_mem_mib == 300.0
    assert sampler.sample({INIT}, 2)[0].job_mem_mib == 4000.0
    gpu.compute_procs, gpu.graphics_procs = [(INIT, 4000 * MIB)], []
    assert sampler.sample({ME}, 3)[0].job_mem_mib == 0.0  # listed pids are ours: truly 0
    sample = sampler.sample(set(), 4)[0]  # no pids known: not measured, not queried
    assert sample.job_mem_mib is None and sample.job_sm_util_pct is None
    assert nvml.count("nvmlDeviceGetComputeRunningProcesses", gpu) == 3


def test_process_utilization_carries_the_last_seen_timestamp(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    t0 = now_us() + 10_000_000  # samples "from the future" of the sampler's start
    gpu.proc_samples = [(ME, t0 + 1, 30), (PARENT, t0 + 2, 25), (INIT, t0 + 3, 40)]
    sampler = opened(nvml, "0")
    assert sampler.sample({ME, PARENT}, 1)[0].job_sm_util_pct == 55.0
    # Nothing newer than t0 + 3: NVML says NotFound: no sample, not 0 %.
    assert sampler.sample({ME, PARENT}, 2)[0].job_sm_util_pct is None
    gpu.proc_samples.append((ME, t0 + 10, 80))  # only ME active; PARENT absent -> 0 %
    assert sampler.sample({ME, PARENT}, 3)[0].job_sm_util_pct == 80.0
    gpu.proc_samples.append((INIT, t0 + 11, 80))  # only another process of ours: job 0 %
    assert sampler.sample({ME, PARENT}, 4)[0].job_sm_util_pct == 0.0
    # Two samples of one pid in a window are averaged; the sum is capped at 100.
    gpu.proc_samples += [(ME, t0 + 20, 90), (ME, t0 + 21, 70), (PARENT, t0 + 22, 60)]
    assert sampler.sample({ME, PARENT}, 5)[0].job_sm_util_pct == 100.0
    assert "process utilization" not in sampler.status()["gpus"][0]["unsupported"]


def test_samples_from_before_the_sampler_started_are_not_counted(nvml: FakeNvml) -> None:
    nvml.gpus[0].proc_samples = [(ME, now_us() - 5_000_000, 90)]
    assert opened(nvml, "0").sample({ME}, 1)[0].job_sm_util_pct is None


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_GPU_NOT_FOUND]
)
def test_errors_that_mean_the_gpu_is_gone(nvml: FakeNvml, code: int) -> None:
    sampler = opened(nvml, "0,1")
    nvml.gpus[0].errors = {"nvmlDeviceGetTotalEnergyConsumption": code}
    assert [s.gpu_index for s in sampler.sample(set(), 1)] == [1]
    assert sampler.status()["gpus"][0]["lost"]


def test_resolve_visible_devices_rules() -> None:
    table = [NvmlDevice(i, uuid, None) for i, uuid in enumerate(UUIDS)]
    assert resolve_visible_devices("1,1,3", table) == [UUIDS[1], UUIDS[3]]
    assert resolve_visible_devices("2,9,0", table) == [UUIDS[2]]  # stops at an unknown entry
    assert resolve_visible_devices("GPU-", table) == []  # ambiguous prefix
    assert resolve_visible_devices("0000aaaa", table) == [UUIDS[0]]  # "GPU-" left out
    assert resolve_visible_devices("MIG-1234", table) == []
    assert resolve_visible_devices("", table) == []


def test_unsupported_field_is_none_and_asked_once(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.unsupported = {"nvmlDeviceGetTemperature", "nvmlDeviceGetTotalEnergyConsumption"}
    sampler = opened(nvml, "0")
    for t in range(5):
        [sample] = sampler.sample(set(), t)
        assert sample.temperature_c is None and sample.energy_j is None
        assert sample.util_pct == 50.0 and sample.sm_clock_mhz == 1400.0
    assert nvml.count("nvmlDeviceGetTemperature", gpu) == 1
    assert nvml.count("nvmlDeviceGetTotalEnergyConsumption", gpu) == 1
    assert nvml.count("nvmlDeviceGetUtilizationRates", gpu) == 5
    assert set(sampler.status()["gpus"][0]["unsupported"]) >= {"temperature", "energy"}


def test_other_nvml_error_on_a_live_gpu_switches_only_that_call_off(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.errors = {"nvmlDeviceGetClockInfo": pynvml.NVML_ERROR_NO_PERMISSION}
    sampler = opened(nvml, "0")
    sampler.sample(set(), 1)
    [sample] = sampler.sample(set(), 2)
    assert sample.sm_clock_mhz is None and sample.util_pct == 50.0
    assert nvml.count("nvmlDeviceGetClockInfo", gpu) == 1
    assert not sampler.status()["gpus"][0]["lost"]


def test_power_falls_back_to_average_and_says_so(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.power_instant_mw = None
    gpu.energy_constant = True  # a counter that does not move gives no window mean
    sampler = opened(nvml, "0")
    for t in range(3):
        [sample] = sampler.sample(set(), t)
        assert (sample.power_w, sample.power_source) == (200.0, "average")
    assert nvml.count("nvmlDeviceGetFieldValues", gpu) == 1
    assert sampler.status()["gpus"][0]["power_source"] == "average"


def test_no_power_at_all(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.power_instant_mw = None
    gpu.unsupported = {"nvmlDeviceGetPowerUsage"}
    [sample] = opened(nvml, "0").sample(set(), 0)
    assert (sample.power_w, sample.power_source) == (None, None)


def test_gpm_sm_activity_from_the_second_round(nvml: FakeNvml) -> None:
    nvml.gpus[0].gpm = True
    nvml.gpus[0].gpm_sm_util = 42.5
    sampler = opened(nvml, "0")
    assert sampler.sample(set(), 1)[0].sm_activity_pct is None
    assert sampler.sample(set(), 2)[0].sm_activity_pct == 42.5
    assert sampler.sample(set(), 3)[0].sm_activity_pct == 42.5
    sampler.close()
    assert nvml.calls[("nvmlGpmSampleFree", None)] == 2


def test_job_memory_from_one_list_when_the_other_is_unsupported(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.compute_procs = [(10, 100 * MIB)]
    gpu.unsupported = {"nvmlDeviceGetGraphicsRunningProcesses"}
    sampler = opened(nvml, "0")
    assert sampler.sample({10}, 1)[0].job_mem_mib == 100.0
    gpu.unsupported.add("nvmlDeviceGetComputeRunningProcesses")
    assert sampler.sample({10}, 2)[0].job_mem_mib is None


def test_lost_gpu_is_skipped_and_the_others_continue(nvml: FakeNvml) -> None:
    sampler = opened(nvml, "0,1,2")
    assert [s.gpu_index for s in sampler.sample(set(), 1)] == [0, 1, 2]
    nvml.gpus[1].lost = True
    samples = sampler.sample(set(), 2)
    assert [(s.gpu_index, s.uuid) for s in samples] == [(0, UUIDS[0]), (2, UUIDS[2])]
    calls = nvml.count("nvmlDeviceGetUtilizationRates", nvml.gpus[1])
    assert len(sampler.sample(set(), 3)) == 2
    assert nvml.count("nvmlDeviceGetUtilizationRates", nvml.gpus[1]) == calls  # skipped
    status = sampler.status()
    assert status["gpu_sampling"] == "on"
    assert [g["lost"] for g in status["gpus"]] == [False, True, False]
    assert "GPU is lost" in status["gpus"][1]["lost_reason"]


def test_every_gpu_lost_turns_sampling_off(nvml: FakeNvml) -> None:
    sampler = opened(nvml, "0")
    nvml.gpus[0].lost = True
    assert sampler.sample(set(), 1) == []
    assert sampler.status()["gpu_sampling"] == "off"


def test_a_hanging_init_is_reported(nvml: FakeNvml) -> None:
    nvml.init_hang = True
    start = time.monotonic()
    result = open_nvml(None, timeout_s=0.3, api=nvml)
    assert time.monotonic() - start < 5
    assert result == NvmlUnavailable("nvmlInit timed out after 0.3 s")


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_no_driver(code: int) -> None:
    result = open_nvml(None, api=FakeNvml([], init_error=code))
    assert isinstance(result, NvmlUnavailable)
    assert result.reason.startswith("no NVIDIA driver: ")
    assert "\n" not in result.reason
    assert result.status() == {"gpu_sampling": "off", "reason": result.reason, "gpus": []}


def test_no_gpu() -> None:
    fake = FakeNvml([])
    assert open_nvml(None, api=fake) == NvmlUnavailable("no GPU: NVML lists no device")
    assert not fake.initialised  # shut down again


def test_visible_devices_naming_no_gpu(nvml: FakeNvml) -> None:
    for visible in ("", "7", "GPU-ffff"):
        result = open_nvml(visible, api=nvml)
        assert isinstance(result, NvmlUnavailable)
        assert result.reason.startswith("no GPU: CUDA_VISIBLE_DEVICES=")


def test_visible_devices_by_index_and_uuid(nvml: FakeNvml) -> None:
    by_index = opened(nvml, "2,0")
    assert by_index.uuids == [UUIDS[2], UUIDS[0]]
    assert [s.uuid for s in by_index.sample(set(), 0)] == [UUIDS[2], UUIDS[0]]
    assert opened(nvml, f"{UUIDS[3]}, GPU-1111").uuids == [UUIDS[3], UUIDS[1]]
    assert opened(nvml, None).uuids == UUIDS


def test_add_uuids_reported_later(nvml: FakeNvml) -> None:
    sampler = opened(nvml, "0")
    # torch reports UUIDs without the "GPU-" prefix
    assert sampler.add_uuids([UUIDS[2][4:], UUIDS[0], "GPU-not-a-gpu"]) == [UUIDS[2]]
    assert sampler.add_uuids([UUIDS[2]]) == []
    assert [(s.gpu_index, s.uuid) for s in sampler.sample(set(), 1)] == [
        (0, UUIDS[0]),
        (1, UUIDS[2]),
    ]


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot, or reload the nvidia kernel modules"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "/dev/nvidia*"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "update the driver"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "Xid"),
    ],
)
def test_an_init_failure_says_what_it_means_and_what_to_do(code: int, advice: str) -> None:
    result = open_nvml(None, api=FakeNvml([], init_error=code))
    assert isinstance(result, NvmlUnavailable)
    assert result.reason.startswith("NVML initialisation failed: NVMLError_")
    assert advice in result.reason and "\n" not in result.reason


def test_utilization_per_phase_comes_from_the_drivers_samples_not_the_rounds() -> None:
    """The driver samples every 1/6 s; the rounds come every 0.5 s, in step with a loop that
    is busy for the first 1/3 s of each 0.5 s and idle for the rest. The round's reading
    (the driver's last period only) always sees the idle part: attributed per round,
    both phases would read ~0 %. Each driver sample over its own period gives the truth."""
    window_ns = round(1e9 / 6)
    origin = (time.monotonic_ns() // window_ns + 2) * window_ns  # on the driver's grid
    cycle_ns, cycles = 3 * window_ns, 4
    busy = [(origin + c * cycle_ns, origin + c * cycle_ns + 2 * window_ns) for c in range(cycles)]
    fake = FakeNvml([FakeGpu(uuid=UUIDS[0], busy=busy)])
    sampler = opened(fake)
    samples = []
    for c in range(cycles + 1):  # one round at the end of each cycle
        while time.monotonic_ns() < origin + c * cycle_ns:
            time.sleep(0.005)
        samples += sampler.sample(set(), time.monotonic_ns())
    assert all(s.util_windows is not None for s in samples)
    starts = np.array([b for b, _ in busy] + [e for _, e in busy], dtype=np.int64)
    ends = np.array([e for _, e in busy] + [e + window_ns for _, e in busy], dtype=np.int64)
    phases = np.array([0] * cycles + [1] * cycles)
    parts = attribute_phases(samples, phases, starts, ends)
    busy_pct, idle_pct = parts[0].util_mean_pct, parts[1].util_mean_pct
    assert busy_pct is not None and busy_pct > 90, parts  # busy: Forward, say
    assert idle_pct is not None and idle_pct < 10, parts  # idle: data loading


def test_without_driver_samples_the_rounds_reading_stands_for_the_round() -> None:
    fake = FakeNvml([FakeGpu(uuid=UUIDS[0], util=70, unsupported={"nvmlDeviceGetSamples"})])
    sampler = opened(fake)
    samples = [sampler.sample(set(), t)[0] for t in (1_000, 2_000)]
    assert [s.util_windows for s in samples] == [None, None]
    assert "utilization samples" in sampler.status()["gpus"][0]["unsupported"]
    parts = attribute_phases(samples, np.array([0]), np.array([1_200]), np.array([1_800]))
    assert parts[0].util_mean_pct == 70.0


def test_a_driver_period_as_long_as_the_round_is_learnt_from_one_sample_a_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A product whose driver samples once a second, read by 1 s rounds: one new sample
    per round. Its period comes from the spacing to the sample seen before."""
    monkeypatch.setattr("tests.support.fake_pynvml.UTIL_WINDOW_S", 0.25)
    sampler = opened(FakeNvml([FakeGpu(uuid=UUIDS[0])]))
    windows = []
    for _ in range(4):
        time.sleep(0.26)  # one driver sample per round
        windows += sampler.sample(set(), time.monotonic_ns())[0].util_windows or ()
    lengths = [end - start for start, end, _ in windows[1:]]  # the first: since added
    assert lengths and all(abs(length - 250_000_000) < 2_000_000 for length in lengths), lengths


def test_the_energy_reading_is_stamped_when_taken_not_when_the_round_began(
    nvml: FakeNvml,
) -> None:
    # A slow call before the energy counter's (a driver taking 0.4 s on utilization) puts
    # its delay into the energy between two readings: the window's mean power must divide
    # by it too, or a 200 W GPU reads 2-3x that.
    gpu = nvml.gpus[0]
    sampler = opened(nvml, "0")
    sampler.sample(set(), time.monotonic_ns())
    time.sleep(0.2)
    gpu.slow = {"nvmlDeviceGetUtilizationRates": 0.4}
    [sample] = sampler.sample(set(), time.monotonic_ns())
    assert sample.power_source == "energy"
    # the counter steps every 100 ms: a 0.6 s window holds 0.5-0.7 s of energy
    assert 150.0 <= sample.power_w <= 250.0, sample.power_w


def test_a_window_shorter_than_the_counters_step_gives_the_last_windows_power(
    nvml: FakeNvml,
) -> None:
    # An extra round 5 ms after a scheduled one (a new split sampled at once): the counter
    # may have stepped by 100 ms of energy in between, which over 5 ms reads kilowatts.
    sampler = opened(nvml, "0")
    sampler.sample(set(), time.monotonic_ns())
    time.sleep(0.3)
    [scheduled] = sampler.sample(set(), time.monotonic_ns())
    assert scheduled.power_source == "energy" and 100.0 <= scheduled.power_w <= 300.0
    for _ in range(20):  # extra rounds inside one window, across counter steps
        time.sleep(0.01)
        [extra] = sampler.sample(set(), time.monotonic_ns())
        assert extra.power_source == "energy" and 100.0 <= extra.power_w <= 300.0, extra.power_w


def test_the_run_mean_is_right_for_a_loop_that_beats_with_the_rounds() -> None:
    """Busy the first 0.3 s of every second, read at each whole second: the driver's last
    period before every round is idle, but the run was 30 % busy."""
    clock = [(time.monotonic_ns() // 1_000_000_000 + 1) * 1_000_000_000]
    gpu = FakeGpu(uuid=UUIDS[0], busy=periodic_busy(clock[0], 30, period_s=1.0, busy_s=0.3))
    sampler = opened(FakeNvml([gpu], clock_ns=lambda: clock[0]))
    samples = []
    for _ in range(20):
        [sample] = sampler.sample(set(), clock[0])
        samples.append(sample)
        clock[0] += 1_000_000_000
    assert {s.util_windows is not None for s in samples} == {True}
    [summary] = summarize_gpus(samples)
    assert summary.figures["util_mean_pct"] == pytest.approx(30.0, abs=1.0)
    # each round of resources.tsv holds its own second, not the idle moment before it
    assert all(s.util_pct == pytest.approx(30.0, abs=1.0) for s in samples[1:])
