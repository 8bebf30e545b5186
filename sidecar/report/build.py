"""``sidecar report``: builds the report from run folders and writes its five files.

Folders are read and computed ``CHUNK`` at a time, so memory stays bounded however many
folders there are: a chunk's raw files are dropped once its figures are made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sidecar.report import figures, html, jobs, markdown, read
from sidecar.sinks.atomic import write_atomic
from sidecar.sinks.tables import to_tsv

CHUNK = 1000
PHASE_MEANS = [f"{name} mean (s)" for name in figures.PHASE_COLUMNS]


@dataclass(frozen=True)
class Report:
    """Everything the files show. ``phase_means`` (one row per job: ``PHASE_MEANS``) and
    ``samples`` (job, gpu, time (s), utilization (%)) feed the HTML plots; both come from a
    job's first split."""

    jobs: pd.DataFrame
    gpus: pd.DataFrame
    summary: pd.DataFrame
    damaged: pd.DataFrame  # folder, reason
    phase_means: pd.DataFrame
    samples: pd.DataFrame


def damaged_frame(damaged: Sequence[tuple[Path | str, str]]) -> pd.DataFrame:
    """The skipped folders and why, as a table."""
    return pd.DataFrame([(str(p), r) for p, r in damaged], columns=["folder", "reason"])


def _chunk(
    runs: list[read.RunFolder], offset: int
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    figs = figures.compute([f for run in runs for f in run.splits])
    job_table, gpu_table = jobs.tables(runs, figs)
    first = np.cumsum([0] + [len(r.splits) for r in runs])[:-1]  # each job's first split
    job_of_first = pd.Series(np.arange(len(runs)) + offset, index=first)
    samples = figs.utilization[figs.utilization["split"].isin(first)]
    samples = samples.assign(job=job_of_first[samples["split"]].to_numpy()).drop(columns="split")
    return job_table, gpu_table, figs.splits[PHASE_MEANS].iloc[first], samples


def from_folders(paths: Sequence[Path], progress: Callable[[int, int], None]) -> Report:
    """The report of every run folder under ``paths`` (damaged ones listed, skipped);
    ``progress(done, total)`` is called as folders are read."""
    folders = list(read.find_run_folders(paths))
    damaged: list[tuple[Path, str]] = []
    parts = []
    runs: list[read.RunFolder] = []
    done = 0
    for i, folder in enumerate(folders):
        try:
            runs.append(read.read_run_folder(folder))
        except read.Damaged as exc:
            damaged.append((folder, str(exc)))
        progress(i + 1, len(folders))
        if len(runs) == CHUNK or (i == len(folders) - 1 and runs):
            parts.append(_chunk(runs, done))
            done += len(runs)
            runs = []
    if not parts:  # no readable folder: empty tables of the right columns and types
        parts.append(
            (
                jobs.typed(pd.DataFrame(columns=jobs.JOB_COLUMNS), jobs.JOB_COLUMNS),
                jobs.typed(pd.DataFrame(columns=jobs.GPU_COLUMNS), jobs.GPU_COLUMNS),
                pd.DataFrame(columns=PHASE_MEANS, dtype="float64"),
                pd.DataFrame({"gpu": [], "time (s)": [], "utilization (%)": [], "job": []}),
            )
        )
    job_table, gpu_table, phase_means, samples = (
        pd.concat(column, ignore_index=True) for column in zip(*parts, strict=True)
    )
    return Report(
        job_table, gpu_table, jobs.summary(job_table), damaged_frame(damaged), phase_means, samples
    )


def write(report: Report, out_dir: Path, html_file: Path | None) -> list[Path]:
    """Write jobs.tsv, gpus.tsv, summary.tsv, report.md into ``out_dir`` and the page to
    ``html_file`` (default ``out_dir/report.html``), each atomically; returns the paths.
    Raises OSError when one cannot be written."""
    texts = {
        out_dir / "jobs.tsv": to_tsv(report.jobs, index=False),
        out_dir / "gpus.tsv": to_tsv(report.gpus, index=False),
        out_dir / "summary.tsv": to_tsv(report.summary, index=False),
        out_dir / "report.md": markdown.render(
            report.jobs, report.gpus, report.summary, report.damaged
        ),
        html_file or out_dir / "report.html": html.render(
            report.jobs,
            report.gpus,
            report.summary,
            report.damaged,
            report.phase_means,
            report.samples,
        ),
    }
    for path, text in texts.items():
        write_atomic(path, text)
    return list(texts)
