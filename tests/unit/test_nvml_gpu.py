"""The real NVML path, on a machine with an NVIDIA GPU and driver; skipped elsewhere."""

from __future__ import annotations

import os
import time

import pytest

from sidecar.model.straggler_gpu import reason_names
from sidecar.resources.samplers.nvml import NvmlSampler, open_nvml

pytestmark = pytest.mark.gpu


@pytest.fixture
def sampler() -> NvmlSampler:
    result = open_nvml(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not isinstance(result, NvmlSampler):
        pytest.skip(f"GPU sampling unavailable: {result.reason}")
    return result


def test_real_nvml_samples_are_sane(sampler: NvmlSampler) -> None:
    pids = {os.getpid()}
    try:
        first = sampler.sample(pids, time.monotonic_ns())
        time.sleep(1.2)
        second = sampler.sample(pids, time.monotonic_ns())
    finally:
        status = sampler.status()
        sampler.close()
    assert not sampler.failed, sampler.reason
    assert status["gpu_sampling"] == "on"
    assert len(first) == len(second) == len(sampler.uuids) >= 1
    for sample in second:
        assert sample.uuid.startswith(("GPU-", "MIG-")) and sample.name
        assert sample.util_pct is not None and 0 <= sample.util_pct <= 100
        assert sample.mem_total_mib is not None and sample.mem_total_mib > 1000
        assert sample.mem_used_mib is not None
        assert 0 <= sample.mem_used_mib <= sample.mem_total_mib
        if sample.power_w is not None:
            assert 1 < sample.power_w < 2000
            assert sample.power_source in ("energy", "instant", "average")
        if sample.temperature_c is not None:
            assert 0 < sample.temperature_c < 120
        if sample.sm_activity_pct is not None:
            assert 0 <= sample.sm_activity_pct <= 100
        # the clocks event (throttle) reasons: every bit set is one NVML documents
        assert isinstance(sample.throttle_reasons, int)
        assert not any(n.startswith("0x") for n in reason_names(sample.throttle_reasons))
        assert sample.job_mem_mib is None or sample.job_mem_mib >= 0
        assert sample.job_sm_util_pct is None or 0 <= sample.job_sm_util_pct <= 100
    for before, after in zip(first, second, strict=True):
        if before.energy_j is not None and after.energy_j is not None:
            assert after.energy_j >= before.energy_j


def test_the_drivers_own_utilization_samples_cover_the_round(sampler: NvmlSampler) -> None:
    """nvmlDeviceGetSamples on a real whole GPU: every driver sample since the last round,
    each over its own period (1/6 s to 1 s by product), on the monotonic clock."""
    try:
        sampler.sample(set(), time.monotonic_ns())
        time.sleep(2.5)
        now_ns = time.monotonic_ns()
        second = sampler.sample(set(), now_ns)
    finally:
        status = sampler.status()
        sampler.close()
    for sample, gpu in zip(second, status["gpus"], strict=True):
        if sample.whole_gpu_uuid is not None:
            continue  # a MIG instance: the driver keeps no utilization samples for it
        assert "utilization samples" not in gpu["unsupported"], gpu
        windows = sample.util_windows
        assert windows, "no driver sample in 2.5 s"
        periods_s = [(end - start) / 1e9 for start, end, _ in windows[1:]]
        assert all(0.01 < p <= 1.1 for p in periods_s), periods_s
        assert all(0 <= pct <= 100 for _, _, pct in windows)
        assert now_ns - 3_000_000_000 < windows[-1][1] <= now_ns + 50_000_000  # same clock
        covered_s = sum(end - start for start, end, _ in windows) / 1e9
        assert covered_s > 1.0, covered_s  # most of the 2.5 s, not one period
