"""The runs of one side of ``sidecar compare`` as one ``SplitRows``, each measurement
tagged with the unit the gate resamples (docs/views.md, "The gate").

Between-run variation is what a gate must not mistake for a regression, and rows of one
run do not show it. So the bootstrap draws units first, then rows within them:

* several runs on a side: the unit is the run;
* one run: blocks of it over time, its epochs when its training steps span at least
  ``MIN_UNITS`` epochs, else ``WINDOWS`` windows of its training steps in time order,
  each holding as many steps (a row belongs to the window its start falls in, so every
  phase of a step is in its step's window).

Resource samples get the same units: the run, else ``WINDOWS`` windows in time order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from sidecar.report.split_rows import SplitRows

UNIT = "unit"  # the column of the resampled unit
MIN_UNITS = 4  # fewer epochs than this: windows instead
WINDOWS = 8  # windows of one run's training steps (or resource samples)
STEP = "Training loop"


def _windows(starts_s: np.ndarray, steps_s: np.ndarray) -> np.ndarray:
    """The window (0 to ``WINDOWS - 1``) of each start in ``starts_s`` (seconds): windows
    begin at the steps ``steps_s`` (starts, seconds) that split them into equal groups."""
    steps_s = np.sort(steps_s[~np.isnan(steps_s)])
    if not len(steps_s):
        return np.zeros(len(starts_s), dtype=np.int64)
    bounds = steps_s[(np.arange(1, WINDOWS) * len(steps_s)) // WINDOWS]
    return np.searchsorted(bounds, np.nan_to_num(starts_s, nan=-np.inf), side="right")


def blocks_of(rows: SplitRows) -> tuple[str, pd.DataFrame]:
    """(``"epochs"`` or ``"windows"``, the rows of ``rows.phases`` with their unit)."""
    phases = rows.phases.copy()
    steps = phases[(phases["phase"] == STEP) & (phases["flag"] == "")]
    if steps["epoch"].nunique() >= MIN_UNITS:
        phases[UNIT] = phases["epoch"].fillna(-1).astype(np.int64)
        return "epochs", phases
    phases[UNIT] = _windows(phases["start (s)"].to_numpy(float), steps["start (s)"].to_numpy(float))
    return "windows", phases


def _resources(runs: list[SplitRows]) -> list[tuple[pd.DataFrame, float, str]]:
    tables = []
    for number, run in enumerate(runs):
        for table, origin_unix, node in run.resources:
            table = table.copy()
            if len(runs) > 1:
                table[UNIT] = number
            elif "time (s)" in table and len(table):
                times_s = table["time (s)"].to_numpy(float)
                table[UNIT] = _windows(times_s, times_s)
            else:
                table[UNIT] = 0
            tables.append((table, origin_unix, node))
    return tables


def _goodput(runs: list[SplitRows]) -> dict[str, Any]:
    """The runs' goodput accounts (run.json's mean over ranks) added up, so each part's
    share is of the runs' wall time together."""
    total: dict[str, Any] = {"wall_s": 0.0, "productive_s": 0.0, "badput_s": {}}
    for run in runs:
        account = (run.entry.get("goodput") or {}).get("mean") or {}
        total["wall_s"] += account.get("wall_s") or 0.0
        total["productive_s"] += account.get("productive_s") or 0.0
        for part, value_s in (account.get("badput_s") or {}).items():
            total["badput_s"][part] = total["badput_s"].get(part, 0.0) + (value_s or 0.0)
    return {"mean": total}


def pool(runs: list[SplitRows]) -> tuple[str, SplitRows]:
    """(the unit's name: ``"runs"``, ``"epochs"`` or ``"windows"``, the runs as one
    ``SplitRows`` whose phases and resource tables hold a ``unit`` column). The first
    run gives the folder, split, hosts and run.json entry (its goodput: every run's
    added up). ``runs`` must not be empty."""
    first = runs[0]
    if len(runs) == 1:
        kind, phases = blocks_of(first)
    else:
        kind = "runs"
        phases = pd.concat(
            [run.phases.assign(**{UNIT: number}) for number, run in enumerate(runs)],
            ignore_index=True,
        )
    entry = {**first.entry, "goodput": _goodput(runs)}
    return kind, replace(first, entry=entry, phases=phases, resources=_resources(runs))
