"""``sidecar trace``: one split's timeline as a Chrome Trace Event file (the JSON object
form: ``{"traceEvents": [...]}``), which Perfetto UI, chrome://tracing and speedscope open.

* One process per rank, named ``rank R on HOST``: a complete event (``"ph": "X"``) per
  stored row of the rank's phases.tsv, on one thread, so the slices nest as the phases
  do (Epoch > Training loop > Training data loading, Forward, Backward, Optimization,
  custom phases; Validation > Validation loop > ...). Slices are named by their phase
  alone (a flagged row's slice is in category ``flagged``) and carry no ``args``, so
  speedscope groups a phase as one frame; an instant event (``"ph": "i"``) at each
  slice's start holds its row in ``args``.
* One process per resources file, named ``resources on HOST``: counter events
  (``"ph": "C"``) per GPU (utilization %, memory used MiB, power W) and for the job's
  processes (CPU %, RSS MiB) and the host (memory used %), each series cut to at most
  ``max_points`` points by averaging neighbours.
* Time: whole microseconds since the split's earliest start, every rank on the wall clock
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
    """A complete event per stored row of every rank, in whole microseconds, each followed
    by an instant event holding the row's details (``args``)."""
    frame = rows.phases
    offset_us = frame["rank"].map(
        lambda r: (rows.rank_start_unix.get(int(r), start_unix) - start_unix) * US_PER_S
    )
    # start and end rounded on their own (not start + duration): rounding is monotone, so
    # a slice that ends where its successor starts still does, to the microsecond
    begin_us = frame["start (s)"] * US_PER_S + offset_us
    start_us = begin_us.round()
    end_us = (begin_us + frame["wall (s)"].fillna(0) * US_PER_S).round()
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
        ts = int(start_us.iloc[index])
        events.append(
            {
                "ph": "X",
                "name": record["phase"],
                "cat": "flagged" if flag else "phase",
                "pid": int(record["rank"]),
                "tid": 0,
                "ts": ts,
                "dur": max(int(end_us.iloc[index]) - ts, 0),
                "args": args,
            }
        )
    return events


def _nested(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``slices`` ordered per track and made to nest strictly, in place.

    Chrome Trace Event ``X`` slices of one thread must nest; viewers such as speedscope
    also open a slice before closing an equal-named one that ends at the same
    microsecond, so a phase that directly follows itself (Training loop, iteration after
    iteration) is drawn one level deeper each time. So: where rounding left two slices
    overlapping by a microsecond, the shorter overlap is cut (an inner slice ends with
    its outer one, a slice ends where its successor starts), and a slice followed at once
    by one of the same name ends 1 µs before it, its inner slices with it.
    """
    ordered = sorted(slices, key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    open_slices: list[dict[str, Any]] = []
    track: tuple[int, int] | None = None
    for event in ordered:
        if (event["pid"], event["tid"]) != track:
            track, open_slices = (event["pid"], event["tid"]), []
        ts, end = event["ts"], event["ts"] + event["dur"]
        closed: list[dict[str, Any]] = []
        while open_slices:
            top = open_slices[-1]
            top_end = top["ts"] + top["dur"]
            if top_end > ts and top_end >= end:
                break  # it holds this one
            if top_end > ts and top_end - ts > end - top_end:
                event["dur"] = top_end - ts  # an inner slice past its outer one's end
                break
            top["dur"] = min(top["dur"], ts - top["ts"])
            closed.append(open_slices.pop())
        for depth, done in enumerate(closed):
            if done["name"] == event["name"] and done["ts"] + done["dur"] == ts and ts > 0:
                for inner in closed[: depth + 1]:
                    inner["dur"] = max(min(inner["dur"], ts - 1 - inner["ts"]), 0)
                break
        open_slices.append(event)
    return ordered


def _with_details(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each slice without its ``args``, followed by an instant event (``"ph": "i"``,
    thread scope) at its start that holds them: speedscope names a frame by its name and
    its args together, so slices with args would never group as one phase."""
    events = []
    for event in slices:
        args = event.pop("args")
        events.append(event)
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": event["name"],
                "cat": event["cat"],
                "pid": event["pid"],
                "tid": event["tid"],
                "ts": event["ts"],
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
    events += _with_details(_nested(_slices(rows, start_unix)))
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
