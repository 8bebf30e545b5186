"""``report.html``: one self-contained page (docs/report.md, "The page"). uPlot (vendored,
MIT, ~51 KB: the smallest of the plotting libraries that draw from data in the page) and
our script are inlined; the tables and the plots' data are embedded as JSON and drawn in
the browser. Nothing is fetched from the network.

The page reads the same from 1 to 10 000 jobs: bar charts are horizontal, one row per
category with its label beside it (cut short with the full name on hover), so labels
never meet whatever their number or length; a chart or plot with nothing to show says so
("no GPU data"); the jobs table puts the most wasteful jobs first and status, wall time
and flags beside the job's name, with long text folded. To keep the page light, the
utilization plots cover the ``UTILIZATION_JOBS`` jobs with the most GPU-hours (at most
``sidecar.report.figures.PLOT_POINTS`` points per GPU, evenly thinned), the phase
breakdown the ``PHASE_JOBS`` jobs with the most GPU-hours (then the longest), and the
GPU-hours charts the ``BAR_ROWS`` largest users or models and one row for the rest; the
tables hold every job.
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from typing import Any

import numpy as np
import pandas as pd

from sidecar.report import goodput_view
from sidecar.report.figures import PHASE_COLUMNS, STEP_PARTS
from sidecar.report.jobs import TEXT_COLUMNS, idle_gpu_hours, most_wasteful_first, names

UTILIZATION_JOBS = 20
PHASE_JOBS = 40
BAR_ROWS = 30
# the jobs table's first columns: what a reader needs without scrolling sideways
JOB_FIRST = [
    "job",
    "status",
    "wall (s)",
    "flags",
    "idle GPU-hours",
    "GPUs",
    "GPU-hours",
    "GPU utilization mean (%)",
]


def _asset(name: str) -> str:
    return resources.files("sidecar.report").joinpath(name).read_text(encoding="utf-8")


def _json_value(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def _table(frame: pd.DataFrame) -> dict[str, Any]:
    """Columns, rows and which columns hold text (folded on the page when long)."""
    return {
        "columns": [str(c) for c in frame.columns],
        "text": [str(c) in TEXT_COLUMNS or c == "job" or c == "name" for c in frame.columns],
        "rows": [[_json_value(v) for v in row] for row in frame.itertuples(index=False, name=None)],
    }


def _jobs_view(jobs: pd.DataFrame) -> pd.DataFrame:
    """The jobs table as the page shows it: most wasteful first, the job's name, status,
    wall time, flags and idle GPU-hours ahead of the other columns."""
    view = most_wasteful_first(
        jobs.assign(job=names(jobs), **{"idle GPU-hours": idle_gpu_hours(jobs)})
    )
    return view[JOB_FIRST + [c for c in jobs.columns if c not in JOB_FIRST]]


def _utilization(jobs: pd.DataFrame, samples: pd.DataFrame) -> list[dict[str, Any]]:
    """Per plotted job: x (time) and one column per GPU, aligned (None where missing)."""
    chosen = jobs.assign(name=names(jobs))
    chosen = chosen[chosen["GPUs"] > 0].nlargest(UTILIZATION_JOBS, "GPU-hours")
    out = []
    for position, job in chosen.iterrows():
        rows = samples[samples["job"] == position]
        if rows.empty:
            continue
        wide = rows.pivot_table(
            index="time (s)", columns="gpu", values="utilization (%)", aggfunc="last"
        )
        out.append(
            {
                "title": f"{job['name']} ({job['GPU model']})",
                "gpus": [f"GPU {g}" for g in wide.columns],
                "columns": [[_json_value(v) for v in wide.index]]
                + [[_json_value(v) for v in wide[g]] for g in wide.columns],
            }
        )
    return out


def _phases(jobs: pd.DataFrame, phase_means: pd.DataFrame) -> dict[str, Any]:
    """Shares of the mean training iteration per job: the phases, then the rest."""
    frame = jobs.join(phase_means)
    frame = frame[frame["loop mean (s)"] > 0]
    frame = frame.sort_values(["GPU-hours", "wall (s)"], ascending=False).head(PHASE_JOBS)
    loop = frame["loop mean (s)"]
    series = []
    rest = pd.Series(100.0, index=frame.index)
    for name in STEP_PARTS:
        share = frame[f"{name} mean (s)"].fillna(0.0) / loop * 100.0
        rest -= share
        series.append({"label": PHASE_COLUMNS[name], "values": [_json_value(v) for v in share]})
    series.append({"label": "other", "values": [_json_value(max(v, 0.0)) for v in rest]})
    return {"labels": [str(f) for f in names(frame)], "series": series}


def _gpu_hours(summary: pd.DataFrame, by: str) -> dict[str, Any]:
    """GPU-hours of the ``BAR_ROWS`` largest names of ``by``, then one row for the rest."""
    rows = summary[summary["by"] == by].sort_values("GPU-hours", ascending=False)
    rows = rows[rows["GPU-hours"] > 0]
    labels = [str(n) for n in rows["name"].head(BAR_ROWS)]
    values = [_json_value(v) for v in rows["GPU-hours"].head(BAR_ROWS)]
    if len(rows) > BAR_ROWS:
        rest = rows.iloc[BAR_ROWS:]
        labels.append(f"{len(rest)} more {by}s")
        values.append(_json_value(rest["GPU-hours"].sum()))
    return {"labels": labels, "values": values}


def render(
    jobs: pd.DataFrame,
    gpus: pd.DataFrame,
    summary: pd.DataFrame,
    damaged: pd.DataFrame,
    phase_means: pd.DataFrame,
    samples: pd.DataFrame,
) -> str:
    """The page. ``phase_means`` (per job: ``<phase> mean (s)`` columns of
    ``PHASE_COLUMNS``) shares the jobs' index; ``samples`` (job, gpu, time (s),
    utilization (%)) names the job by that index.
    """
    data = {
        "jobs": _table(_jobs_view(jobs)),
        "gpus": _table(gpus),
        "summary": _table(summary),
        "damaged": _table(damaged),
        "utilization": _utilization(jobs, samples),
        "phases": _phases(jobs, phase_means),
        "gpu_hours": {by: _gpu_hours(summary, by) for by in ("user", "GPU model")},
    }
    # "</" inside the JSON would end the script element early
    embedded = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    title = f"GPU report: {len(jobs)} jobs"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_asset("vendor/uPlot.min.css")}
{_asset("report.css")}</style>
<script>{_asset("vendor/uPlot.iife.min.js")}</script>
</head><body>
<h1>{html.escape(title)}</h1>
<p>Built by <code>sidecar report</code> from the run folders' own files. Click a column
header to sort, a folded cell to read it whole.</p>
<section><h2>GPU-hours</h2><div class="pair"><div id="by-user"></div><div id="by-model"></div>
</div></section>
{goodput_view.section(jobs, summary)}
<section><h2>Jobs, most wasteful first (idle GPU-hours, then flags)</h2>
<div class="scroll" id="jobs"></div></section>
<section><h2>Phase breakdown per job</h2><div id="phases"></div></section>
<section><h2>GPU utilization over time (jobs with the most GPU-hours)</h2>
<div id="utilization"></div></section>
<section><h2>GPUs</h2><div class="scroll" id="gpus"></div></section>
<section><h2>Totals per host, user and GPU model</h2><div class="scroll" id="summary"></div>
</section>
<section><h2>Damaged folders (skipped)</h2><div class="scroll" id="damaged"></div></section>
<div id="layout-check" hidden></div>
<script type="application/json" id="report-data">{embedded}</script>
<script>{_asset("report.js")}</script>
</body></html>
"""
