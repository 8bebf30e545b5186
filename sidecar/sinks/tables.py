"""The tab-separated tables: ``computational.tsv`` (wide, the reference's columns) and
``phases.tsv`` (long, one row per stored measurement). Built with pandas, written by
``sidecar.sinks.writer``.
"""

from __future__ import annotations

import pandas as pd

from markers import wire
from sidecar.model.aggregator import RankAggregator, Row
from sidecar.sinks import layout

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
                  "wall (s)", "GPU (s)", "GPU peak (MB)", "batch size"]


def _column(rows: list[Row], attribute: str) -> pd.Series:
    return pd.Series([getattr(r, attribute) for r in rows], dtype="float64")


def computational_frame(agg: RankAggregator) -> pd.DataFrame:
    """The wide table of ``agg``: the 22 standard columns, then one per custom phase.

    Columns of different lengths leave their tail empty (NaN, written as an empty cell).
    """
    columns: dict[str, pd.Series] = {}
    for label, phase, attribute in COLUMNS:
        if phase == wire.TRAINING:
            columns[label] = pd.Series([agg.training_s()] if agg.sessions else [],
                                       dtype="float64")
            continue
        series = agg.series.get(phase)
        columns[label] = _column(series.rows if series else [], attribute)
    for phase in sorted(p for p in agg.series if p >= wire.FIRST_CUSTOM_ID):
        columns[f"{agg.custom_names[phase]} (s)"] = _column(agg.series[phase].rows, _TIME)
    frame = pd.DataFrame(columns)
    frame.index.name = layout.INDEX_LABEL
    return frame


def phases_frame(agg: RankAggregator) -> pd.DataFrame:
    """The long table of ``agg``: one row per stored measurement, ordered by start time."""
    records = [
        (wire.phase_label(phase, agg.custom_names), r.epoch, r.iteration, r.batch, agg.rank,
         r.session, r.start_s, r.wall_s, r.gpu_s, r.peak_mib, r.batch_size)
        for phase, series in agg.series.items() for r in series.rows
    ]
    frame = pd.DataFrame.from_records(records, columns=PHASES_COLUMNS)
    frame["batch size"] = frame["batch size"].astype("Int64")  # loop rows only: an integer
    return frame.sort_values("start (s)", kind="stable").reset_index(drop=True)


def to_tsv(frame: pd.DataFrame, index: bool) -> str:
    """Tab-separated text of ``frame``; missing values as empty cells."""
    return frame.to_csv(sep="\t", na_rep="", index=index, lineterminator="\n")
