"""``sidecar report``: builds the report from run folders and writes its five files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sidecar.atomic import write_atomic
from sidecar.report import figures, html, jobs, markdown, read
from sidecar.tables import to_tsv

PHASE_MEANS = [f"{name} mean (s)" for name in figures.PHASE_COLUMNS]


@dataclass(frozen=True)
class Report:
    """Everything the files show. ``phase_means``, ``samples`` and ``first_split`` feed the
    HTML plots (see ``sidecar.report.html.render``)."""

    jobs: pd.DataFrame
    gpus: pd.DataFrame
    summary: pd.DataFrame
    damaged: pd.DataFrame  # folder, reason
    phase_means: pd.DataFrame
    samples: pd.DataFrame
    first_split: pd.Series


def damaged_frame(damaged: Sequence[tuple[Path | str, str]]) -> pd.DataFrame:
    """The skipped folders and why, as a table."""
    return pd.DataFrame([(str(p), r) for p, r in damaged], columns=["folder", "reason"])


def from_folders(paths: Sequence[Path], progress: Callable[[int, int], None]) -> Report:
    """The report of every run folder under ``paths`` (damaged ones listed, skipped)."""
    runs, damaged = read.read_all(paths, progress)
    files = [f for run in runs for f in run.splits]
    figs = figures.compute(files)
    job_table, gpu_table = jobs.tables(runs, figs)
    # per job: the phase means of its first split (the split of the plotted samples)
    first_split = pd.Series(np.cumsum([0] + [len(r.splits) for r in runs])[:-1],
                            dtype="int64")
    phase_means = figs.splits[PHASE_MEANS].iloc[first_split.to_numpy()].reset_index(drop=True)
    return Report(job_table, gpu_table, jobs.summary(job_table), damaged_frame(damaged),
                  phase_means, figs.utilization, first_split)


def write(report: Report, out_dir: Path, html_file: Path | None) -> list[Path]:
    """Write jobs.tsv, gpus.tsv, summary.tsv, report.md into ``out_dir`` and the page to
    ``html_file`` (default ``out_dir/report.html``), each atomically; returns the paths.
    Raises OSError when one cannot be written."""
    texts = {
        out_dir / "jobs.tsv": to_tsv(report.jobs, index=False),
        out_dir / "gpus.tsv": to_tsv(report.gpus, index=False),
        out_dir / "summary.tsv": to_tsv(report.summary, index=False),
        out_dir / "report.md": markdown.render(report.jobs, report.gpus, report.summary,
                                               report.damaged),
        html_file or out_dir / "report.html": html.render(
            report.jobs, report.gpus, report.summary, report.damaged, report.phase_means,
            report.samples, report.first_split),
    }
    for path, text in texts.items():
        write_atomic(path, text)
    return list(texts)
