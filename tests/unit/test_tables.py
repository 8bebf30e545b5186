"""computational.tsv and phases.tsv from an aggregator, in-process: the 22 standard columns
in order, custom columns after them, empty tails, rank files named by the layout."""

from __future__ import annotations

from array import array

from markers import wire
from sidecar.sinks import layout, tables
from tests.unit.test_aggregator import aggregator, iteration, record


def test_computational_frame_has_the_reference_columns_then_custom_ones() -> None:
    agg = aggregator()
    agg.custom_key("augment")
    values = []
    for i in range(3):
        values += iteration(i, 10.0 * i, batch=i)
    values += record(wire.FIRST_CUSTOM_ID, 40, 41, flags=0)
    values += record(wire.EPOCH, 0, 40, flags=0)
    agg.add_records(array("q", values))
    frame = tables.computational_frame(agg)
    assert list(frame.columns[:22]) == [c[0] for c in tables.COLUMNS]
    assert list(frame.columns[22:]) == ["augment (s)"]
    assert frame.index.name == layout.INDEX_LABEL
    assert frame["Forward (s)"].round(6).tolist() == [0.002] * 3
    assert frame["Epoch (s)"].notna().sum() == 1 and frame["Training (s)"].notna().sum() == 1
    assert frame["Forward GPU (s)"].isna().all()  # a CPU run: GPU columns empty
    text = tables.to_tsv(frame, index=True)
    header = text.splitlines()[0].split("\t")
    assert header[0] == "measurement #" and len(header) == 24
    assert text.splitlines()[2].split("\t")[2] == ""  # Epoch's tail is an empty cell
    assert text == frame.to_csv(sep="\t", na_rep="", index=True, lineterminator="\n")


def test_phases_frame_is_long_and_ordered_by_start() -> None:
    agg = aggregator()
    agg.add_records(array("q", iteration(0, 0.0, 0) + iteration(1, 10.0, 1)))
    frame = tables.phases_frame(agg)
    assert list(frame.columns) == tables.PHASES_COLUMNS
    assert frame["start (s)"].is_monotonic_increasing
    assert set(frame["phase"]) == {"Training data loading", "Forward", "Training loop"}
    assert len(frame) == 6
    assert frame["epoch"].dtype.kind == "i" and frame["rank"].tolist() == [0] * 6
    assert tables.to_tsv(frame, False) == frame.to_csv(sep="\t", na_rep="", index=False,
                                                       lineterminator="\n")


def test_phases_frame_keeps_flagged_rows_batches_and_batch_sizes() -> None:
    agg = aggregator(accumulation_steps=2, train_batch_size=4)
    values = (record(wire.FORWARD, 0, 3) + record(wire.TRAINING_LOOP, 0, 4, batches=2)
              + record(wire.FORWARD, 5, 7, flags=0)  # outside any iteration
              + record(wire.FORWARD, 8, 9, iteration=1)
              + record(wire.TRAINING_LOOP, 8, 10, iteration=1, batches=1))
    agg.add_records(array("q", values))
    frame = tables.phases_frame(agg)
    assert list(frame.columns) == tables.PHASES_COLUMNS
    assert frame["phase"].tolist() == ["Forward", "Training loop", "Forward", "Forward",
                                       "Training loop"]
    assert frame["flag"].tolist() == ["", "", "outside", "", ""]
    assert frame["batches"].tolist() == [2, 2, 0, 1, 1]
    assert frame["batch size"].tolist()[1] == 4 and frame["batch size"].isna().tolist() == [
        True, False, True, True, False]
    assert tables.to_tsv(frame, False) == frame.to_csv(sep="\t", na_rep="", index=False,
                                                       lineterminator="\n")


def test_layout_names_rank_files_and_the_phase_table_once() -> None:
    assert layout.computational_file(0) == "computational.tsv"
    assert layout.phases_file(2) == "phases-rank2.tsv"
    assert [r.summary_label for r in layout.TRAIN_ROWS] == [
        "Training", "Epoch", "Iteration", "Data loading", "Forward", "Backward",
        "Optimization"]
    assert [r.summary_label for r in layout.VAL_ROWS] == [
        "Validation", "Iteration", "Data loading", "Evaluation", "Metrics computation"]


def test_to_tsv_writes_what_pandas_to_csv_writes() -> None:
    import pandas as pd

    frame = pd.DataFrame({
        "float": [0.1, float("nan"), 1e-05, 100.0, 2.5e-310],
        "int": [1, -2, 3, 0, 10**15],
        "nullable": pd.array([1, None, 3, 4, 5], dtype="Int64"),
        "text": ["Forward", None, "tab\there", 'say "x"', "line\nbreak"],
        'odd "name"\t': [True, False, True, True, False],
    })
    frame.index.name = layout.INDEX_LABEL
    for index in (True, False):
        assert tables.to_tsv(frame, index) == frame.to_csv(
            sep="\t", na_rep="", index=index, lineterminator="\n")
    empty = frame.iloc[:0]
    assert tables.to_tsv(empty, True) == empty.to_csv(sep="\t", na_rep="", index=True,
                                                      lineterminator="\n")
