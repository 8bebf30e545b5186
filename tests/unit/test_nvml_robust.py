"""The NVML sampler where real drivers differ from the happy path: any exception of one
call, transient errors and slow rounds, pid namespaces, memory v2, power from the energy
counter, MIG instances. Against the fake NVML, which behaves as the real one does there."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from sidecar.resources.samplers.nvml import MAX_STUCK_THREADS, NvmlUnavailable, open_nvml
from tests.support.fake_pynvml import MIB, FakeGpu, FakeNvml, opened

UUIDS = ["GPU-aaaa0000-0000-0000-0000-000000000000", "GPU-bbbb0000-0000-0000-0000-000000000000"]
MIGS = ["MIG-cccc0000-0000-0000-0000-000000000000", "MIG-dddd0000-0000-0000-0000-000000000000"]
ME, FOREIGN = os.getpid(), 99_999_999  # above any pid_max: no process here has it


@pytest.fixture
def nvml() -> Iterator[FakeNvml]:
    fake = FakeNvml([FakeGpu(uuid=u, name=f"Fake {i}") for i, u in enumerate(UUIDS)])
    yield fake
    fake.release.set()


# ---- any exception degrades one call of one GPU ------------------------------------


def test_library_mismatch_switches_off_that_call_of_that_gpu_only(nvml: FakeNvml) -> None:
    nvml.gpus[0].mismatch = {"nvmlDeviceGetComputeRunningProcesses"}
    nvml.gpus[0].compute_procs = nvml.gpus[1].compute_procs = [(ME, 100 * MIB)]
    sampler = opened(nvml)
    for t in range(3):
        first, second = sampler.sample({ME}, t)
        assert first.util_pct == 50.0 and first.job_mem_mib == 0.0  # graphics list only
        assert second.job_mem_mib == 100.0
    assert nvml.count("nvmlDeviceGetComputeRunningProcesses", nvml.gpus[0]) == 1
    assert "compute processes" in sampler.status()["gpus"][0]["unsupported"]
    assert not sampler.failed


def test_an_unknown_value_type_falls_back_to_the_averaged_power(nvml: FakeNvml) -> None:
    nvml.gpus[0].power_value_type = 17
    nvml.gpus[0].energy_constant = True  # no energy-based power: the readings are used
    sampler = opened(nvml, "0")
    [sample] = sampler.sample(set(), 1)
    assert (sample.power_w, sample.power_source) == (200.0, "average")
    assert (
        "unknown NVML value type 17" in sampler.status()["gpus"][0]["unsupported"]["instant power"]
    )


def test_a_transient_error_is_retried_not_switched_off_for_good(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.flaky["nvmlDeviceGetTemperature"] = 3  # UNKNOWN three times, then fine
    sampler = opened(nvml, "0")
    temperatures = [sampler.sample(set(), t)[0].temperature_c for t in range(12)]
    assert temperatures[0] is None and temperatures[-1] == 60.0
    # backoff 1, 2, 4 rounds: tried in rounds 1, 2, 4, 8 -> back from round 8 on
    assert nvml.count("nvmlDeviceGetTemperature", gpu) == 4 + 4
    assert sampler.status()["gpus"][0]["retrying"] == {}
    assert not sampler.status()["gpus"][0]["lost"]


def test_a_gpu_that_stops_answering_for_a_while_comes_back(nvml: FakeNvml) -> None:
    sampler = opened(nvml)
    nvml.gpus[0].flaky.update({"nvmlDeviceGetUtilizationRates": 1, "nvmlDeviceGetUUID": 1})
    assert [s.gpu_index for s in sampler.sample(set(), 1)] == [1]
    assert "device" in sampler.status()["gpus"][0]["retrying"]
    assert [s.gpu_index for s in sampler.sample(set(), 2)] == [0, 1]
    assert not sampler.status()["gpus"][0]["lost"]


def test_a_slow_gpu_loses_its_own_sample_and_sampling_goes_on(nvml: FakeNvml) -> None:
    nvml.gpus[1].slow = {"nvmlDeviceGetTemperature": 0.6}
    sampler = opened(nvml, round_timeout_s=0.2)
    # the other GPUs' readings came back within the deadline: only GPU 1's is lost
    assert [s.gpu_index for s in sampler.sample(set(), 1)] == [0]
    status = sampler.status()
    assert status["gpu_sampling"] == "on"
    assert "did not return within 0.2 s" in status["gpus"][1]["retrying"]["temperature"]
    samples = sampler.sample(set(), 2)  # the slow call waits its turn; the rest goes on
    assert len(samples) == 2 and samples[1].temperature_c is None
    nvml.gpus[1].slow = {}
    time.sleep(0.6)  # the abandoned thread comes back and finds its round cancelled
    later = [sampler.sample(set(), t) for t in range(3, 8)]
    assert later[-1][1].temperature_c == 60.0 and not sampler.failed


def test_one_slow_gpu_of_eight_loses_only_its_own_sample() -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}{i}{i}{i}eeee") for i in range(8)])
    fake.gpus[5].slow = {"nvmlDeviceGetMemoryInfo": 2.0}  # the whole round's deadline over
    sampler = opened(fake, round_timeout_s=0.5)
    began = time.monotonic()
    samples = sampler.sample(set(), 1)
    waited_s = time.monotonic() - began
    assert [s.gpu_index for s in samples] == [0, 1, 2, 3, 4, 6, 7]
    assert all(s.util_pct == 50.0 and s.mem_used_mib == 1000.0 for s in samples)
    assert waited_s < 1.9  # one deadline for the round, not one per GPU nor the slow call
    assert "memory v2" in sampler.status()["gpus"][5]["retrying"]
    fake.release.set()


def test_a_call_that_hangs_twice_does_not_stop_sampling() -> None:
    nvml = FakeNvml([FakeGpu(uuid=f"GPU-{i}{i}{i}{i}dddd") for i in range(4)])
    hung = nvml.gpus[2]
    hung.hang = {"nvmlDeviceGetUtilizationRates"}
    sampler = opened(nvml, round_timeout_s=0.2)
    rounds = 0
    while sampler.status()["gpus"][2]["stuck_calls"] < MAX_STUCK_THREADS and rounds < 40:
        samples = sampler.sample(set(), rounds)
        assert {0, 1, 3} <= {s.gpu_index for s in samples}  # the others every round
        rounds += 1
    assert rounds < 40 and not sampler.failed and not sampler.hung
    # GPU 2 is skipped while its two threads are stuck; the rest goes on
    assert [s.gpu_index for s in sampler.sample(set(), rounds)] == [0, 1, 3]
    assert sampler.status()["gpu_sampling"] == "on"
    hung.hang = set()
    nvml.release.set()  # the driver comes back: the stuck calls return
    deadline = time.monotonic() + 10
    while sampler.status()["gpus"][2]["stuck_calls"] and time.monotonic() < deadline:
        time.sleep(0.01)
    later = range(rounds + 1, rounds + 80)
    indices = [s.gpu_index for r in later for s in sampler.sample(set(), r)]
    assert 2 in indices  # sampled again: one call that hung twice stopped nothing for good


def test_every_gpu_wedged_is_hung_until_a_call_returns(nvml: FakeNvml) -> None:
    for gpu in nvml.gpus:
        gpu.hang = {"nvmlDeviceGetUtilizationRates"}
    sampler = opened(nvml, round_timeout_s=0.2)
    start = time.monotonic()
    rounds = 0
    while not sampler.hung and rounds < 40:  # each retry of a hung call leaves a thread
        samples = sampler.sample(set(), rounds)
        assert all(s.mem_used_mib == 1000.0 for s in samples)  # the rest of each GPU goes on
        rounds += 1
    assert time.monotonic() - start < 10
    assert sampler.hung and "did not return within 0.2 s on every GPU" in str(sampler.reason)
    assert not sampler.failed
    for gpu in nvml.gpus:
        gpu.hang = set()
    nvml.release.set()
    deadline = time.monotonic() + 10
    while sampler.hung and time.monotonic() < deadline:
        sampler.sample(set(), rounds)
        rounds += 1
        time.sleep(0.01)
    assert not sampler.hung and sampler.reason is None


def test_the_expensive_calls_are_made_once_per_period(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.compute_procs = [(os.getpid(), 300 * MIB)]
    sampler = opened(nvml, "0", slow_period_s=5.0)
    per_round = [sampler.sample({os.getpid()}, t * 1_000_000_000)[0] for t in range(11)]
    # rounds at 0 s, 5 s and 10 s read the process list; the others do not
    assert [s.job_mem_mib for s in per_round] == [300.0 if t % 5 == 0 else None for t in range(11)]
    assert nvml.count("nvmlDeviceGetComputeRunningProcesses", gpu) == 3
    assert nvml.count("nvmlDeviceGetProcessUtilization", gpu) == 3
    assert nvml.count("nvmlDeviceGetUtilizationRates", gpu) == 11


# ---- processes: no sample, other pid namespaces ------------------------------------


def test_pids_of_another_namespace_make_the_job_figures_unknown_not_zero(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.compute_procs = [(FOREIGN, 900 * MIB)]  # the host's pid of our own process
    gpu.proc_samples = [(FOREIGN, time.time_ns() // 1000 + 10_000_000, 70)]
    sampler = opened(nvml, "0")
    [sample] = sampler.sample({ME}, 1)
    assert sample.job_mem_mib is None and sample.job_sm_util_pct is None
    assert "another pid namespace" in sampler.status()["gpus"][0]["notes"]["job pids"]


def test_a_job_in_a_child_pid_namespace_is_found_by_its_inner_pid(nvml: FakeNvml) -> None:
    """A real child in its own pid namespace (unshare): NVML lists it by its inner pid 1."""
    child = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "sleep", "30"]
    )
    try:
        inner = None
        deadline = time.monotonic() + 10
        while inner is None and time.monotonic() < deadline:
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                if f"PPid:\t{child.pid}\n" in status and "NSpid:" in status:
                    inner = pid
            time.sleep(0.05)
        if inner is None:
            pytest.skip("unshare could not make a pid namespace here")
        nvml.gpus[0].compute_procs = [(1, 300 * MIB)]  # pid 1 in its namespace
        sampler = opened(nvml, "0")
        assert sampler.sample({inner}, 1)[0].job_mem_mib == 300.0
    finally:
        child.kill()
        child.wait()


# ---- memory v2, power from the energy counter -------------------------------------


def test_memory_v1_where_v2_is_missing_counts_reserved_memory(nvml: FakeNvml) -> None:
    nvml.gpus[0].mem_reserved = nvml.gpus[1].mem_reserved = 500 * MIB
    nvml.gpus[1].memory_v2 = False
    first, second = opened(nvml).sample(set(), 1)
    assert first.mem_used_mib == 1000.0  # v2: reserved memory is not "used"
    assert second.mem_used_mib == 1500.0  # v1, the only thing an old driver has


def test_power_is_the_energy_counters_mean_over_the_window(nvml: FakeNvml) -> None:
    gpu = nvml.gpus[0]
    gpu.power_avg_mw = 180_000  # what the counter integrates; the instant field says 250
    sampler = opened(nvml, "0")
    t0 = time.monotonic_ns()
    assert sampler.sample(set(), t0)[0].power_source == "instant"  # no window yet
    time.sleep(1.0)
    [sample] = sampler.sample(set(), time.monotonic_ns())
    assert sample.power_source == "energy"
    assert abs(sample.power_w - 180.0) < 180.0 * 0.25  # 100 ms steps of the counter
    assert nvml.count("nvmlDeviceGetFieldValues", gpu) == 1  # not read once ΔE/Δt works


# ---- MIG -------------------------------------------------------------------------


@pytest.fixture
def mig() -> FakeNvml:
    whole = FakeGpu(
        uuid=UUIDS[0],
        name="NVIDIA A100",
        mig=[
            FakeGpu(
                uuid=MIGS[0],
                name="NVIDIA A100 MIG 1g.5gb",
                mem_used=300 * MIB,
                mem_total=4864 * MIB,
            ),
            FakeGpu(uuid=MIGS[1], name="NVIDIA A100 MIG 1g.5gb"),
        ],
    )
    return FakeNvml([whole, FakeGpu(uuid=UUIDS[1])])


def test_mig_instance_named_in_cuda_visible_devices_is_sampled(mig: FakeNvml) -> None:
    sampler = opened(mig, MIGS[0])
    assert sampler.uuids == [MIGS[0]]
    [sample] = sampler.sample(set(), 1)
    assert sample.uuid == MIGS[0] and sample.mem_used_mib == 300.0  # the instance's
    assert sample.util_pct is None  # NVML does not give a MIG instance's utilization
    # power, energy, temperature: the whole GPU's, shared, and said so
    assert sample.power_w == 250.0 and sample.energy_j == 5000.0
    assert sample.temperature_c == 60.0 and sample.whole_gpu_uuid == UUIDS[0]
    assert sampler.status()["gpus"][0]["whole_gpu"] == UUIDS[0]


def test_mig_instance_reported_by_the_markers_with_either_prefix(mig: FakeNvml) -> None:
    sampler = opened(mig, "1")
    assert sampler.add_uuids(["GPU-" + MIGS[1][4:]]) == [MIGS[1]]
    assert [s.uuid for s in sampler.sample(set(), 1)] == [UUIDS[1], MIGS[1]]


def test_mig_calls_that_fail_leave_the_gpu_whole(nvml: FakeNvml) -> None:
    nvml.gpus[0].unsupported = {"nvmlDeviceGetMigMode"}
    assert opened(nvml).uuids == UUIDS


def test_init_failing_with_any_exception_is_a_reason_not_a_crash() -> None:
    fake = FakeNvml([FakeGpu(uuid=UUIDS[0])])
    fake.nvmlInit = lambda: (_ for _ in ()).throw(pynvml.NVMLLibraryMismatchError("old"))
    result = open_nvml(None, api=fake)
    assert "NVML initialisation failed" in result.reason


def test_start_and_collect_never_wait_for_a_slow_gpu() -> None:
    """The loop's form: ``start`` hands the readings over, ``collect`` takes what is back;
    neither waits for GPU 5's 2 s call. Its rounds are handed back at its deadline with
    the other 7 GPUs' samples, and a round starting while it is still in its reading
    does not ask it again (a missed round, not a queue behind the slow call)."""
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}{i}{i}{i}eeee") for i in range(8)])
    fake.gpus[5].slow = {"nvmlDeviceGetMemoryInfo": 2.0}
    sampler = opened(fake, round_timeout_s=0.5)
    longest_s = 0.0
    rounds: list[tuple[int, list[int]]] = []
    began = time.monotonic()
    stamp = 0
    while len(rounds) < 4 and time.monotonic() - began < 20:
        look = time.monotonic()
        if stamp < 4:
            sampler.start(set(), stamp)
            stamp += 1
        rounds += [(t, [s.gpu_index for s in samples]) for t, samples in sampler.collect()]
        longest_s = max(longest_s, time.monotonic() - look)
        time.sleep(0.01)
    assert longest_s < 0.25  # a look never waits for the slow call (nor the 0.5 s deadline)
    assert rounds == [(t, [0, 1, 2, 3, 4, 6, 7]) for t in range(4)]  # in order, 7 each
    assert sampler.status()["gpus"][5]["missed_rounds"] == 4
    assert not sampler.busy
    fake.release.set()


def test_a_failed_sampler_keeps_its_reason_through_the_loops_looks(nvml: FakeNvml) -> None:
    nvml.gpus[1].hang = {"nvmlDeviceGetName"}  # adding the GPU hangs: the sampler fails
    sampler = open_nvml(None, api=nvml, round_timeout_s=0.2, candidates_only=True)
    assert not isinstance(sampler, NvmlUnavailable)
    sampler.add_uuids([UUIDS[1]])
    assert sampler.failed
    sampler.start(set(), 1)
    assert sampler.collect() == [(1, [])]  # its round, empty
    assert "adding GPUs did not return within 0.2 s" in str(sampler.reason)
