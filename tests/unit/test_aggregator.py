"""The aggregator in-process: warmup at iteration boundaries, caps, accumulation sums,
streaming figures past the cap, uncapped phases, abandoned iterations (SPEC §4)."""

from __future__ import annotations

import numpy as np
import pytest

from markers import wire
from sidecar.model.aggregator import RankAggregator, Settings

MS = 1_000_000  # ns
TRAIN = wire.FLAG_IN_ITERATION
VAL = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION


def record(phase: int, start_ms: float, end_ms: float, flags: int = TRAIN, epoch: int = 0,
           iteration: int = 0, batch: int = 0, gpu_ns: int = -1, peak: int = -1) -> list[int]:
    """One decoded record (``wire.RECORD_FIELDS`` order)."""
    return [phase, flags, epoch, iteration, batch, int(start_ms * MS), int(end_ms * MS),
            gpu_ns, peak]


def iteration(i: int, t_ms: float, batch: int, forward_ms: float = 2.0,
              flags: int = TRAIN) -> list[int]:
    """Data loading 1 ms, forward, then the loop record over the whole iteration."""
    loading, loop = ((wire.VALIDATION_DATA_LOADING, wire.VALIDATION_LOOP) if flags & 2
                     else (wire.TRAINING_DATA_LOADING, wire.TRAINING_LOOP))
    return (record(loading, t_ms, t_ms + 1, flags, iteration=i, batch=batch)
            + record(wire.FORWARD, t_ms + 1, t_ms + 1 + forward_ms, flags, iteration=i,
                     batch=batch)
            + record(loop, t_ms, t_ms + 1 + forward_ms, flags, iteration=i, batch=batch))


def rows(values: list[int]) -> np.ndarray:
    """Flat record values as the decoded array the aggregator takes."""
    return np.array(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)


def aggregator(**settings: int) -> RankAggregator:
    agg = RankAggregator(0, Settings(**settings), 1000.0)
    agg.begin_session(1000.0, 0)
    return agg


def walls(agg: RankAggregator, phase: int) -> list[float]:
    series = agg.series.get(phase)
    return [round(r.wall_s * 1000, 6) for r in series.rows] if series else []


def test_warmup_is_decided_per_iteration_and_rows_stay_aligned() -> None:
    agg = aggregator(warmup_iterations=2, num_measurements=100)
    values = []
    for i in range(5):
        values += iteration(i, 10.0 * i, batch=i, forward_ms=1.0 + i)
    agg.add_records(rows(values))
    assert walls(agg, wire.FORWARD) == [3.0, 4.0, 5.0]  # iterations 2, 3, 4
    assert walls(agg, wire.TRAINING_LOOP) == [4.0, 5.0, 6.0]
    assert [r.iteration for r in agg.series[wire.FORWARD].rows] == [2, 3, 4]
    assert [r.iteration for r in agg.series[wire.TRAINING_LOOP].rows] == [2, 3, 4]


def test_caps_bound_the_rows_but_not_the_streaming_figures() -> None:
    agg = aggregator(num_measurements=3)
    values = []
    for i in range(10):
        values += iteration(i, 10.0 * i, batch=i, forward_ms=float(i + 1))
    agg.add_records(rows(values))
    series = agg.series[wire.FORWARD]
    assert len(series.rows) == 3 and len(agg.series[wire.TRAINING_LOOP].rows) == 3
    assert series.wall.count == 10
    assert series.wall.mean == pytest.approx(5.5e-3)
    assert agg.stored_iterations[False] == 3


def test_accumulation_sums_the_phases_of_one_step() -> None:
    agg = aggregator()
    # One optimization step of two batches: two loadings and forwards, one loop record.
    values = (record(wire.TRAINING_DATA_LOADING, 0, 1) + record(wire.FORWARD, 1, 3)
              + record(wire.TRAINING_DATA_LOADING, 3, 5) + record(wire.FORWARD, 5, 9)
              + record(wire.OPTIMIZATION, 9, 10) + record(wire.TRAINING_LOOP, 0, 10))
    agg.add_records(rows(values))
    assert walls(agg, wire.TRAINING_DATA_LOADING) == [3.0]
    assert walls(agg, wire.FORWARD) == [6.0]
    assert walls(agg, wire.OPTIMIZATION) == [1.0]
    assert walls(agg, wire.TRAINING_LOOP) == [10.0]
    assert agg.series[wire.FORWARD].rows[0].start_s == pytest.approx(0.001)


def test_an_abandoned_iteration_is_never_measured() -> None:
    agg = aggregator()
    values = (record(wire.FORWARD, 0, 5, iteration=0)  # left with break: no loop record
              + iteration(1, 10.0, batch=1))
    agg.add_records(rows(values))
    assert walls(agg, wire.FORWARD) == [2.0]
    assert [r.iteration for r in agg.series[wire.FORWARD].rows] == [1]


def test_uncapped_phases_are_always_stored_and_validation_has_its_own_cap() -> None:
    agg = aggregator(num_measurements=1, warmup_iterations=0)
    values = []
    for e in range(3):
        values += record(wire.EPOCH, 100.0 * e, 100.0 * e + 50, flags=0, epoch=e)
    values += iteration(0, 0.0, 0) + iteration(1, 10.0, 1)
    values += iteration(0, 20.0, 2, flags=VAL) + iteration(1, 30.0, 3, flags=VAL)
    agg.add_records(rows(values))
    assert walls(agg, wire.EPOCH) == [50.0, 50.0, 50.0]
    assert len(agg.series[wire.TRAINING_LOOP].rows) == 1
    assert len(agg.series[wire.VALIDATION_LOOP].rows) == 1
    assert agg.series[wire.VALIDATION_LOOP].wall.count == 2


def test_gpu_times_and_peaks_are_summed_and_maxed_and_drops_counted() -> None:
    agg = aggregator()
    values = (record(wire.FORWARD, 0, 1, gpu_ns=2 * MS, peak=4 * 1024 * 1024)
              + record(wire.FORWARD, 1, 2, gpu_ns=3 * MS, peak=8 * 1024 * 1024)
              + record(wire.BACKWARD, 2, 3, flags=TRAIN | wire.FLAG_GPU_DROPPED)
              + record(wire.TRAINING_LOOP, 0, 3))
    agg.add_records(rows(values))
    (row,) = agg.series[wire.FORWARD].rows
    assert row.gpu_s == pytest.approx(0.005) and row.peak_mib == 8.0
    assert agg.series[wire.BACKWARD].rows[0].gpu_s is None
    assert agg.gpu_not_measured == 1


def test_training_time_adds_sessions_and_state_round_trips() -> None:
    agg = aggregator()
    agg.add_records(rows(iteration(0, 0.0, 0)))
    agg.end_session(int(500 * MS))
    assert agg.training_s() == pytest.approx(0.5)
    copy = RankAggregator(0, Settings(), 0.0)
    copy.load_state(agg.to_state())
    copy.begin_session(2000.0, 0)
    copy.add_records(rows(iteration(0, 0.0, 0)))
    copy.end_session(int(250 * MS))
    assert copy.training_s() == pytest.approx(0.75)
    assert walls(copy, wire.FORWARD) == [2.0, 2.0]
    assert [r.session for r in copy.series[wire.FORWARD].rows] == [0, 1]
