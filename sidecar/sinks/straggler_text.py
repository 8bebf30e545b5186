"""The straggler in words, as summary.log shows it under the ranks table: the
``Straggler:`` line (the verdict of ``sidecar.model.stragglers``) and what the
straggler's GPU showed beside the other ranks' GPUs (``sidecar.model.straggler_gpu``)."""

from __future__ import annotations

from sidecar.model.straggler_gpu import GpuFigures
from sidecar.model.stragglers import Stragglers


def describe(figures: GpuFigures) -> str:
    """``figures`` in words: ``SM clock median 990 MHz (min 900), power mean 120.0 W,
    temperature max 88 °C, throttle reasons hw_slowdown (100 %)``; unknown figures are
    left out (the reasons too when NVML gave none)."""
    parts = []
    if figures.sm_clock_median_mhz is not None:
        parts.append(
            f"SM clock median {figures.sm_clock_median_mhz:.0f} MHz "
            f"(min {figures.sm_clock_min_mhz:.0f})"
        )
    if figures.power_mean_w is not None:
        parts.append(f"power mean {figures.power_mean_w:.1f} W")
    if figures.temperature_max_c is not None:
        parts.append(f"temperature max {figures.temperature_max_c:.0f} °C")
    if figures.throttle_samples:
        reasons = ", ".join(f"{n} ({s * 100:.0f} %)" for n, s in figures.throttle.items())
        parts.append(f"throttle reasons {reasons or 'none'}")
    return ", ".join(parts) or "no figure known"


def straggler_line(view: Stragglers) -> str:
    """The summary's one line: ``Straggler: none`` or the rank, host, phase and margin."""
    verdict = view.verdict
    by_window = "by window: " + ", ".join(
        "none" if window.rank is None else f"rank {window.rank}" for window in view.windows
    )
    if verdict.rank is None:
        reason = (
            "fewer than two ranks"
            if len(view.standings) < 2
            else f"no rank slowest in most of {view.aligned} aligned iterations"
        )
        named = any(window.rank is not None for window in view.windows)
        return f"Straggler: none ({reason}{'; ' + by_window if named else ''})"
    share_of_loop = verdict.over_median_s / view.median_loop_s * 100 if view.median_loop_s else 0.0
    steady = "the same rank in every window" if view.steady else f"changing, {by_window}"
    return (
        f"Straggler: rank {verdict.rank} on {verdict.host}, {verdict.phase}, "
        f"+{verdict.over_median_s:.3e} s over the median before the sync "
        f"({share_of_loop:.0f} % of an iteration) in {verdict.share * 100:.0f} % of "
        f"{view.aligned} aligned iterations; {steady}"
    )


def straggler_gpu_line(view: Stragglers) -> str | None:
    """The line under ``Straggler:`` naming a straggler: what its GPU showed in the
    iterations it was the slowest, beside the other ranks' GPUs then; None without a
    straggler."""
    rank = view.verdict.rank
    standing = next((s for s in view.standings if s.rank == rank), None)
    if standing is None:
        return None
    if standing.gpu is None:
        return f"Straggler GPU: none (rank {rank} reported no GPU: its figures are CPU only)"
    where = f"in its {standing.slowest} slowest iterations"
    if not standing.gpu.samples:
        return (
            f"Straggler GPU: rank {rank}, no resource sample fell {where} "
            "(iterations shorter than the sampling interval, or GPU sampling off on its node)"
        )
    others = view.others_gpu
    then = (
        "the other ranks reported no GPU"
        if others is None
        else f"the other ranks' GPUs then ({others.samples} samples): {describe(others)}"
    )
    return (
        f"Straggler GPU: rank {rank} {where} ({standing.gpu.samples} samples): "
        f"{describe(standing.gpu)}; {then}"
    )
