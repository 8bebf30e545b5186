"""The tab-separated tables: ``computational.tsv`` (wide, the reference's columns) and
``phases.tsv`` (long, one row per stored measurement). Built column by column as numpy
arrays into pandas frames, written by ``sidecar.sinks.writer``.

A cap near 10⁵ makes these tables 10⁵–10⁶ rows long and every checkpoint rewrites them,
so ``to_tsv`` formats whole columns at once (``tolist`` and ``repr``/``str`` over each
column, one join per row) instead of pandas' row-by-row ``to_csv``; the text is the
same as ``to_csv(sep="\\t", na_rep="")`` would write. pandas is imported only here and
only when a file is written, so an idle sidecar does not carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from markers import wire
from sidecar.model.aggregator import RankAggregator, Row
from sidecar.sinks import layout

if TYPE_CHECKING:
    import pandas as pd

# The 22 columns of computational.tsv after "measurement #", in order: label, phase and
# the Row attribute that fills it. Training is filled from the sessions instead.
_TIME, _GPU, _PEAK = "wall_s", "gpu_s", "peak_mib"
COLUMNS: list[tuple[str, int, str]] = [
    column
    for row in layout.PHASE_ROWS
    for column in ([(f"{row.column} (s)", row.phase, _TIME)] + (
        [(f"{row.column} GPU (s)", row.phase, _GPU),
         (f"{row.column} GPU max memory (MB)", row.phase, _PEAK)] if row.gpu else []))
]

PHASES_COLUMNS = ["phase", "epoch", "iteration", "batch", "rank", "session", "start (s)",
                  "wall (s)", "GPU (s)", "GPU peak (MB)", "batch size", "batches", "flag"]
# The Row attributes behind PHASES_COLUMNS (phase and rank come from elsewhere).
_PHASES_ATTRIBUTES = {"epoch": "epoch", "iteration": "iteration", "batch": "batch",
                      "session": "session", "start (s)": "start_s", "wall (s)": "wall_s",
                      "GPU (s)": "gpu_s", "GPU peak (MB)": "peak_mib",
                      "batch size": "batch_size", "batches": "batches", "flag": "flag"}
_INTEGER = frozenset({"epoch", "iteration", "batch", "rank", "session", "batches"})
_TEXT = frozenset({"flag"})


def _column(rows: Sequence[Row], attribute: str, dtype: str = "float64") -> np.ndarray:
    """One attribute of every row as an array (None, not measured, becomes NaN)."""
    return np.array(list(map(attrgetter(attribute), rows)), dtype=dtype)


def computational_frame(agg: RankAggregator) -> pd.DataFrame:
    """The wide table of ``agg``: the 22 standard columns, then one per custom phase.

    Columns of different lengths leave their tail empty (NaN, written as an empty cell).
    """
    import pandas as pd

    columns: dict[str, pd.Series] = {}
    for label, phase, attribute in COLUMNS:
        if phase == wire.TRAINING:
            values = np.array([agg.training_s()] if agg.sessions else [], dtype="float64")
        else:
            series = agg.series.get(phase)
            values = _column(series.rows if series else [], attribute)
        columns[label] = pd.Series(values, dtype="float64")
    for phase in agg.measured_custom():
        columns[f"{agg.custom_names[phase]} (s)"] = pd.Series(
            _column(agg.series[phase].rows, _TIME), dtype="float64")
    frame = pd.DataFrame(columns)
    frame.index.name = layout.INDEX_LABEL
    return frame


def phases_frame(agg: RankAggregator) -> pd.DataFrame:
    """The long table of ``agg``: one row per stored measurement and per flagged row (cut
    short, or outside any iteration: ``flag`` says which), ordered by start time (a
    stable sort: rows that start together keep the phases' order). ``batches`` is the
    batches of the row's iteration (0 outside iterations)."""
    import pandas as pd

    parts = [(phase, series.rows + series.flagged) for phase, series in agg.series.items()
             if series.rows or series.flagged]
    labels = np.array([wire.phase_label(phase, agg.custom_names) for phase, _ in parts],
                      dtype=object)
    owner = np.repeat(np.arange(len(parts)), [len(rows) for _, rows in parts])
    rows = [row for _, phase_rows in parts for row in phase_rows]
    columns: dict[str, np.ndarray] = {"phase": labels[owner] if len(parts) else
                                      np.array([], dtype=object)}
    for name in PHASES_COLUMNS[1:]:
        if name == "rank":
            columns[name] = np.full(len(rows), agg.rank, dtype="int64")
        else:
            columns[name] = _column(rows, _PHASES_ATTRIBUTES[name],
                                    "int64" if name in _INTEGER else
                                    "object" if name in _TEXT else "float64")
    order = np.argsort(columns["start (s)"], kind="stable")
    frame = pd.DataFrame({name: values[order] for name, values in columns.items()})
    frame["batch size"] = frame["batch size"].astype("Int64")  # loop rows only: an integer
    return frame


def _quoted(text: str) -> str:
    """A cell as the csv module's minimal quoting writes it with a tab separator."""
    if any(c in text for c in '\t"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _cells(values: pd.Series | pd.Index) -> list[str]:
    """Every cell of one column as text: floats by ``repr`` (as pandas writes them),
    missing values empty, text quoted where it must be."""
    missing = np.asarray(values.isna())
    cells: list[str]
    if values.dtype.kind == "f":
        cells = list(map(repr, values.tolist()))
    elif values.dtype.kind in "iub":
        cells = list(map(str, values.tolist()))
    else:  # text or mixed: few distinct values, each formatted once (missing ones below)
        items = values.tolist()
        distinct = {item: _quoted(str(item)) for item in set(items)}
        cells = [distinct[item] for item in items]
    if missing.any():
        for i in np.flatnonzero(missing).tolist():
            cells[i] = ""
    return cells


def to_tsv(frame: pd.DataFrame, index: bool) -> str:
    """Tab-separated text of ``frame``; missing values as empty cells (the text of
    ``frame.to_csv(sep="\\t", na_rep="", index=index, lineterminator="\\n")``)."""
    header = [_quoted(str(name)) for name in frame.columns]
    columns = [_cells(frame[name]) for name in frame.columns]
    if index:
        header.insert(0, _quoted(frame.index.name or ""))
        columns.insert(0, _cells(frame.index))
    lines = ["\t".join(header)]
    lines += map("\t".join, zip(*columns, strict=True)) if columns else [""] * len(frame)
    return "\n".join(lines) + "\n"
