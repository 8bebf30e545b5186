"""The real NVML path, on a machine with an NVIDIA GPU and driver; skipped elsewhere."""

from __future__ import annotations

import os
import time

import pytest

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
        assert sample.job_mem_mib is None or sample.job_mem_mib >= 0
        assert sample.job_sm_util_pct is None or 0 <= sample.job_sm_util_pct <= 100
    for before, after in zip(first, second, strict=True):
        if before.energy_j is not None and after.energy_j is not None:
            assert after.energy_j >= before.energy_j
