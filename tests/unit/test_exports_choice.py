"""Choosing exporters (one warning naming the extra, the run goes on), the optimizer
step axis across resumes: each session goes on at the step the one before reached, and
MLflow timestamps that keep distinct points distinct."""

from __future__ import annotations

import numpy as np
import pytest

from markers import wire
from sidecar import exports
from sidecar.exports.points import StepTimeline, Timestamps
from sidecar.model.aggregator import RankAggregator, Settings


def test_unknown_and_missing_exporters_give_one_warning_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exports, "installed", lambda name: name != "mlflow")
    usable, warning = exports.choose(["TensorBoard", "bogus", "mlflow", "tensorboard"])
    assert usable == ("tensorboard",)
    assert warning is not None
    assert "unknown export 'bogus'" in warning
    assert "pip install 'trainmon[mlflow]'" in warning
    assert exports.choose(["tensorboard"]) == (("tensorboard",), None)
    assert exports.parse_list("tensorboard, mlflow") == ["tensorboard", "mlflow"]
    assert exports.parse_list("none") == []


def _iteration(iteration: int, start_ns: int) -> list[int]:
    """One training iteration's loop record (in an iteration, whole)."""
    record = [0] * wire.RECORD_WIDTH
    record[wire.P_PHASE] = wire.TRAINING_LOOP
    record[wire.P_FLAGS] = wire.FLAG_IN_ITERATION
    record[wire.P_ITERATION] = iteration
    record[wire.P_BATCH] = iteration
    record[wire.P_BATCHES] = 1
    record[wire.P_START] = start_ns
    record[wire.P_END] = start_ns + 1000
    record[wire.P_GPU] = -1
    record[wire.P_PEAK] = -1
    return record


def test_steps_go_on_across_sessions_and_the_timeline_follows() -> None:
    agg = RankAggregator(0, Settings(warmup_iterations=0), 1000.0)
    timeline = StepTimeline()
    agg.begin_session(1000.0, 0)
    first = np.array([_iteration(i, i * 10**9) for i in range(5)], dtype=np.int64)
    agg.add_records(first)
    timeline.note(agg, first)
    assert agg.step() == 5
    agg.end_session(None)
    agg.begin_session(2000.0, 0)  # a resume: iteration numbers start at 0 again
    assert agg.sessions[-1].first_step == 5
    second = np.array([_iteration(i, i * 10**9) for i in range(3)], dtype=np.int64)
    agg.add_records(second)
    timeline.note(agg, second)
    assert agg.step() == 8
    starts, steps = timeline.arrays()
    assert steps.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert starts.tolist() == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0, 2000.0, 2001.0, 2002.0]


def test_points_equal_in_name_step_ms_and_value_get_timestamps_of_their_own() -> None:
    # three validation iterations of one step, ended within one ms, two of 100 ns: an
    # MLflow SQL store keeps one point per (name, step, ms, value), so the second 100 ns
    # point goes to the next free ms; other values, names and steps keep their own ms
    stamp = Timestamps().stamp
    wall = 1_700_000_000.1234
    name = "phases/evaluation_wall_s"
    stamped = [stamp((name, v, 11, wall)) for v in (2.4e-07, 1e-07, 1e-07, 1e-07)]
    assert [ms for *_, ms in stamped] == [
        1_700_000_000_123,
        *range(1_700_000_000_123, 1_700_000_000_126),
    ]
    assert len({(n, v, s, ms) for n, v, s, ms in stamped}) == 4
    assert stamp(("phases/val_loop_wall_s", 1e-07, 11, wall))[3] == 1_700_000_000_123
    assert stamp((name, 1e-07, 12, wall))[3] == 1_700_000_000_123  # a new step
