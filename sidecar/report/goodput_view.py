"""The goodput view of ``report.html``: GPU-hours lost per user and cause, and the jobs an
admin should look at first (the most GPU-hours lost), as static HTML (no script needed).
Figures: ``summary.tsv``'s ``GPU-hours lost <cause>`` and ``jobs.tsv``'s goodput columns
(docs/goodput.md)."""

from __future__ import annotations

import html
import math

import pandas as pd

from sidecar.model.goodput import BADPUT, CAUSES
from sidecar.report.jobs import names

FIRST_JOBS = 20  # jobs listed under "look at first"
COLOURS = tuple(cause.colour for cause in BADPUT)  # one per cause, in CAUSES order


def _cell(value: object, digits: int = 2) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    return html.escape(str(value))


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def lost_per_job(jobs: pd.DataFrame) -> pd.DataFrame:
    """Per job: GPU-hours lost (its GPUs × its badput seconds / 3600) and its largest
    cause, most lost first; jobs without a goodput account or GPUs are left out."""
    badput = jobs[[f"badput {cause} (s)" for cause in CAUSES]]
    lost = badput.sum(axis=1, min_count=1) * jobs["GPUs"] / 3600.0
    frame = pd.DataFrame(
        {
            "job": names(jobs),
            "user": jobs["user"],
            "GPU-hours": jobs["GPU-hours"],
            "goodput (%)": jobs["goodput (%)"],
            "GPU-hours lost": lost,
            "largest cause": [
                CAUSES[i] for i in badput.fillna(-1.0).to_numpy().argmax(axis=1).tolist()
            ],
            "flags": jobs["flags"],
        }
    )
    frame = frame[(jobs["GPUs"] > 0) & lost.notna()]
    return frame.sort_values("GPU-hours lost", ascending=False, kind="stable")


def section(jobs: pd.DataFrame, summary: pd.DataFrame) -> str:
    """The view's HTML: a bar and a row per user (GPU-hours lost by cause), then the
    ``FIRST_JOBS`` jobs that lost the most GPU-hours."""
    users = summary[summary["by"] == "user"]
    lost_columns = [f"GPU-hours lost {cause}" for cause in CAUSES]
    legend = " ".join(
        f'<span style="color:{colour}">■</span> {html.escape(cause)}'
        for cause, colour in zip(CAUSES, COLOURS, strict=True)
    )
    rows = []
    for _, user in users.iterrows():
        values = [float(user[c]) if pd.notna(user[c]) else 0.0 for c in lost_columns]
        whole = sum(values)
        bar = "".join(
            f'<span style="display:inline-block;height:1em;background:{colour};'
            f'width:{value / whole * 200 if whole else 0:.1f}px"></span>'
            for value, colour in zip(values, COLOURS, strict=True)
        )
        rows.append(
            [
                _cell(user["name"]),
                _cell(float(user["GPU-hours"])),
                _cell(whole),
                bar,
                *(_cell(v) for v in values),
            ]
        )
    per_user = _table(["user", "GPU-hours", "GPU-hours lost", "by cause", *CAUSES], rows)
    first = lost_per_job(jobs).head(FIRST_JOBS)
    job_rows = [
        [
            _cell(r["job"]),
            _cell(r["user"]),
            _cell(float(r["GPU-hours"])),
            _cell(float(r["goodput (%)"]), 1),
            _cell(float(r["GPU-hours lost"])),
            _cell(r["largest cause"]),
            _cell(r["flags"]),
        ]
        for _, r in first.iterrows()
    ]
    look_first = _table(
        ["job", "user", "GPU-hours", "goodput (%)", "GPU-hours lost", "largest cause", "flags"],
        job_rows,
    )
    return (
        f'<h2 id="goodput">Goodput: GPU-hours lost per user and cause</h2>'
        f"<p>Each job's GPUs × the seconds of each badput cause of its goodput "
        f'account. {legend}</p><div class="scroll">{per_user}</div>'
        f"<h2>Jobs to look at first (most GPU-hours lost)</h2>"
        f'<div class="scroll">{look_first}</div>'
    )
