"""Resource figures over several sessions (one training process each: the first, then one
per resume). Each session's samples are summarized on their own, since its first sample
opens a new clock (the time between two processes is nobody's) and an energy counter
read in two processes spans the downtime between them; the summaries are then merged:
counts and energy add up, means are weighted by each session's sampled duration, maxima
and peaks take the largest.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeVar

from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.resources.samplers.summary import (
    GpuSummary,
    HostSummary,
    summarize_gpus,
    summarize_host,
)

S = TypeVar("S", GpuSample, HostSample)


def session_of(t_ns: int, starts_ns: Sequence[int]) -> int:
    """The session (index into ``starts_ns``, the sessions' start times in order) that a
    sample taken at ``t_ns`` belongs to; samples before the first start go to session 0."""
    return max(0, bisect.bisect_right(starts_ns, t_ns) - 1)


def by_session(samples: Sequence[S], starts_ns: Sequence[int]) -> list[list[S]]:
    """``samples`` grouped by session, in session order (empty sessions left out)."""
    groups: dict[int, list[S]] = {}
    for sample in samples:
        groups.setdefault(session_of(sample.t_ns, starts_ns), []).append(sample)
    return [groups[k] for k in sorted(groups)]


def _weighted(values: Sequence[float | None], weights: Sequence[float]) -> float | None:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    if total <= 0:
        return sum(v for v, _ in pairs) / len(pairs)
    return sum(v * w for v, w in pairs) / total


def _largest(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _one_or_mixed(values: Sequence[str | None]) -> str | None:
    present = {v for v in values if v is not None}
    return (present.pop() if len(present) == 1 else "mixed") if present else None


def _merge_gpu(parts: list[GpuSummary]) -> GpuSummary:
    weights = [p.duration_s for p in parts]

    def mean(field: Callable[[GpuSummary], float | None]) -> float | None:
        return _weighted([field(p) for p in parts], weights)

    energies = [p.energy_j for p in parts if p.energy_j is not None]
    last = parts[-1]
    return GpuSummary(
        gpu_index=last.gpu_index, uuid=last.uuid, name=last.name,
        n_samples=sum(p.n_samples for p in parts), duration_s=sum(weights),
        util_mean_pct=mean(lambda p: p.util_mean_pct),
        util_max_pct=_largest([p.util_max_pct for p in parts]),
        mem_util_mean_pct=mean(lambda p: p.mem_util_mean_pct),
        mem_used_peak_mib=_largest([p.mem_used_peak_mib for p in parts]),
        mem_total_mib=_largest([p.mem_total_mib for p in parts]),
        power_mean_w=mean(lambda p: p.power_mean_w),
        power_source=_one_or_mixed([p.power_source for p in parts]),
        energy_j=sum(energies) if energies else None,
        energy_method=_one_or_mixed([p.energy_method for p in parts]),
        temperature_max_c=_largest([p.temperature_max_c for p in parts]),
        job_mem_peak_mib=_largest([p.job_mem_peak_mib for p in parts]),
        sm_activity_mean_pct=mean(lambda p: p.sm_activity_mean_pct),
    )


def summarize_gpus_over_sessions(samples: Sequence[GpuSample],
                                 starts_ns: Sequence[int]) -> list[GpuSummary]:
    """Per GPU (by UUID, ordered by ``gpu_index``): each session summarized, then merged."""
    per_gpu: dict[str, list[GpuSummary]] = {}
    for group in by_session(samples, starts_ns):
        for summary in summarize_gpus(group):
            per_gpu.setdefault(summary.uuid, []).append(summary)
    return sorted((_merge_gpu(parts) for parts in per_gpu.values()),
                  key=lambda g: g.gpu_index)


def summarize_host_over_sessions(samples: Sequence[HostSample],
                                 starts_ns: Sequence[int]) -> HostSummary:
    """The job's processes over every session: each summarized, then merged."""
    groups = by_session(samples, starts_ns)
    parts = [summarize_host(group) for group in groups]
    weights = [(g[-1].t_ns - g[0].t_ns) / 1e9 for g in groups]
    return HostSummary(
        n_samples=sum(p.n_samples for p in parts),
        cpu_mean_pct=_weighted([p.cpu_mean_pct for p in parts], weights),
        rss_peak_mib=_largest([p.rss_peak_mib for p in parts]),
        uss_peak_mib=_largest([p.uss_peak_mib for p in parts]),
        system_mem_used_max_pct=_largest([p.system_mem_used_max_pct for p in parts]),
    )
