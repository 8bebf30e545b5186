"""Time-weighted summaries of the samples and the per-phase attribution: the figures that
``sidecar.sinks.resources_text`` lays out in summary.log and resources.tsv.

Weighting. A sample stamped t stands for the window (t_prev, t] since the sample before
it: NVML utilization, averaged power and psutil's ``cpu_percent`` are all averages over
the time just before the reading. A mean weighs each sample by the length of its
window; the first sample of a sequence opens the clock and weighs nothing (its values
describe time before sampling began), except when it is the only one, which then is the
plain value. Maxima and peaks use every sample.

Energy of a GPU is ``last − first`` of NVML's energy counter where the GPU has one
(``energy_method == "counter"``), else the integral of power over the sample windows
(``"integrated power"``).

Phase attribution (``attribute_phases``). Phases are intervals (phase, start_ns,
end_ns) on the same monotonic clock as the samples. The windows between consecutive
sampling rounds are intersected with the intervals; a phase's mean GPU utilization and
mean power are the means of the samples weighted by those overlaps, over all the job's
GPUs (so power is per GPU, utilization is the mean GPU). Per phase it reports the
phase seconds that fell inside some window (summed over intervals, hence over ranks
too) and the number of rounds whose window overlapped.

Utilization comes from the driver's own samples where the GPU gives them
(``GpuSample.util_windows``, from ``nvmlDeviceGetSamples``): each is the share of its own
sample period (1/6 s to 1 s by product) during which any kernel ran, and is weighted by
its overlap with the phase, so no time is attributed that no sample observed and a loop
whose period beats with the rounds does not alias. Without them (the call unsupported,
or samples restored from resources.tsv) the round's reading stands for the whole round,
though the driver measured only its last period of it.

Limits: a phase much shorter than the driver's sample period (or, without driver
samples, the sampling interval) gets the value of whatever else ran in that window. The attribution
is meaningful for phases that take a sizeable share of the time (it says where the busy
and the idle time went), not for one short phase. Phase time before the first round or
after the last one is not covered.

Memory is in MB meaning MiB (bytes / 1024²), as in the rest of the product's files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.resources import fields
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample

Figures = dict[str, float | str | None]


@dataclass(frozen=True)
class GpuSummary:
    """One GPU over the run: ``figures`` holds one value per ``FieldFigure`` of the GPU fields
    (``sidecar.resources.fields``), None where no sample had the field."""

    gpu_index: int
    uuid: str
    name: str
    n_samples: int
    duration_s: float
    figures: Figures
    whole_gpu_uuid: str | None = None  # a MIG instance: power, energy, temperature shared


@dataclass(frozen=True)
class HostSummary:
    """The job's process tree and the host over the run: one value per ``FieldFigure`` of the
    host fields."""

    n_samples: int
    figures: Figures


@dataclass(frozen=True)
class PhaseAttribution:
    """GPU figures during one phase (see the module docstring for the method)."""

    covered_s: float
    n_samples: int
    util_mean_pct: float | None
    power_mean_w: float | None


def _weighted_mean(ts: Sequence[int], values: Sequence[float | None]) -> float | None:
    """Mean of ``values`` (None skipped), each weighing t[i] − t[i−1]; see module doc."""
    num = den = 0.0
    present = []
    for i, value in enumerate(values):
        if value is None:
            continue
        present.append(value)
        if i:
            weight = ts[i] - ts[i - 1]
            num += weight * value
            den += weight
    if den > 0:
        return num / den
    return sum(present) / len(present) if present else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _energy(ts: Sequence[int], samples: Sequence[Any]) -> tuple[float | None, str | None]:
    counter = [s.energy_j for s in samples if s.energy_j is not None]
    if len(counter) >= 2 and counter[-1] >= counter[0]:  # a reset (driver reload) falls back
        return counter[-1] - counter[0], "counter"
    joules = 0.0
    seconds = 0
    for i in range(1, len(samples)):
        if samples[i].power_w is not None:
            joules += samples[i].power_w * (ts[i] - ts[i - 1]) / 1e9
            seconds += ts[i] - ts[i - 1]
    return (joules, "integrated power") if seconds else (None, None)


def _source(values: Sequence[str | None]) -> str | None:
    """The one value the weighed samples share (the first only opens the clock), else
    "mixed"; None when none has one."""
    present = {v for v in (values[1:] or values) if v is not None}
    return (present.pop() if len(present) == 1 else "mixed") if present else None


def _fold(
    rule: fields.Rule, ts: Sequence[int], seq: Sequence[Any], attribute: str
) -> float | str | None:
    """One figure of ``seq`` (samples in time order) by ``rule`` (see ``fields.Rule``)."""
    values = [getattr(s, attribute) for s in seq]
    if rule == "mean":
        return _weighted_mean(ts, values)
    if rule == "max":
        return _max(values)
    if rule == "source":
        return _source(values)
    energy, method = _energy(ts, seq)
    return energy if rule == "energy" else method


def _figures(table: Sequence[fields.ResourceField], seq: Sequence[Any]) -> Figures:
    ts = [s.t_ns for s in seq]
    return {
        figure.name: _fold(figure.rule, ts, seq, field.attribute)
        for field in table
        for figure in field.figures
    }


def summarize_gpus(samples: Sequence[GpuSample]) -> list[GpuSummary]:
    """Per GPU (by UUID, ordered by ``gpu_index``): the figures of the GPU fields
    (time-weighted means, maxima, peaks, energy). Units as in GpuSample (%, MiB, W, J, °C)."""
    by_gpu: dict[str, list[GpuSample]] = {}
    for sample in samples:
        by_gpu.setdefault(sample.uuid, []).append(sample)
    summaries = []
    for seq in by_gpu.values():
        seq.sort(key=lambda s: s.t_ns)
        summaries.append(
            GpuSummary(
                gpu_index=seq[-1].gpu_index,
                uuid=seq[-1].uuid,
                name=seq[-1].name,
                n_samples=len(seq),
                duration_s=(seq[-1].t_ns - seq[0].t_ns) / 1e9,
                figures=_figures(fields.GPU_FIELDS, seq),
                whole_gpu_uuid=seq[-1].whole_gpu_uuid,
            )
        )
    summaries.sort(key=lambda g: g.gpu_index)
    return summaries


def summarize_host(samples: Sequence[HostSample]) -> HostSummary:
    """The figures of the host fields: time-weighted mean CPU % of the job (100 = one
    core), peak RSS and USS of the job in MiB, the maximum of the host's used-memory %."""
    seq = sorted(samples, key=lambda s: s.t_ns)
    return HostSummary(n_samples=len(seq), figures=_figures(fields.HOST_FIELDS, seq))


def attribute_phases(
    gpu_samples: Sequence[GpuSample], phases: np.ndarray, starts_ns: np.ndarray, ends_ns: np.ndarray
) -> dict[int, PhaseAttribution]:
    """Mean GPU utilization (%) and mean power per GPU (W) during each phase.

    The intervals are parallel arrays: ``phases`` (any integer key of a phase),
    ``starts_ns`` and ``ends_ns`` on the samples' clock. Every phase seen gets an entry
    (in the order of its first interval), with ``covered_s`` 0 and None means when no
    sample window overlaps it. Utilization comes from the driver's own samples, each over
    its own period (``GpuSample.util_windows``), where a GPU has them, else from the
    rounds. On arrays: cost O(intervals × log windows + overlaps), with no Python work
    per interval. See the module docstring for the method.
    """
    keys, first_at, which = np.unique(phases, return_index=True, return_inverse=True)
    rounds, of_sample = np.unique(
        np.array([s.t_ns for s in gpu_samples], dtype=np.int64), return_inverse=True
    )
    by_rounds = [s.util_pct if s.util_windows is None else None for s in gpu_samples]
    util_sum, util_n = _per_round(by_rounds, of_sample, len(rounds))
    power_sum, power_n = _per_round([s.power_w for s in gpu_samples], of_sample, len(rounds))
    # The windows (rounds[i], rounds[i + 1]] each interval meets.
    interval, window, overlap = _overlaps(starts_ns, ends_ns, rounds[:-1], rounds[1:])
    phase, window = which[interval], window + 1  # a window's figures are its closing round's
    n = len(keys)
    covered_ns = np.bincount(phase, overlap, minlength=n)
    windows = np.bincount(
        np.unique(phase * len(rounds) + window) // max(len(rounds), 1), minlength=n
    )
    # float sums from the start: with no window met, bincount of empty integer weights is
    # integer, and the driver samples' float sums below could not be added into it
    util = [
        np.bincount(phase, overlap * util_sum[window], minlength=n).astype(np.float64),
        np.bincount(phase, overlap * util_n[window], minlength=n).astype(np.float64),
    ]
    power = (
        np.bincount(phase, overlap * power_sum[window], minlength=n),
        np.bincount(phase, overlap * power_n[window], minlength=n),
    )
    for lo, hi, value in _driver_windows(gpu_samples):
        interval, window, overlap = _overlaps(starts_ns, ends_ns, lo, hi)
        util[0] += np.bincount(which[interval], overlap * value[window], minlength=n)
        util[1] += np.bincount(which[interval], overlap.astype(np.float64), minlength=n)
    result = {}
    for i in np.argsort(first_at).tolist():
        result[int(keys[i])] = PhaseAttribution(
            covered_s=int(covered_ns[i]) / 1e9,
            n_samples=int(windows[i]),
            util_mean_pct=float(util[0][i] / util[1][i]) if util[1][i] else None,
            power_mean_w=float(power[0][i] / power[1][i]) if power[1][i] else None,
        )
    return result


def _overlaps(
    starts_ns: np.ndarray, ends_ns: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (interval, window, overlap ns > 0) of intervals [start, end) and windows
    (lo, hi], the windows sorted and not overlapping one another."""
    low = np.searchsorted(hi, starts_ns, side="right")  # the first window ending after
    high = np.searchsorted(lo, ends_ns, side="left") - 1  # the last one starting before
    counts = np.maximum(high - low + 1, 0)
    interval = np.repeat(np.arange(len(starts_ns)), counts)
    window = (
        low[interval] + np.arange(len(interval)) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    overlap = np.minimum(ends_ns[interval], hi[window]) - np.maximum(
        starts_ns[interval], lo[window]
    )
    met = overlap > 0
    return interval[met], window[met], overlap[met]


def _driver_windows(
    gpu_samples: Sequence[GpuSample],
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per GPU: the (start, end, %) arrays of its driver utilization samples, sorted."""
    by_gpu: dict[str, list[tuple[int, int, float]]] = {}
    for sample in gpu_samples:
        if sample.util_windows:
            by_gpu.setdefault(sample.uuid, []).extend(sample.util_windows)
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for windows in by_gpu.values():
        table = np.array(sorted(set(windows)), dtype=np.float64).reshape(-1, 3)
        out.append((table[:, 0].astype(np.int64), table[:, 1].astype(np.int64), table[:, 2]))
    return out


def _per_round(
    values: list[float | None], of_sample: np.ndarray, rounds: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per round: the sum of the values that were read, and how many were."""
    read = np.array([v is not None for v in values], dtype=bool)
    numbers = np.array([v if v is not None else 0.0 for v in values], dtype=np.float64)
    return (
        np.bincount(of_sample, numbers * read, minlength=rounds),
        np.bincount(of_sample, read.astype(np.float64), minlength=rounds),
    )
