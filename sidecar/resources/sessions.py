"""Resource figures over several sessions (one training process each: the first, then one
per resume). Each session's samples are summarized on their own, since its first sample
opens a new clock (the time between two processes is nobody's) and an energy counter
read in two processes spans the downtime between them; the summaries are then merged:
counts and energy add up, means are weighted by each session's sampled duration, maxima
and peaks take the largest (each figure by its rule in ``sidecar.resources.fields``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, TypeVar

from sidecar.resources import fields
from sidecar.resources.samplers.folding import (
    Figures,
    GpuSummary,
    HostSummary,
    summarize_gpus,
    summarize_host,
)
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample

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


def _sum(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _merge(
    table: Sequence[fields.ResourceField], parts: Sequence[Figures], weights: Sequence[float]
) -> Figures:
    """The figures of several sessions as one, each by its figure's rule (see
    ``fields.Rule``): means weighted by ``weights`` (the sessions' sampled seconds)."""
    merged: Figures = {}
    for field in table:
        for figure in field.figures:
            values: Any = [part[figure.name] for part in parts]
            if figure.rule == "mean":
                merged[figure.name] = _weighted(values, weights)
            elif figure.rule == "max":
                merged[figure.name] = _largest(values)
            elif figure.rule == "energy":
                merged[figure.name] = _sum(values)
            else:  # "source", "energy method": one word for all, else "mixed"
                merged[figure.name] = _one_or_mixed(values)
    return merged


def _merge_gpu(parts: list[GpuSummary]) -> GpuSummary:
    weights = [p.duration_s for p in parts]
    last = parts[-1]
    return GpuSummary(
        gpu_index=last.gpu_index,
        uuid=last.uuid,
        name=last.name,
        n_samples=sum(p.n_samples for p in parts),
        duration_s=sum(weights),
        figures=_merge(fields.GPU_FIELDS, [p.figures for p in parts], weights),
        whole_gpu_uuid=last.whole_gpu_uuid,
    )


def summarize_gpus_over_sessions(
    samples: Sequence[GpuSample], starts_ns: Sequence[int]
) -> list[GpuSummary]:
    """Per GPU (by UUID, ordered by ``gpu_index``): each session summarized, then merged."""
    per_gpu: dict[str, list[GpuSummary]] = {}
    for group in by_session(samples, starts_ns):
        for summary in summarize_gpus(group):
            per_gpu.setdefault(summary.uuid, []).append(summary)
    return sorted((_merge_gpu(parts) for parts in per_gpu.values()), key=lambda g: g.gpu_index)


def summarize_host_over_sessions(
    samples: Sequence[HostSample], starts_ns: Sequence[int]
) -> HostSummary:
    """The job's processes over every session: each summarized, then merged."""
    groups = by_session(samples, starts_ns)
    parts = [summarize_host(group) for group in groups]
    weights = [(g[-1].t_ns - g[0].t_ns) / 1e9 for g in groups]
    return HostSummary(
        n_samples=sum(p.n_samples for p in parts),
        figures=_merge(fields.HOST_FIELDS, [p.figures for p in parts], weights),
    )
