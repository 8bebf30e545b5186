"""The tab-separated tables: ``computational.tsv`` (wide, the reference's columns) and
``phases.tsv`` (long, one row per stored measurement), written by ``sidecar.sinks.writer``.

A cap near 10⁵ makes these tables 10⁵–10⁶ rows long and every checkpoint rewrites them.
Their rows' text is formatted once per stored row and kept (``sidecar.sinks.rowtext``);
a write joins the kept text: phases.tsv ordered by start time, computational.tsv row
*i* from the *i*-th stored row of each phase. The text is what pandas'
``to_csv(sep="\\t", na_rep="")`` writes for the same table (tests/unit/test_tables.py
compares them).

``to_tsv`` writes any other frame (resources.tsv, the report's tables) the same way,
column by column (``tolist`` and ``repr``/``str`` over each column, one join per row)
instead of pandas' row-by-row ``to_csv``. pandas is imported only when a file is
written, so an idle sidecar does not carry it.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain, repeat
from typing import TYPE_CHECKING

import numpy as np

from markers import wire
from sidecar.model.aggregator import RankAggregator
from sidecar.model.series import Row
from sidecar.sinks import rowtext
from sidecar.sinks.rowtext import quoted

if TYPE_CHECKING:
    import pandas as pd

# The 22 columns of computational.tsv, in the reference's order (it writes no index column):
# label, phase and the Row attribute that fills it. Training is filled from the sessions instead.
COLUMNS: list[tuple[str, int, str]] = [
    (f"{row.column}{suffix}", row.phase, field)
    for row in wire.PHASES
    for suffix, field in zip(
        (" (s)", " GPU (s)", " GPU max memory (MB)")[: 1 + 2 * row.gpu],
        rowtext.SEGMENT_FIELDS[row.gpu],
        strict=True,
    )
]
PHASES_COLUMNS = [label for label, _ in rowtext.PHASES_CELLS]


def _text(header: Iterable[str], lines: Iterable[str]) -> str:
    """A table's text: its header cells, then its lines, each ended by a newline."""
    return "\n".join(chain(["\t".join(map(quoted, header))], lines)) + "\n"


def computational_text(agg: RankAggregator) -> str:
    """The wide table of ``agg``: the 22 standard columns, then one per custom phase, row
    *i* holding the *i*-th stored row of each phase; the shorter columns leave their tail
    empty."""
    header = [label for label, _, _ in COLUMNS]
    # One segment per phase: its cells of each row (see rowtext.SEGMENT_FIELDS), and the
    # text of its empty cells.
    segments: list[tuple[list[str], str]] = []
    for row in wire.PHASES:
        empty = "\t" * (len(rowtext.SEGMENT_FIELDS[row.gpu]) - 1)
        if row.phase == wire.TRAINING:
            cells = [rowtext.table_float(agg.training_s())] if agg.sessions else []
        else:
            cells = rowtext.texts(agg, row.phase).segments
        segments.append((cells, empty))
    for phase in agg.measured_custom():
        header.append(f"{agg.custom_names[phase]} (s)")
        segments.append((rowtext.texts(agg, phase).segments, ""))
    count = max(len(cells) for cells, _ in segments)
    columns = [chain(cells, repeat(empty, count - len(cells))) for cells, empty in segments]
    return _text(header, map("\t".join, zip(*columns, strict=True)))


def phases_text(agg: RankAggregator) -> str:
    """The long table of ``agg``: one row per stored measurement and per flagged row (cut
    short, or outside any iteration: ``flag`` says which), ordered by start time (a
    stable sort of each phase's stored rows then flagged rows, phases in the order of
    ``agg.series``: rows that start together keep that order). ``batches`` is the
    batches of the row's iteration (0 outside iterations)."""
    return _by_start(
        [
            rowtext.texts(agg, phase, which)
            for phase, series in agg.series.items()
            for which in ("rows", "flagged")
            if getattr(series, which)
        ]
    )


def sample_text(agg: RankAggregator) -> str:
    """The whole-run sample of ``agg`` (``model/whole_run.py``) in phases.tsv's columns:
    one row per phase of each iteration it keeps, ordered by start time."""
    by_phase: dict[int, list[Row]] = {}
    for phase, row in agg.whole_run.rows():
        by_phase.setdefault(phase, []).append(row)
    return _by_start([rowtext.uncached(agg, phase, rows) for phase, rows in by_phase.items()])


def _by_start(parts: list[rowtext.RowText]) -> str:
    """A long table of ``parts``' lines ordered by start time (a stable sort)."""
    lines = list(chain.from_iterable(part.lines for part in parts))
    if len(parts) > 1:
        starts = np.concatenate([part.start_s for part in parts])
        if not (starts[1:] >= starts[:-1]).all():  # NaN too: argsort puts it last
            lines = list(map(lines.__getitem__, np.argsort(starts, kind="stable").tolist()))
    return _text(PHASES_COLUMNS, lines)


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
        distinct = {item: quoted(str(item)) for item in set(items)}
        cells = [distinct[item] for item in items]
    if missing.any():
        for i in np.flatnonzero(missing).tolist():
            cells[i] = ""
    return cells


def to_tsv(frame: pd.DataFrame, index: bool) -> str:
    """Tab-separated text of ``frame``; missing values as empty cells (the text of
    ``frame.to_csv(sep="\\t", na_rep="", index=index, lineterminator="\\n")``)."""
    header = [quoted(str(name)) for name in frame.columns]
    columns = [_cells(frame[name]) for name in frame.columns]
    if index:
        header.insert(0, quoted(frame.index.name or ""))
        columns.insert(0, _cells(frame.index))
    lines = ["\t".join(header)]
    lines += map("\t".join, zip(*columns, strict=True)) if columns else [""] * len(frame)
    return "\n".join(lines) + "\n"
