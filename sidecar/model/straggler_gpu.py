"""What a rank's GPU showed during its iterations, for the straggler view
(``sidecar.model.stragglers``, docs/multi-node.md).

Each sidecar keeps, per rank it serves that reported a GPU, the resource samples of that
GPU whose time falls inside one of the rank's stored training iterations (the Training
loop row: its start and its wall time): ``in_iterations`` gives them as rows of
``(epoch, iteration, SM clock MHz, power W, temperature °C, throttle reasons bitmask)``.
The sidecar serving rank 0 gets them through the node files and folds them over a set of
aligned iterations (``over``): the median and the minimum SM clock, the mean power, the
largest temperature, and the share of the samples in which NVML named each throttle
reason. A sample counts for the iteration its time falls in; an iteration shorter than
the sampling interval often holds none, so the figures are a sample of those iterations,
and their count is said with them. A rank without a GPU has no readings at all (None),
never zeros.

Units: MHz, W, °C; NaN (None in JSON) where the GPU did not give the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# NVML's clocks event (throttle) reasons, bit → name (nvmlClocksEventReason*, and the two
# only the older nvmlClocksThrottleReason* names: board limit, reliability).
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
READING_COLUMNS = ("sm_clock_mhz", "power_w", "temperature_c", "throttle_reasons")
_KNOWN_BITS = sum(bit for bit, _ in THROTTLE_REASONS)


def reason_names(mask: int) -> list[str]:
    """The names of the reasons set in NVML's bitmask ``mask``; bits NVML added after
    this table are named by their hex value."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    unknown = mask & ~_KNOWN_BITS
    return names + ([f"0x{unknown:x}"] if unknown else [])


@dataclass(frozen=True)
class GpuReadings:
    """A rank's GPU samples inside its stored training iterations: ``keys`` (m, 2) int
    (epoch, iteration), ``values`` (m, 4) float in READING_COLUMNS' order, NaN unknown."""

    keys: np.ndarray
    values: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float | None]]) -> GpuReadings:
        """From ``in_iterations``' rows (None: unknown)."""
        table = np.array(
            [[np.nan if v is None else float(v) for v in row] for row in rows], dtype=float
        ).reshape(-1, 2 + len(READING_COLUMNS))
        return cls(table[:, :2].astype(np.int64), table[:, 2:])


@dataclass(frozen=True)
class GpuFigures:
    """A GPU (or several pooled) over some iterations: ``samples`` that fell inside them,
    SM clock median and minimum (MHz), mean power (W), largest temperature (°C), each
    None when no sample gave it; ``throttle``: per reason seen, the share (0-1) of the
    ``throttle_samples`` (those with a known bitmask) in which NVML named it."""

    samples: int
    sm_clock_median_mhz: float | None
    sm_clock_min_mhz: float | None
    power_mean_w: float | None
    temperature_max_c: float | None
    throttle: dict[str, float]
    throttle_samples: int


def in_iterations(
    t_s: np.ndarray,
    values: np.ndarray,
    keys: np.ndarray,
    starts_s: np.ndarray,
    walls_s: np.ndarray,
) -> list[list[float | None]]:
    """The samples taken at ``t_s`` (s, on the iterations' clock) with ``values`` (m, 4,
    READING_COLUMNS, NaN unknown) that fall inside an iteration: ``keys`` (n, 2), its
    start ``starts_s`` and wall time ``walls_s``; as rows (epoch, iteration, *values),
    None unknown. Iterations do not overlap; a sample on a boundary goes to the later."""
    if not len(t_s) or not len(keys):
        return []
    order = np.argsort(starts_s, kind="stable")
    starts, ends = starts_s[order], starts_s[order] + walls_s[order]
    which = np.searchsorted(starts, t_s, side="right") - 1
    inside = (which >= 0) & (t_s <= ends[which.clip(min=0)])
    rows: list[list[float | None]] = []
    for sample in np.flatnonzero(inside):
        epoch, iteration = keys[order[which[sample]]]
        rows.append(
            [int(epoch), int(iteration)]
            + [None if np.isnan(v) else float(v) for v in values[sample]]
        )
    return rows


def _or_none(values: np.ndarray, reduce: str) -> float | None:
    known = values[~np.isnan(values)]
    return float(getattr(np, reduce)(known)) if known.size else None


def over(readings: Sequence[GpuReadings], keys: np.ndarray, chosen: np.ndarray) -> GpuFigures:
    """The figures of ``readings`` (one rank's, or several pooled) in the iterations of
    ``keys`` (n, 2) where ``chosen`` (n,) bool is set."""
    wanted = {(int(e), int(i)) for (e, i), yes in zip(keys, chosen, strict=True) if yes}
    picked = [
        r.values[[(int(e), int(i)) in wanted for e, i in r.keys]] for r in readings if len(r.keys)
    ]
    table = np.concatenate(picked) if picked else np.zeros((0, len(READING_COLUMNS)))
    masks = table[:, 3][~np.isnan(table[:, 3])].astype(np.int64)
    counts: dict[str, int] = {}
    for mask in masks.tolist():
        for name in reason_names(mask):
            counts[name] = counts.get(name, 0) + 1
    return GpuFigures(
        len(table),
        _or_none(table[:, 0], "median"),
        _or_none(table[:, 0], "min"),
        _or_none(table[:, 1], "mean"),
        _or_none(table[:, 2], "max"),
        {name: count / len(masks) for name, count in sorted(counts.items())},
        len(masks),
    )
