"""``sidecar trace``: one split's timeline as a Chrome Trace Event file (the JSON object
form: ``{"traceEvents": [...]}``), which Perfetto UI, chrome://tracing and speedscope open.

* One process per rank, named ``rank R on HOST``: a complete event (``"ph": "X"``) per
  stored row of the rank's phases.tsv, on one thread, so the slices nest as the phases
  do (Epoch > Training loop > Training data loading, Forward, Backward, Optimization,
  custom phases; Validation > Validation loop > ...). A flagged row is a slice named
  ``PHASE (FLAG)`` in category ``flagged``; each slice's ``args`` hold its row.
* One process per resources file, named ``resources on HOST``: counter events
  (``"ph": "C"``) per GPU (utilization %, memory used MiB, power W) and for the job's
  processes (CPU %, RSS MiB) and the host (memory used %), each series cut to at most
  ``max_points`` points by averaging neighbours.
* Time: microseconds since the split's earliest start, every rank on the wall clock
  (each rank's ``start (s)`` counts from its own run start: ``SplitRows.rank_start_unix``);
  ``otherData.start_unix`` is time 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from sidecar.report.split_rows import SplitRows

MAX_POINTS = 2000  # default cap of each counter series
US_PER_S = 1e6
# Counter series: (column of resources.tsv, track name after "GPU i ", per GPU)
GPU_COUNTERS = (
    ("utilization (%)", "utilization (%)"),
    ("memory used (MB)", "memory used (MiB)"),
    ("power (W)", "power (W)"),
)
HOST_COUNTERS = (
    ("host cpu (%)", "job CPU (%)"),
    ("job memory rss (MB)", "job memory RSS (MiB)"),
    ("system memory used (%)", "host memory used (%)"),
)
ROW_ARGS = ("epoch", "iteration", "batch", "session", "batch size", "batches", "flag")
FIRST_RESOURCE_PID = 100_000  # processes of the resources tracks, after every rank's


def _number(value: Any) -> Any:
    """A cell as JSON: None for an empty one, an int for a whole number."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value.item() if isinstance(value, np.generic) else value


def _slices(rows: SplitRows, start_unix: float) -> list[dict[str, Any]]:
    """A complete event per stored row of every rank."""
    frame = rows.phases
    offset_us = frame["rank"].map(
        lambda r: (rows.rank_start_unix.get(int(r), start_unix) - start_unix) * US_PER_S
    )
    ts = (frame["start (s)"] * US_PER_S + offset_us).round(3)
    dur = (frame["wall (s)"] * US_PER_S).round(3)
    events = []
    for index, row in enumerate(frame.itertuples(index=False)):
        record = dict(zip(frame.columns, row, strict=True))
        flag = record["flag"]
        args = {name: _number(record[name]) for name in ROW_ARGS if name in record}
        args.update(
            {
                "wall (s)": _number(record["wall (s)"]),
                "GPU (s)": _number(record.get("GPU (s)")),
                "GPU peak (MB)": _number(record.get("GPU peak (MB)")),
            }
        )
        events.append(
            {
                "ph": "X",
                "name": f"{record['phase']} ({flag})" if flag else record["phase"],
                "cat": "flagged" if flag else "phase",
                "pid": int(record["rank"]),
                "tid": 0,
                "ts": float(ts.iloc[index]),
                "dur": float(dur.iloc[index]),
                "args": args,
            }
        )
    return events


def _thinned(times: np.ndarray, values: np.ndarray, max_points: int) -> tuple[Any, Any]:
    """At most ``max_points`` points: neighbours averaged in equal groups."""
    if len(values) <= max_points:
        return times, values
    groups = np.array_split(np.arange(len(values)), max_points)
    return (
        np.array([times[g[0]] for g in groups]),
        np.array([values[g].mean() for g in groups]),
    )


def _counters(
    table: pd.DataFrame, origin_us: float, pid: int, max_points: int
) -> list[dict[str, Any]]:
    """Counter events of one resources table, for the process ``pid``."""
    events = []
    series: list[tuple[str, pd.DataFrame, str]] = []
    if "gpu index" in table:
        for index, samples in table.dropna(subset=["gpu index"]).groupby("gpu index"):
            series += [
                (column, samples, f"GPU {int(index)} {name}") for column, name in GPU_COUNTERS
            ]
    host = table.drop_duplicates(subset=["time (s)"])
    series += [(column, host, name) for column, name in HOST_COUNTERS]
    for column, samples, name in series:
        if column not in samples:
            continue
        known = samples.dropna(subset=[column])
        times, values = _thinned(
            known["time (s)"].to_numpy(float), known[column].to_numpy(float), max_points
        )
        events += [
            {
                "ph": "C",
                "name": name,
                "pid": pid,
                "ts": round(origin_us + t * US_PER_S, 3),
                "args": {"value": round(float(v), 3)},
            }
            for t, v in zip(times, values, strict=True)
        ]
    return events


def _named(pid: int, name: str, order: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": order},
        },
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "phases"}},
    ]


def build(rows: SplitRows, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The trace of ``rows`` (one split): a JSON-compatible object."""
    start_unix = rows.start_unix
    events: list[dict[str, Any]] = []
    ranks = sorted(int(r) for r in rows.phases["rank"].unique())
    for order, rank in enumerate(ranks):
        events += _named(rank, f"rank {rank} on {rows.hosts.get(rank, '?')}", order)
    events += sorted(_slices(rows, start_unix), key=lambda e: (e["pid"], e["ts"], -e["dur"]))
    node_hosts = {
        str(n.get("node_id", "")): str(n.get("node_host", "?"))
        for n in rows.entry.get("nodes") or []
    }
    for number, (table, origin_unix, node) in enumerate(rows.resources):
        pid = FIRST_RESOURCE_PID + number
        host = node_hosts.get(node) or str(rows.entry.get("host") or "?")
        events += _named(pid, f"resources on {host}", len(ranks) + number)
        events += _counters(table, (origin_unix - start_unix) * US_PER_S, pid, max_points)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "folder": str(rows.folder),
            "split": rows.split,
            "start_unix": start_unix,
            "ranks": ranks,
        },
    }
