"""``report.md``: the report's tables as Markdown, each run named by its folder (its run
id when built from Prometheus), the most wasteful first (most idle GPU-hours, then most
flags, then most GPU-hours)."""

from __future__ import annotations

import math

import pandas as pd

from sidecar.report.jobs import GPU_FIGURE_COLUMNS, idle_gpu_hours, most_wasteful_first, names

JOB_VIEW = [
    "folder",
    "user",
    "host",
    "status",
    "wall (s)",
    "flags",
    "idle GPU-hours",
    "GPUs",
    "GPU model",
    "GPU-hours",
    "GPU utilization mean (%)",
    "GPU memory peak (%)",
    "data loading share (%)",
    "train throughput (samples/s)",
    "energy (kWh)",
]
GPU_VIEW = ["folder", "gpu", "uuid", "GPU model", *GPU_FIGURE_COLUMNS, "flags"]


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def table(frame: pd.DataFrame) -> list[str]:
    """Markdown lines of ``frame`` (header, rule, one line per row)."""
    lines = [
        "| " + " | ".join(str(c) for c in frame.columns) + " |",
        "|" + "---|" * len(frame.columns),
    ]
    lines += [
        "| " + " | ".join(_cell(v) for v in row) + " |"
        for row in frame.itertuples(index=False, name=None)
    ]
    return lines


def render(
    jobs: pd.DataFrame, gpus: pd.DataFrame, summary: pd.DataFrame, damaged: pd.DataFrame
) -> str:
    """The text of report.md."""
    jobs = jobs.assign(folder=names(jobs), **{"idle GPU-hours": idle_gpu_hours(jobs)})
    gpus = gpus.assign(folder=names(gpus))
    lines = [
        f"# GPU report: {len(jobs)} jobs",
        "",
        "Built by `sidecar report` from the run folders' own files; every figure is in "
        "jobs.tsv, gpus.tsv and summary.tsv beside this file.",
        "",
        "## Jobs, most wasteful first",
        "",
        *table(most_wasteful_first(jobs)[JOB_VIEW]),
        "",
        "## GPUs",
        "",
        *table(gpus[GPU_VIEW]),
        "",
        "## Totals per host, user and GPU model",
        "",
        *table(summary),
        "",
    ]
    if len(damaged):
        lines += ["## Damaged folders (skipped)", "", *table(damaged), ""]
    return "\n".join(lines)
