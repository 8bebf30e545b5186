"""``sidecar compare BASE... [-- NEW...]``: runs (or splits) side by side, and a gate for CI.

Method (docs/views.md): each phase's figure is the median of its measurements (unflagged
rows of every rank's phases.tsv and whole-run sample), with a 95 % two-stage percentile
bootstrap interval over *units* (``pooled``: the runs of a side when it has several,
else blocks of its one run over time, epochs or windows): each of ``BOOTSTRAP_ROUNDS``
resamples draws the units with replacement, then rows within each unit drawn (numpy's
generator seeded with ``SEED``, so the same files always give the same intervals). Rows
of one run vary less than runs do; units carry the variation between runs and over time
that a CI gate must not take for a regression. A difference is NEW against BASE in
percent; its interval comes from the same resamples (NEW's over BASE's, resample by
resample). Throughput is Σ samples / Σ Training loop time over the training steps (a
step's samples: its batch size × its batches). GPU utilization is the mean of the
samples in resources.tsv. Memory peak and goodput parts are one value per run (summed
over the runs of a side): their differences have no interval.

The gate (``--max-regression PCT``) fails when the step time (Training loop) is worse
by more than PCT percent and its interval excludes no change (its low end above 0), or
the throughput is lower by more than PCT percent and its interval excludes no change:
a difference must be both larger than allowed and real.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from markers import wire
from sidecar.report import pooled
from sidecar.report.pooled import UNIT
from sidecar.report.split_rows import SplitRows

BOOTSTRAP_ROUNDS = 2000
SEED = 0
CONFIDENCE = 0.95
STEP = "Training loop"
# Phases that are not a part of a training step (the step itself, spans, validation)
NOT_STEP_PARTS = frozenset(
    p.column
    for p in wire.PHASES
    if p.validation or p.loop or p.phase in (wire.TRAINING, wire.EPOCH)
)
UTILIZATION = "utilization (%)"
MEMORY_USED = "memory used (MB)"
METHOD = (
    f"medians of the measured rows; {CONFIDENCE:.0%} two-stage percentile bootstrap "
    f"intervals: units (runs, else epochs, else windows of a run), then rows within them "
    f"({BOOTSTRAP_ROUNDS} resamples, seed {SEED})"
)


@dataclass(frozen=True)
class ComparedFigure:
    """One figure of both runs and its difference. ``*_ci``: (low, high) or None for a
    figure of one value per run; ``change_pct``: NEW against BASE in percent (points for
    a share), None when BASE's value is 0 or missing."""

    name: str
    unit: str  # "s", "samples/s", "%", "MiB", "share"
    base: float | None
    new: float | None
    base_ci: tuple[float, float] | None = None
    new_ci: tuple[float, float] | None = None
    change_pct: float | None = None
    change_ci: tuple[float, float] | None = None
    rows: tuple[int, int] = (0, 0)  # measurements behind it in BASE and NEW


def _interval(draws: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def _resampled(
    rng: np.random.Generator,
    units: np.ndarray,
    columns: tuple[np.ndarray, ...],
    statistic: Callable[..., Any],
) -> np.ndarray:
    """``statistic`` over ``BOOTSTRAP_ROUNDS`` two-stage resamples of the rows of
    ``columns`` (arrays of one length, resampled together), one value per resample: each
    round draws the units (``units``: each row's) with replacement, then, in place of
    each unit's rows, as many rows drawn with replacement from the unit drawn for it."""
    order = np.argsort(units, kind="stable")
    _, starts, counts = np.unique(units[order], return_index=True, return_counts=True)
    slot = np.repeat(np.arange(len(starts)), counts)  # each sorted row's unit, 0..k-1
    drawn = rng.integers(0, len(starts), (BOOTSTRAP_ROUNDS, len(starts)))[:, slot]
    within = (rng.random(drawn.shape) * counts[drawn]).astype(np.int64)
    index = order[starts[drawn] + within]
    return np.asarray(statistic(*(c[index] for c in columns)), dtype=float)


def _figure(
    rng: np.random.Generator,
    name: str,
    unit: str,
    base: tuple[np.ndarray, ...],
    new: tuple[np.ndarray, ...],
    statistic: Callable[..., Any],
) -> ComparedFigure:
    """A bootstrapped figure: ``statistic(*columns)`` on each run's rows (axis -1);
    ``base`` and ``new``: (each row's unit, *columns)."""
    base_draws = _resampled(rng, base[0], base[1:], statistic)
    new_draws = _resampled(rng, new[0], new[1:], statistic)
    base, new = base[1:], new[1:]
    base_value = float(statistic(*(c[None, :] for c in base))[0])
    new_value = float(statistic(*(c[None, :] for c in new))[0])
    change = change_ci = None
    if base_value > 0 and np.all(base_draws > 0):
        change = (new_value / base_value - 1) * 100
        change_ci = _interval((new_draws / base_draws - 1) * 100)
    return ComparedFigure(
        name,
        unit,
        base_value,
        new_value,
        _interval(base_draws),
        _interval(new_draws),
        change,
        change_ci,
        (len(base[0]), len(new[0])),
    )


def _median(values: np.ndarray) -> np.ndarray:
    return np.median(values, axis=-1)


def _rate(samples: np.ndarray, wall_s: np.ndarray) -> np.ndarray:
    return samples.sum(axis=-1) / wall_s.sum(axis=-1)


def _mean(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=-1)


def measured(rows: SplitRows) -> pd.DataFrame:
    """The measurements: stored rows that are not flagged."""
    return rows.phases[rows.phases["flag"] == ""]


def _steps(rows: SplitRows) -> pd.DataFrame:
    frame = measured(rows)
    return frame[frame["phase"] == STEP]


def _phase_names(frame: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(frame["phase"].tolist()))


def _samples(steps: pd.DataFrame) -> np.ndarray | None:
    """Each step's samples (batch size × batches), None when a step has no batch size."""
    if steps.empty or steps["batch size"].isna().any():
        return None
    return (steps["batch size"] * steps["batches"].clip(lower=1)).to_numpy(float)


def _utilization(rows: SplitRows) -> tuple[np.ndarray, np.ndarray]:
    """(each GPU sample's unit, its utilization %)."""
    tables = [t.dropna(subset=[UTILIZATION]) for t, _, _ in rows.resources if UTILIZATION in t]
    if not tables:
        return np.array([], dtype=np.int64), np.array([])
    known = pd.concat(tables)
    return known[UNIT].to_numpy(np.int64), known[UTILIZATION].to_numpy(float)


def _memory_peak(rows: SplitRows) -> float | None:
    peaks = [t[MEMORY_USED].max() for t, _, _ in rows.resources if MEMORY_USED in t]
    peaks = [p for p in peaks if not math.isnan(p)]
    return max(peaks) if peaks else None


def _plain(name: str, unit: str, base: float | None, new: float | None) -> ComparedFigure:
    """A figure of one value per run: its change in percent (points for a share)."""
    change = None
    if base is not None and new is not None:
        if unit == "share":
            change = (new - base) * 100
        elif base > 0:
            change = (new / base - 1) * 100
    return ComparedFigure(name, unit, base, new, change_pct=change)


def _goodput(rows: SplitRows) -> dict[str, float]:
    """The split's goodput parts as shares of its wall time (run.json's mean over ranks)."""
    account = (rows.entry.get("goodput") or {}).get("mean") or {}
    wall_s = account.get("wall_s") or 0.0
    if wall_s <= 0:
        return {}
    parts = {"productive": account.get("productive_s") or 0.0}
    parts.update(account.get("badput_s") or {})
    return {part: float(value) / wall_s for part, value in parts.items()}


def _modal(series: pd.Series) -> Any:
    values = series.dropna()
    if values.empty:
        return None
    value = values.mode().iloc[0]
    return int(value) if float(value).is_integer() else value


def _gpu_names(rows: SplitRows) -> list[str]:
    return sorted(str(g.get("name", "")) for g in rows.entry.get("gpus") or [])


def unlike(base: SplitRows, new: SplitRows) -> list[str]:
    """How the two runs differ in ways that make figures not like for like, one sentence
    each (empty when alike)."""
    said = []
    base_phases, new_phases = set(_phase_names(measured(base))), set(_phase_names(measured(new)))
    if base_phases != new_phases:
        only = [
            f"only in {which}: {', '.join(sorted(names))}"
            for which, names in (
                ("BASE", base_phases - new_phases),
                ("NEW", new_phases - base_phases),
            )
            if names
        ]
        said.append(f"phases differ ({'; '.join(only)}): those are shown, not compared")
    sizes = [_modal(_steps(r)["batch size"]) for r in (base, new)]
    if sizes[0] != sizes[1]:
        said.append(
            f"batch size differs ({sizes[0]} vs {sizes[1]}): phase and step times are per "
            "step of another size; throughput (samples/s) is like for like"
        )
    batches = [_modal(_steps(r)["batches"]) for r in (base, new)]
    if batches[0] != batches[1]:
        said.append(f"batches per step differ ({batches[0]} vs {batches[1]}): accumulation")
    gpus = [_gpu_names(r) for r in (base, new)]
    if gpus[0] != gpus[1]:
        said.append(
            f"GPUs differ ({', '.join(gpus[0]) or 'none'} vs {', '.join(gpus[1]) or 'none'})"
        )
    ranks = [len(r.entry.get("ranks") or r.rank_start_unix) for r in (base, new)]
    if ranks[0] != ranks[1]:
        said.append(f"ranks differ ({ranks[0]} vs {ranks[1]}): medians pool every rank's rows")
    return said


def compare(base_runs: list[SplitRows], new_runs: list[SplitRows]) -> dict[str, Any]:
    """Every figure of BASE and NEW (one or more runs each), with their differences and
    how the runs differ; the intervals resample each side's units (``pooled``)."""
    rng = np.random.default_rng(SEED)
    (base_unit, base), (new_unit, new) = pooled.pool(base_runs), pooled.pool(new_runs)
    base_rows, new_rows = measured(base), measured(new)
    shared = [p for p in _phase_names(base_rows) if p in set(_phase_names(new_rows))]

    def wall(frame: pd.DataFrame, phase: str) -> tuple[np.ndarray, np.ndarray]:
        rows = frame[frame["phase"] == phase]
        return rows[UNIT].to_numpy(np.int64), rows["wall (s)"].to_numpy(float)

    phases = [
        _figure(rng, phase, "s", wall(base_rows, phase), wall(new_rows, phase), _median)
        for phase in shared
    ]
    others: list[ComparedFigure] = []
    steps = [_steps(r) for r in (base, new)]
    counts = [_samples(s) for s in steps]
    if counts[0] is not None and counts[1] is not None:
        base_steps, new_steps = (
            (s[UNIT].to_numpy(np.int64), n, s["wall (s)"].to_numpy(float))
            for s, n in ((steps[0], counts[0]), (steps[1], counts[1]))
        )
        others.append(_figure(rng, "throughput", "samples/s", base_steps, new_steps, _rate))
    busy = [_utilization(r) for r in (base, new)]
    if len(busy[0][1]) and len(busy[1][1]):
        others.append(_figure(rng, "GPU utilization", "%", busy[0], busy[1], _mean))
    peaks = [_memory_peak(r) for r in (base, new)]
    if peaks[0] is not None or peaks[1] is not None:
        others.append(_plain("GPU memory peak", "MiB", *peaks))
    goodput = [_goodput(r) for r in (base, new)]
    for part in dict.fromkeys([*goodput[0], *goodput[1]]):
        others.append(
            _plain(f"goodput {part}", "share", goodput[0].get(part), goodput[1].get(part))
        )

    return {
        "base": _side(base_runs, base_unit, base),
        "new": _side(new_runs, new_unit, new),
        "method": METHOD,
        "phases": phases,
        "figures": others,
        "unlike": unlike(base, new),
    }


def _side(runs: list[SplitRows], unit: str, pooled_rows: SplitRows) -> dict[str, Any]:
    """What one side of the comparison is: its folders, split, runs and units."""
    return {
        "folder": ", ".join(str(r.folder) for r in runs),
        "split": runs[0].split,
        "runs": len(runs),
        "unit": unit,
        "units": int(measured(pooled_rows)[UNIT].nunique()),
    }


def gate(result: dict[str, Any], max_regression_pct: float) -> tuple[bool, str]:
    """(passed, the line that decided). Step time is gated unless the batch sizes differ;
    throughput always. A change fails when it is beyond ``max_regression_pct`` (percent)
    and its interval excludes no change; a failing step time names the phase whose
    median grew most."""
    step = next((f for f in result["phases"] if f.name == STEP), None)
    rate = next((f for f in result["figures"] if f.name == "throughput"), None)
    sized_alike = not any(s.startswith("batch size") for s in result["unlike"])
    if (
        step is not None
        and sized_alike
        and step.change_pct is not None
        and step.change_ci is not None
        and step.change_pct > max_regression_pct
        and step.change_ci[0] > 0
    ):
        grown = max(
            (f for f in result["phases"] if f.name not in NOT_STEP_PARTS and f.base and f.new),
            key=lambda f: f.new - f.base,
            default=None,
        )
        cause = f"; most of it {_change_text(grown)}" if grown is not None else ""
        return False, (
            f"FAIL: step time {_change_text(step)} is worse than the {max_regression_pct:g} %"
            f" allowed, its interval above 0{cause}"
        )
    if (
        rate is not None
        and rate.change_pct is not None
        and rate.change_ci is not None
        and rate.change_pct < -max_regression_pct
        and rate.change_ci[1] < 0
    ):
        return False, (
            f"FAIL: throughput {_change_text(rate)} is lower than the {max_regression_pct:g} %"
            " allowed, its interval below 0"
        )
    gated = (("step time", step if sized_alike else None), ("throughput", rate))
    checked = [f"{name} {_change_text(f)}" for name, f in gated if f is not None]
    if not checked:
        return True, "PASS: neither step time nor throughput could be compared"
    return True, (
        f"PASS: {' and '.join(checked)}: not beyond {max_regression_pct:g} % "
        "with its interval excluding no change"
    )


def _change_text(figure: ComparedFigure) -> str:
    if figure.change_pct is None:
        return f"{figure.name}: no change computable"
    unit = " points" if figure.unit == "share" else " %"
    text = f"{figure.change_pct:+.1f}{unit}"
    if figure.change_ci is not None:
        text += f" [{figure.change_ci[0]:+.1f}, {figure.change_ci[1]:+.1f}]"
    return text if figure.name in (STEP, "throughput") else f"{figure.name} {text}"


WIDTH = 80  # columns of every line of the text form
NAME_COLUMNS = 22
CELL_COLUMNS = 18
SECONDS = ((1.0, "s"), (1e3, "ms"), (1e6, "µs"))


def _seconds_scale(values: list[float]) -> tuple[float, str]:
    """(factor, unit) for a table of seconds: the largest unit in which the median of
    ``values`` is at least 1 (µs when smaller), so most cells fit their column."""
    middle = float(np.median(values)) if values else 0.0
    return next(((f, u) for f, u in SECONDS if middle * f >= 1), SECONDS[-1])


def _short(value: float) -> str:
    """``value`` in at most 6 characters, 3 significant digits where they fit."""
    size = abs(value)
    if size >= 1e6:
        return f"{value:.0e}"
    if size >= 1000:
        return f"{value:.0f}"
    # "#" keeps trailing zeros (10.0, not 10): three significant digits shown are three
    text = f"{value:#.3g}" if size >= 0.01 or size == 0 else f"{value:#.2g}"
    text = text.rstrip(".")
    return text if len(text) <= 6 else f"{value:.0e}"


def _cell(value: float | None, ci: tuple[float, float] | None, rows: int, factor: float) -> str:
    """``value [low, high]`` times ``factor``; ``value (1 row)`` where one row is behind
    it (its interval would have no width), the value alone for a figure of one value."""
    if value is None:
        return "-"
    text = _short(value * factor)
    if ci is None:
        return text
    if rows == 1:
        return f"{text} (1 row)"
    return f"{text} [{_short(ci[0] * factor)}, {_short(ci[1] * factor)}]"


def _change_cell(figure: ComparedFigure) -> str:
    if figure.change_pct is None:
        return "-"
    text = f"{figure.change_pct:+.1f}"
    if figure.change_ci is not None:
        text += f" [{figure.change_ci[0]:+.1f}, {figure.change_ci[1]:+.1f}]"
    return text


def _row(name: str, cells: tuple[str, str, str]) -> list[str]:
    """One figure as a line of columns, or where it would pass ``WIDTH`` its name on a
    line of its own and the cells, closer together, on the next."""
    line = f"{name:<{NAME_COLUMNS}}{cells[0]:<{CELL_COLUMNS}} {cells[1]:<{CELL_COLUMNS}} {cells[2]}"
    fits = len(name) < NAME_COLUMNS and all(len(c) <= CELL_COLUMNS for c in cells[:2])
    if fits and len(line) <= WIDTH:
        return [line.rstrip()]
    return [name[:WIDTH], "  " + "  ".join(cells)]


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _side_text(which: str, side: dict[str, Any]) -> str:
    runs = f"{side['runs']} run{'s' if side['runs'] != 1 else ''}"
    units = "" if side["unit"] == "runs" else f", {side['units']} {side['unit']} as units"
    return f"{which} {side['folder']} split {side['split']} ({runs}{units})"


def render(result: dict[str, Any]) -> list[str]:
    """The comparison as text lines of at most ``WIDTH`` columns: each table's unit in
    its header, one row per figure, then how the runs differ."""
    lines = [
        *_wrapped(_side_text("BASE", result["base"])),
        *_wrapped(_side_text("NEW", result["new"])),
        *_wrapped(f"Method: {result['method']}; difference: NEW against BASE"),
        "",
        f"{'':<{NAME_COLUMNS}}{'BASE [95 %]':<{CELL_COLUMNS}} {'NEW [95 %]':<{CELL_COLUMNS}} "
        "NEW vs BASE (%)",
    ]
    phases = result["phases"]
    factor, unit = _seconds_scale([f.base or 0.0 for f in phases] + [f.new or 0.0 for f in phases])
    if phases:
        lines.append(f"phase median ({unit})")
    for figure in phases:
        lines += _row(figure.name, _cells(figure, factor))
    figures = result["figures"]
    for figure in [f for f in figures if f.unit != "share"]:
        lines += _row(f"{figure.name} ({figure.unit})", _cells(figure, 1.0))
    shares = [f for f in figures if f.unit == "share"]
    if shares:
        lines.append("goodput (% of the run, difference in points)")
    for figure in shares:
        base, new, change = _cells(figure, 100.0)
        lines += _row(figure.name.removeprefix("goodput "), (base, new, change))
    for sentence in result["unlike"]:
        lines += _wrapped(f"Unlike runs: {sentence}")
    return lines


def _cells(figure: ComparedFigure, factor: float) -> tuple[str, str, str]:
    return (
        _cell(figure.base, figure.base_ci, figure.rows[0], factor),
        _cell(figure.new, figure.new_ci, figure.rows[1], factor),
        _change_cell(figure),
    )


def gate_lines(line: str) -> list[str]:
    """The gate's line wrapped to ``WIDTH`` columns."""
    return _wrapped(line)


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """The comparison as JSON-compatible data."""
    return {
        **result,
        "phases": [asdict(f) for f in result["phases"]],
        "figures": [asdict(f) for f in result["figures"]],
    }
