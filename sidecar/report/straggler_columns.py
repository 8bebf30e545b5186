"""The report's straggler columns (docs/multi-node.md): per job, the rank that held the
others back as its run.json names it (rank, host, phase; the summary's ``Straggler:``
line for a folder written before run.json held it), what its
GPU showed in the iterations it was the slowest (its row of ``logs/ranks.tsv``: median SM
clock, mean power, largest temperature, throttle reasons; empty for a CPU rank), and the
GPU-hours the other ranks spent waiting for the slowest one.

The waiting comes from ``logs/ranks.tsv``: each rank's ``waited (s)`` over the aligned
stored iterations, scaled to every measured iteration (× measured / stored iterations),
times the GPUs per rank (the job's GPUs over its ranks), over 3600.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

from sidecar.report.read import RunFolder, SplitFiles

# the straggler's GPU: report column <- ranks.tsv column (sidecar.sinks.ranks_text)
STRAGGLER_GPU_COLUMNS = {
    "straggler SM clock (MHz)": "sm clock median (MHz)",
    "straggler power (W)": "power mean (W)",
    "straggler temperature (C)": "temperature max (C)",
    "straggler throttle reasons": "throttle reasons",
}
STRAGGLER_COLUMNS = [
    "straggler rank",
    "straggler host",
    "straggler phase",
    *STRAGGLER_GPU_COLUMNS,
    "waiting GPU-hours",
]
_LINE = re.compile(r"^Straggler: rank (\d+) on (\S+), ([a-z ]+), \+", re.M)


def _waited_s(text: str) -> tuple[float, int]:
    """Seconds all ranks of one split waited (scaled to every measured iteration), and
    the number of ranks in its ranks.tsv."""
    if not text:
        return 0.0, 0
    try:
        table = pd.read_csv(io.StringIO(text), sep="\t")
        stored = table["iterations"].astype(float).replace(0.0, np.nan)
        scaled = table["waited (s)"].astype(float) * table["measured"].astype(float) / stored
    except (ValueError, KeyError):
        return 0.0, 0
    return float(scaled.fillna(0.0).sum()), len(table)


def _table(text: str) -> pd.DataFrame | None:
    """A ranks.tsv's rows by rank (None when empty or unreadable)."""
    if not text:
        return None
    try:
        return pd.read_csv(io.StringIO(text), sep="\t", dtype=str, keep_default_na=False)
    except ValueError:
        return None


def _gpu(text: str, rank: str) -> dict[str, object]:
    """STRAGGLER_GPU_COLUMNS of ``rank``'s row in a ranks.tsv (NaN, or "" for the reasons, where
    it has none: a CPU rank, or a file written before them)."""
    table = _table(text)
    row = None
    if table is not None and "rank" in table.columns:
        rows = table[table["rank"] == rank]
        row = rows.iloc[0] if len(rows) else None
    out: dict[str, object] = {}
    for column, source in STRAGGLER_GPU_COLUMNS.items():
        cell = str(row[source]) if row is not None and source in row.index else ""
        if source == "throttle reasons":
            out[column] = cell
        else:
            out[column] = float(cell) if cell else np.nan
    return out


def _named(files: SplitFiles) -> tuple[str, str, str] | None:
    """The straggler of a split (rank, host, phase) as its run.json entry names it, or its
    summary's ``Straggler:`` line where the entry has no ``straggler`` (an older folder);
    None: none named."""
    if "straggler" in files.entry:
        stated = files.entry["straggler"]
        if not isinstance(stated, dict):
            return None
        return (
            str(stated.get("rank", "")),
            str(stated.get("host", "")),
            str(stated.get("phase", "")),
        )
    line = _LINE.search(files.summary)
    return (line[1], line[2], line[3]) if line else None


def straggler_frame(runs: Sequence[RunFolder], gpus: pd.Series) -> pd.DataFrame:
    """STRAGGLER_COLUMNS per run (``gpus``: each run's GPU count, in order): the straggler
    of its first split that names one."""
    rows = []
    for run, count in zip(runs, gpus.tolist(), strict=True):
        found = next(((f, n) for f in run.splits if (n := _named(f))), None)
        named = found[1] if found else None
        waited_s, ranks = 0.0, 0
        for files in run.splits:
            split_s, split_ranks = _waited_s(files.ranks)
            waited_s += split_s
            ranks = max(ranks, split_ranks)
        per_rank = count / ranks if ranks else 0.0
        rows.append(
            {
                "straggler rank": named[0] if named else "",
                "straggler host": named[1] if named else "",
                "straggler phase": named[2] if named else "",
                **_gpu(found[0].ranks if found else "", named[0] if named else ""),
                "waiting GPU-hours": waited_s * per_rank / 3600.0,
            }
        )
    return pd.DataFrame(rows, columns=STRAGGLER_COLUMNS)
