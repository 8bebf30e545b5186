"""The writers' kept text of the stored rows (sinks/rowtext.py, sinks/rowcache.py),
in-process: over several writes with rows added between them, a custom phase's column
reset by ``_align`` and flagged rows, every file is what a fresh build writes (the tables
as pandas writes them, the state as ``json`` writes ``to_state()``, the summary as an
aggregator with no kept text writes it), and the state reads back."""

from __future__ import annotations

import copy
import gc
import json
import weakref
from array import array
from pathlib import Path
from typing import Any

import pytest

from markers import wire
from sidecar.model import state
from sidecar.model.aggregator import RankAggregator, Settings
from sidecar.model.derived import derive
from sidecar.model.series import PhaseSeries
from sidecar.model.split import RecordCounts, Split
from sidecar.resources.monitor import ResourceFigures
from sidecar.sinks import rowtext, summary, tables, writer
from sidecar.sinks.rowcache import RowCache
from tests.unit.test_aggregator import TRAIN, VAL, record
from tests.unit.test_tables import expected_computational, expected_phases

CUSTOM = wire.FIRST_CUSTOM_ID


def _iteration(i: int, t_ms: float, gpu: bool = True) -> list[int]:
    """A training iteration with GPU times (one Backward without: not measured) and a
    custom phase outside iterations after it."""
    return (
        record(wire.TRAINING_DATA_LOADING, t_ms, t_ms + 1, iteration=i, batch=i)
        + record(
            wire.FORWARD,
            t_ms + 1,
            t_ms + 3,
            iteration=i,
            batch=i,
            gpu_ns=1_500_000 + i,
            peak=(i + 1) << 20,
        )
        + record(
            wire.BACKWARD,
            t_ms + 3,
            t_ms + 4,
            iteration=i,
            batch=i,
            gpu_ns=700_000 if gpu else -1,
            peak=5 << 20,
        )
        + record(wire.TRAINING_LOOP, t_ms, t_ms + 5, iteration=i, batch=i, batches=1)
        + record(CUSTOM, t_ms + 5, t_ms + 5.5, flags=0)
    )


def _fresh(agg: RankAggregator) -> RankAggregator:
    """``agg`` with the same rows and no kept text (new series objects)."""
    fresh = copy.copy(agg)
    fresh.series = {
        phase: PhaseSeries(list(s.rows), s.wall, s.gpu, list(s.flagged))
        for phase, s in agg.series.items()
    }
    return fresh


def _block(agg: RankAggregator) -> list[str]:
    return summary.computational_block([agg], ["GPU-a"], [], ["Resources", "none"])


def _check(split: Split) -> None:
    agg = split.rank(0)
    fresh = _fresh(agg)
    assert tables.computational_text(agg) == expected_computational(agg)
    assert tables.phases_text(agg) == expected_phases(agg)
    for table in (tables.computational_text, tables.phases_text):
        assert table(agg) == table(fresh)
    assert _block(agg) == _block(fresh)
    text = state.dumps(split.to_state(rowtext.state_rows))
    assert text == state.dumps(split.to_state())  # the columns as json writes them
    saved = json.loads(text)["ranks"]["0"]["series"]
    for phase, series in agg.series.items():
        assert saved[str(phase)]["rows"] == json.loads(json.dumps(state.row_columns(series.rows)))
    loaded = Split(split.out_dir, 0, split.settings, split.info)
    copied = loaded.load_state(state.upgrade(json.loads(text)), 0)
    assert {p: (s.rows, s.flagged) for p, s in copied.series.items()} == {
        p: (s.rows, s.flagged) for p, s in agg.series.items()
    }


def test_kept_text_equals_a_fresh_build_over_writes(tmp_path: Path) -> None:
    split = Split(
        tmp_path,
        0,
        Settings(warmup_iterations=0, num_measurements=6, train_batch_size=8),
        {"start_unix": 1000.0},
    )
    agg = split.rank(0)
    agg.begin_session(1000.0, 0)
    assert agg.custom_key("augment\tx") == CUSTOM  # a name the tables must quote
    _check(split)  # nothing yet
    values = []
    for i in range(3):
        values += _iteration(i, 10.0 * i, gpu=i != 1)
    values += record(wire.FORWARD, 35, 36, flags=0)  # outside any iteration: flagged
    agg.add_records(array("q", values))
    _check(split)
    _check(split)  # nothing new: the same text
    custom = agg.series[CUSTOM]
    assert len(custom.rows) == 3 and not custom.flagged
    # The custom phase inside an iteration: its rows become flagged, its column restarts.
    values = (
        record(CUSTOM, 40.5, 41, iteration=3, batch=3)
        + _iteration(3, 40.0)
        + record(
            wire.FORWARD, 50, 51, flags=TRAIN | wire.FLAG_INCOMPLETE, iteration=4, batch=4
        )  # ignored: an incomplete record of a phase
        + record(
            wire.TRAINING_LOOP, 50, 52, flags=TRAIN | wire.FLAG_INCOMPLETE, iteration=4, batch=4
        )  # cut short: flagged rows
        + record(wire.EPOCH, 0, 52, flags=0)
    )  # starts before everything written
    agg.add_records(array("q", values))
    assert len(custom.rows) == 1 and len(custom.flagged) == 4  # 3 moved, 1 outside
    _check(split)
    values = []
    for i in range(5, 12):  # past the cap of 6 stored iterations
        values += _iteration(i, 10.0 * i)
    values += record(wire.VALIDATION_LOOP, 130, 131, flags=VAL, iteration=0) + record(
        wire.EPOCH, 52, 131, flags=0, epoch=1
    )
    agg.add_records(array("q", values))
    assert len(agg.series[wire.FORWARD].rows) == 6
    _check(split)


def test_files_written_with_kept_text_equal_a_fresh_writers(tmp_path: Path) -> None:
    figures = ResourceFigures([], None, "test", {}, [], [], 0)
    counts = RecordCounts(0, 0, 0, 0, None)
    split = Split(tmp_path / "kept", 0, Settings(), {"start_unix": 1000.0})
    agg = split.rank(0)
    agg.begin_session(1000.0, 0)
    agg.custom_key("augment")
    for batch in range(3):
        agg.add_records(array("q", _iteration(batch, 10.0 * batch)))
        writer.write_split(split, derive(split), figures, counts, with_state=True)
    fresh = copy.copy(split)
    fresh.out_dir = tmp_path / "fresh"
    fresh.ranks = {0: _fresh(agg)}
    writer.write_split(fresh, derive(fresh), figures, counts, with_state=True)
    for path in sorted(split.split_dir.rglob("*")):
        if path.is_file() and path.suffix != ".lock":
            twin = fresh.split_dir / path.relative_to(split.split_dir)
            assert path.read_bytes() == twin.read_bytes(), path.name


def test_the_text_is_kept_per_aggregator_and_goes_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    derived: list[int] = []  # rows formatted per derivation

    def counting(rows: list, **cells: Any) -> rowtext.RowText:
        derived.append(len(rows))
        return real(rows, **cells)

    real = rowtext._derive
    monkeypatch.setattr(rowtext, "_derive", counting)
    gc.collect()
    before = len(rowtext._KEPT)  # aggregators of other tests still alive
    agg = RankAggregator(0, Settings(warmup_iterations=0), 1000.0)
    agg.begin_session(1000.0, 0)
    agg.add_records(array("q", _iteration(0, 0.0) + _iteration(1, 10.0)))
    assert len(rowtext.texts(agg, wire.FORWARD).lines) == 2
    agg.add_records(array("q", _iteration(2, 20.0)))
    assert len(rowtext.texts(agg, wire.FORWARD).lines) == 3
    assert len(rowtext.texts(agg, wire.FORWARD).lines) == 3
    assert derived == [2, 1]  # only the rows added since: the rest was kept
    assert len(rowtext.texts(_fresh(agg), wire.FORWARD).lines) == 3
    assert derived == [2, 1, 3]  # another aggregator keeps its own
    gc.collect()
    assert len(rowtext._KEPT) == before + 1  # the fresh one's went with it
    gone = weakref.ref(agg)
    del agg
    gc.collect()
    assert gone() is None and len(rowtext._KEPT) == before


def test_a_replaced_or_shortened_list_is_derived_again() -> None:
    cache = RowCache()
    rows = [object(), object()]
    derive_calls: list[int] = []

    def derive(new: list) -> int:
        derive_calls.append(len(new))
        return len(new)

    assert cache.derived("k", rows, derive) == [2]  # type: ignore[arg-type]
    rows.append(object())
    assert cache.derived("k", rows, derive) == [2, 1]  # type: ignore[arg-type]
    assert cache.derived("k", rows, derive) == [2, 1]  # type: ignore[arg-type]
    rows[-1] = object()  # the last seen row replaced
    assert cache.derived("k", rows, derive) == [3]  # type: ignore[arg-type]
    del rows[0]
    assert cache.derived("k", rows, derive) == [2]  # type: ignore[arg-type]
    assert cache.derived("k", list(rows), derive) == [2]  # type: ignore[arg-type]
    assert derive_calls == [2, 1, 3, 2, 2]


def test_schema_3_rows_become_columns() -> None:
    row = {
        "wall_s": 0.5,
        "gpu_s": None,
        "peak_mib": None,
        "epoch": 0,
        "iteration": 1,
        "batch": 1,
        "session": 0,
        "start_s": 2.0,
    }
    document = {
        "schema": 3,
        "split": 0,
        "settings": {},
        "gpus": [],
        "dropped": {},
        "lost": {},
        "rejected": 0,
        "received": {},
        "gaps": [],
        "ranks": {"0": {"series": {"4": {"rows": [row, {**row, "flag": "outside"}]}}}},
    }
    upgraded = state.upgrade(copy.deepcopy(document))  # upgraded in place
    assert upgraded["schema"] == state.SCHEMA == 4
    series = upgraded["ranks"]["0"]["series"]["4"]
    assert series["rows"]["iteration"] == [1, 1] and series["rows"]["flag"] == ["", "outside"]
    assert series["rows"]["batches"] == [0, 0] and series["flagged"]["wall_s"] == []
    broken = copy.deepcopy(document)
    del broken["ranks"]["0"]["series"]["4"]["rows"][0]["wall_s"]
    try:
        state.upgrade(broken)
    except state.StateError as exc:
        assert "lacks the field 'wall_s'" in str(exc)
    else:
        raise AssertionError("a row without wall_s was upgraded")
