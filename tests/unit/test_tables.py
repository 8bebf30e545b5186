"""computational.tsv and phases.tsv from an aggregator, in-process: the 22 standard columns
in order, custom columns after them, empty tails, rank files named by the layout; the
text is what pandas' ``to_csv`` writes for the table built from the rows (``expected_*``
below build it independently of the writers)."""

from __future__ import annotations

from array import array
from io import StringIO

import numpy as np
import pandas as pd

from markers import wire
from sidecar.model.aggregator import RankAggregator
from sidecar.sinks import layout, tables
from tests.unit.test_aggregator import aggregator, iteration, record

_PHASES_DTYPES = {
    "epoch": "int64",
    "iteration": "int64",
    "batch": "int64",
    "rank": "int64",
    "session": "int64",
    "start (s)": "float64",
    "wall (s)": "float64",
    "GPU (s)": "float64",
    "GPU peak (MB)": "float64",
    "batch size": "Int64",
    "batches": "int64",
    "phase": "object",
    "flag": "object",
}
_PHASES_FIELDS = {
    "epoch": "epoch",
    "iteration": "iteration",
    "batch": "batch",
    "session": "session",
    "start (s)": "start_s",
    "wall (s)": "wall_s",
    "GPU (s)": "gpu_s",
    "GPU peak (MB)": "peak_mib",
    "batch size": "batch_size",
    "batches": "batches",
    "flag": "flag",
}


def _csv(frame: pd.DataFrame) -> str:
    return frame.to_csv(sep="\t", na_rep="", index=False, lineterminator="\n")


def expected_computational(agg: RankAggregator) -> str:
    """computational.tsv as pandas writes the wide frame of ``agg``'s stored rows."""
    columns = {}
    for label, phase, field in tables.COLUMNS:
        if phase == wire.TRAINING:
            values = [agg.training_s()] if agg.sessions else []
        else:
            series = agg.series.get(phase)
            values = [getattr(r, field) for r in series.rows] if series else []
        columns[label] = pd.Series(values, dtype="float64")
    for phase in agg.measured_custom():
        columns[f"{agg.custom_names[phase]} (s)"] = pd.Series(
            [r.wall_s for r in agg.series[phase].rows], dtype="float64"
        )
    return _csv(pd.DataFrame(columns))


def expected_phases(agg: RankAggregator) -> str:
    """phases.tsv as pandas writes the long frame of ``agg``'s stored and flagged rows,
    stably sorted by start."""
    rows = [
        (wire.phase_label(phase, agg.custom_names), r)
        for phase, s in agg.series.items()
        for r in s.rows + s.flagged
    ]
    values = {
        "phase": [label for label, _ in rows],
        "rank": [agg.rank] * len(rows),
        **{name: [getattr(r, field) for _, r in rows] for name, field in _PHASES_FIELDS.items()},
    }
    frame = pd.DataFrame(
        {
            name: pd.Series(values[name], dtype=_PHASES_DTYPES[name])
            for name in tables.PHASES_COLUMNS
        }
    )
    order = np.argsort(frame["start (s)"].to_numpy(), kind="stable")
    return _csv(frame.iloc[order].reset_index(drop=True))


def _read(text: str) -> pd.DataFrame:
    return pd.read_csv(StringIO(text), sep="\t")


def test_computational_text_has_the_reference_columns_then_custom_ones() -> None:
    agg = aggregator()
    agg.custom_key("augment")
    values = []
    for i in range(3):
        values += iteration(i, 10.0 * i, batch=i)
    values += record(wire.FIRST_CUSTOM_ID, 40, 41, flags=0)
    values += record(wire.EPOCH, 0, 40, flags=0)
    agg.add_records(array("q", values))
    text = tables.computational_text(agg)
    assert text == expected_computational(agg)
    frame = _read(text)
    standard = len(tables.COLUMNS)  # the phase table's columns, then the custom ones
    assert list(frame.columns[:standard]) == [c[0] for c in tables.COLUMNS]
    assert list(frame.columns[standard:]) == ["augment (s)"]
    assert frame["Forward (s)"].round(6).tolist() == [0.002] * 3
    assert frame["Epoch (s)"].notna().sum() == 1 and frame["Training (s)"].notna().sum() == 1
    assert frame["Forward GPU (s)"].isna().all()  # a CPU run: GPU columns empty
    header = text.splitlines()[0].split("\t")
    assert header[0] == "Training (s)" and len(header) == standard + 1  # no index column
    assert text.splitlines()[2].split("\t")[1] == ""  # Epoch's tail is an empty cell


def test_phases_text_is_long_and_ordered_by_start() -> None:
    agg = aggregator()
    agg.add_records(array("q", iteration(0, 0.0, 0) + iteration(1, 10.0, 1)))
    text = tables.phases_text(agg)
    assert text == expected_phases(agg)
    frame = _read(text)
    assert list(frame.columns) == tables.PHASES_COLUMNS
    assert frame["start (s)"].is_monotonic_increasing
    assert set(frame["phase"]) == {"Training data loading", "Forward", "Training loop"}
    assert len(frame) == 6
    assert frame["epoch"].dtype.kind == "i" and frame["rank"].tolist() == [0] * 6


def test_phases_text_keeps_flagged_rows_batches_and_batch_sizes() -> None:
    agg = aggregator(accumulation_steps=2, train_batch_size=4)
    values = (
        record(wire.FORWARD, 0, 3)
        + record(wire.TRAINING_LOOP, 0, 4, batches=2)
        + record(wire.FORWARD, 5, 7, flags=0)  # outside any iteration
        + record(wire.FORWARD, 8, 9, iteration=1)
        + record(wire.TRAINING_LOOP, 8, 10, iteration=1, batches=1)
    )
    agg.add_records(array("q", values))
    text = tables.phases_text(agg)
    assert text == expected_phases(agg)
    frame = _read(text)
    assert frame["phase"].tolist() == [
        "Forward",
        "Training loop",
        "Forward",
        "Forward",
        "Training loop",
    ]
    assert frame["flag"].fillna("").tolist() == ["", "", "outside", "", ""]
    assert frame["batches"].tolist() == [2, 2, 0, 1, 1]
    assert frame["batch size"].tolist()[1] == 4 and frame["batch size"].isna().tolist() == [
        True,
        False,
        True,
        True,
        False,
    ]


def test_empty_tables_are_their_header() -> None:
    agg = RankAggregator(0, aggregator().settings, 0.0)  # no session, no row
    assert tables.computational_text(agg) == expected_computational(agg)
    assert tables.phases_text(agg) == expected_phases(agg)
    assert tables.phases_text(agg).count("\n") == 1


def test_layout_names_rank_files_and_the_phase_table_once() -> None:
    assert layout.computational_file(0) == "computational.tsv"
    assert layout.phases_file(2) == "phases-rank2.tsv"
    assert [r.summary_label for r in layout.TRAIN_ROWS] == [
        "Training",
        "Epoch",
        "Iteration",
        "Data loading",
        "Forward",
        "Backward",
        "Optimization",
    ]
    assert [r.summary_label for r in layout.VAL_ROWS] == [
        "Validation",
        "Iteration",
        "Data loading",
        "Evaluation",
        "Metrics computation",
    ]


def test_to_tsv_writes_what_pandas_to_csv_writes() -> None:
    frame = pd.DataFrame(
        {
            "float": [0.1, float("nan"), 1e-05, 100.0, 2.5e-310],
            "int": [1, -2, 3, 0, 10**15],
            "nullable": pd.array([1, None, 3, 4, 5], dtype="Int64"),
            "text": ["Forward", None, "tab\there", 'say "x"', "line\nbreak"],
            'odd "name"\t': [True, False, True, True, False],
        }
    )
    frame.index.name = layout.INDEX_LABEL
    for index in (True, False):
        assert tables.to_tsv(frame, index) == frame.to_csv(
            sep="\t", na_rep="", index=index, lineterminator="\n"
        )
    empty = frame.iloc[:0]
    assert tables.to_tsv(empty, True) == empty.to_csv(
        sep="\t", na_rep="", index=True, lineterminator="\n"
    )
