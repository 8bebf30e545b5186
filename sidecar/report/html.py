"""``report.html``: one self-contained page (SPEC §6). uPlot (vendored, MIT, ~51 KB: the
smallest of the plotting libraries that draw from data in the page) and our script are
inlined; the tables and the plots' data are embedded as JSON and drawn in the browser.
Nothing is fetched from the network.

To keep the page light for thousands of jobs, the utilization plots cover the
``UTILIZATION_JOBS`` jobs with the most GPU-hours (at most
``sidecar.report.figures.PLOT_POINTS`` points per GPU, evenly thinned), and the phase
breakdown the ``PHASE_JOBS`` jobs with the most GPU-hours (then the longest); the tables
hold every job.
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
from sidecar.report.figures import PHASE_COLUMNS
from sidecar.report.jobs import names

UTILIZATION_JOBS = 20
PHASE_JOBS = 40
PHASE_PARTS = ("loading", "forward", "backward", "optimization")


def _asset(name: str) -> str:
    return resources.files("sidecar.report").joinpath(name).read_text(encoding="utf-8")


def _json_value(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def _table(frame: pd.DataFrame) -> dict[str, Any]:
    return {"columns": [str(c) for c in frame.columns],
            "rows": [[_json_value(v) for v in row]
                     for row in frame.itertuples(index=False, name=None)]}


def _utilization(jobs: pd.DataFrame, samples: pd.DataFrame) -> list[dict[str, Any]]:
    """Per plotted job: x (time) and one column per GPU, aligned (None where missing)."""
    chosen = jobs.assign(name=names(jobs))
    chosen = chosen[chosen["GPUs"] > 0].nlargest(UTILIZATION_JOBS, "GPU-hours")
    out = []
    for position, job in chosen.iterrows():
        rows = samples[samples["job"] == position]
        if rows.empty:
            continue
        wide = rows.pivot_table(index="time (s)", columns="gpu", values="utilization (%)",
                                aggfunc="last")
        out.append({
            "title": f"{job['name']} ({job['GPU model']})",
            "gpus": [f"GPU {g}" for g in wide.columns],
            "columns": [[_json_value(v) for v in wide.index]]
            + [[_json_value(v) for v in wide[g]] for g in wide.columns],
        })
    return out


def _phases(jobs: pd.DataFrame, phase_means: pd.DataFrame) -> dict[str, Any]:
    """Shares of the mean training iteration per job: the phases, then the rest."""
    frame = jobs.join(phase_means)
    frame = frame[frame["loop mean (s)"] > 0]
    frame = frame.sort_values(["GPU-hours", "wall (s)"], ascending=False).head(PHASE_JOBS)
    loop = frame["loop mean (s)"]
    series = []
    rest = pd.Series(100.0, index=frame.index)
    for name in PHASE_PARTS:
        share = (frame[f"{name} mean (s)"].fillna(0.0) / loop * 100.0)
        rest -= share
        series.append({"label": PHASE_COLUMNS[name], "values": [_json_value(v) for v in share]})
    series.append({"label": "other", "values": [_json_value(max(v, 0.0)) for v in rest]})
    return {"labels": [str(f) for f in names(frame)], "series": series}


def _gpu_hours(summary: pd.DataFrame, by: str) -> dict[str, Any]:
    rows = summary[summary["by"] == by].sort_values("GPU-hours", ascending=False)
    return {"labels": [str(n) for n in rows["name"]],
            "values": [_json_value(v) for v in rows["GPU-hours"]]}


def render(jobs: pd.DataFrame, gpus: pd.DataFrame, summary: pd.DataFrame,
           damaged: pd.DataFrame, phase_means: pd.DataFrame, samples: pd.DataFrame) -> str:
    """The page. ``phase_means`` (per job: ``<phase> mean (s)`` columns of
    ``PHASE_COLUMNS``) shares the jobs' index; ``samples`` (job, gpu, time (s),
    utilization (%)) names the job by that index.
    """
    data = {
        "jobs": _table(jobs), "gpus": _table(gpus), "summary": _table(summary),
        "damaged": _table(damaged), "utilization": _utilization(jobs, samples),
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
header to sort.</p>
<h2>GPU-hours</h2><div id="by-user"></div><div id="by-model"></div>
{goodput_view.section(jobs, summary)}
<h2>Phase breakdown per job</h2><div id="phases"></div>
<h2>GPU utilization over time (jobs with the most GPU-hours)</h2><div id="utilization"></div>
<h2>Jobs</h2><div class="scroll" id="jobs"></div>
<h2>GPUs</h2><div class="scroll" id="gpus"></div>
<h2>Totals per host, user and GPU model</h2><div class="scroll" id="summary"></div>
<h2>Damaged folders (skipped)</h2><div class="scroll" id="damaged"></div>
<script type="application/json" id="report-data">{embedded}</script>
<script>{_asset("report.js")}</script>
</body></html>
"""
