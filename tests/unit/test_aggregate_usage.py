"""InnerEye's aggregate_resource_usage.csv (sidecar.sinks.aggregate_text): per GPU the
mean then the max of its figures, and the CPU's rows, also without any GPU."""

from __future__ import annotations

from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml_gpu import GpuSample
from sidecar.sinks.aggregate_text import aggregate_text


def _host(cpu_pct: float, memory_pct: float) -> HostSample:
    return HostSample(
        t_ns=0,
        cpu_pct=cpu_pct,
        rss_mib=100.0,
        uss_mib=None,
        system_mem_used_pct=memory_pct,
        n_processes=1,
    )


def _gpu(util_pct: float, used_mib: float, job_mib: float) -> GpuSample:
    # NVML faked by its sample's shape: the one part that may be
    return GpuSample(
        t_ns=0,
        gpu_index=0,
        uuid="GPU-0",
        name="fake",
        util_pct=util_pct,
        mem_util_pct=None,
        mem_used_mib=used_mib,
        mem_total_mib=1000.0,
        power_w=None,
        power_source=None,
        energy_j=None,
        temperature_c=None,
        sm_clock_mhz=None,
        sm_activity_pct=None,
        job_mem_mib=job_mib,
        job_sm_util_pct=None,
    )


def test_without_a_gpu_the_cpu_rows_alone() -> None:
    text = aggregate_text([], [_host(100.0, 20.0), _host(300.0, 30.0)], 4, {0: []})
    assert text.splitlines() == [
        "gpu,metric,value",
        "CPU,Load_Percent,50.0",  # 200 % of one core of 4 cores
        "CPU,MemUtil_Percent,25.0",
        "CPU,MaxLoad_Percent,75.0",
        "CPU,MaxMemUtil_Percent,30.0",
    ]


def test_gpus_first_then_the_cpu_means_then_maxima() -> None:
    samples = [_gpu(10.0, 100.0, 512.0), _gpu(30.0, 300.0, 1536.0)]
    text = aggregate_text(samples, [_host(50.0, 10.0)], 1, {0: [1.5, 2.5]})
    assert text.splitlines() == [
        "gpu,metric,value",
        "GPU0,MemUtil_Percent,20.0",
        "GPU0,Load_Percent,20.0",
        "GPU0,MemReserved_GB,1.0",
        "GPU0,MemAllocated_GB,2.0",
        "CPU,Load_Percent,50.0",
        "CPU,MemUtil_Percent,10.0",
        "GPU0,MaxMemUtil_Percent,30.0",
        "GPU0,MaxLoad_Percent,30.0",
        "GPU0,MaxMemReserved_GB,1.5",
        "GPU0,MaxMemAllocated_GB,2.5",
        "CPU,MaxLoad_Percent,50.0",
        "CPU,MaxMemUtil_Percent,10.0",
    ]
