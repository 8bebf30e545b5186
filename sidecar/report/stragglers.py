"""The report's straggler columns (docs/multi-node.md): per job, the rank that held the
others back as its summary's ``Straggler:`` line names it (rank, host, phase), and the
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

from sidecar.report.read import RunFolder

STRAGGLER_COLUMNS = ["straggler rank", "straggler host", "straggler phase", "waiting GPU-hours"]
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


def straggler_frame(runs: Sequence[RunFolder], gpus: pd.Series) -> pd.DataFrame:
    """STRAGGLER_COLUMNS per run (``gpus``: each run's GPU count, in order)."""
    rows = []
    for run, count in zip(runs, gpus.tolist(), strict=True):
        named = next((m for f in run.splits if (m := _LINE.search(f.summary))), None)
        waited_s, ranks = 0.0, 0
        for files in run.splits:
            split_s, split_ranks = _waited_s(files.ranks)
            waited_s += split_s
            ranks = max(ranks, split_ranks)
        per_rank = count / ranks if ranks else 0.0
        rows.append(
            {
                "straggler rank": named[1] if named else "",
                "straggler host": named[2] if named else "",
                "straggler phase": named[3] if named else "",
                "waiting GPU-hours": waited_s * per_rank / 3600.0,
            }
        )
    return pd.DataFrame(rows, columns=STRAGGLER_COLUMNS)
