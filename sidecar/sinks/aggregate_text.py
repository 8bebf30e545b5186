"""InnerEye's ``aggregate_resource_usage.csv``, written beside resources.tsv on every run
(with or without exports, with or without a GPU): ``gpu,metric,value``, the mean of each
figure per GPU and for the host's CPU, then its maximum (``Max`` prefixed).

Rows, in InnerEye's names and meaning (docs/exports.md):

* ``GPU<i>``: ``MemUtil_Percent`` (memory used of the GPU's total), ``Load_Percent`` (NVML
  utilization), ``MemReserved_GB`` (the job's device memory, GiB) over every GPU sample;
  ``MemAllocated_GB``: per stored training step, the highest allocator peak of its
  Forward, Backward and Optimization (GiB), on the GPU of the exported rank;
* ``CPU``: ``Load_Percent`` (the job's CPU as a share of all the machine's cores) and
  ``MemUtil_Percent`` (system memory used), over every host sample.

Percentages are rounded to 2 decimals, GB to 4, as InnerEye wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml_gpu import GpuSample

AGGREGATE_FILE = "aggregate_resource_usage.csv"  # InnerEye's name, beside resources.tsv
HEADER = "gpu,metric,value"
MIB_PER_GIB = 1024.0
CPU_NAME = "CPU"  # the ``gpu`` column of the host's rows, as its TensorBoard tags' prefix


def _add(figures: dict[str, list[float]], metric: str, value: float | None) -> None:
    if value is not None and value == value:  # NaN: not read
        figures.setdefault(metric, []).append(float(value))


def aggregate_text(
    gpu_samples: Iterable[GpuSample],
    host_samples: Iterable[HostSample],
    cpu_count: int,
    allocated: dict[int, Sequence[float]],
) -> str:
    """The file's text: per GPU index (from ``gpu_samples``, and ``allocated``: GPU index
    -> per-step allocator peaks, GiB) and for the CPU (``host_samples``; ``cpu_count``:
    the machine's logical CPUs), each figure's mean, then each one's maximum."""
    rows: dict[str, dict[str, list[float]]] = {}
    for sample in gpu_samples:
        figures = rows.setdefault(f"GPU{sample.gpu_index}", {})
        _add(figures, "MemUtil_Percent", sample.mem_used_pct)
        _add(figures, "Load_Percent", sample.util_pct)
        job_mib = sample.job_mem_mib
        _add(figures, "MemReserved_GB", None if job_mib is None else job_mib / MIB_PER_GIB)
    for index, peaks in sorted(allocated.items()):
        if peaks:
            rows.setdefault(f"GPU{index}", {})["MemAllocated_GB"] = list(peaks)
    gpus = sorted(rows, key=lambda name: int(name[3:]))
    for host in host_samples:
        figures = rows.setdefault(CPU_NAME, {})
        _add(figures, "Load_Percent", host.cpu_pct / max(cpu_count, 1))
        _add(figures, "MemUtil_Percent", host.system_mem_used_pct)
    order = [*gpus, CPU_NAME] if CPU_NAME in rows else gpus
    lines = [HEADER]
    for prefix, rule in (("", lambda v: sum(v) / len(v)), ("Max", max)):
        for name in order:
            for metric, values in rows[name].items():
                digits = 2 if metric.endswith("Percent") else 4
                lines.append(f"{name},{prefix}{metric},{round(rule(values), digits)}")
    return "\n".join(lines) + "\n"
