"""The goodput account's rules on records made by hand: GPU time of the productive
iterations (a fake GPU time, no CUDA here), no part counted twice, the state keeping the
counters across a resume, a later process's start taken from the downtime."""

from __future__ import annotations

import json

import pytest

from markers import wire
from sidecar.model import goodput, state
from sidecar.model.aggregator import RankAggregator, Settings
from sidecar.model.goodput import BADPUT, CAUSES
from sidecar.report import goodput_view, job_efficiency
from sidecar.sinks import summary
from tests.unit.test_aggregator import MS, TRAIN, record


def _iteration(i: int, t_ms: float, gpu_ms: float) -> list[int]:
    """10 ms: data loading 4 ms, then Forward 6 ms of which ``gpu_ms`` on the GPU."""
    return (
        record(wire.TRAINING_DATA_LOADING, t_ms, t_ms + 4, iteration=i, batch=i)
        + record(wire.FORWARD, t_ms + 4, t_ms + 10, iteration=i, batch=i, gpu_ns=int(gpu_ms * MS))
        + record(wire.TRAINING_LOOP, t_ms, t_ms + 10, iteration=i, batch=i)
    )


def _run(warmup: int = 1) -> RankAggregator:
    agg = RankAggregator(0, Settings(warmup_iterations=warmup), 1000.0)
    agg.begin_session(1000.0, 0)
    agg.sessions[-1].pre_run_s, agg.sessions[-1].sidecar_wait_s = 2.0, 0.5
    values: list[int] = []
    for i in range(4):  # iterations from 5 ms, 10 ms each
        values += _iteration(i, 5 + 10 * i, gpu_ms=3.0)
    # a validation pass (begin mark, one iteration, end) and a checkpoint save after them
    values += record(wire.VALIDATION, 45, 45, flags=wire.FLAG_BEGIN)
    values += record(wire.VALIDATION_LOOP, 45, 55, flags=TRAIN | wire.FLAG_VALIDATION)
    values += record(wire.VALIDATION, 45, 56, flags=0)
    agg.custom_key("checkpoint")
    values += record(agg.custom_key("checkpoint"), 56, 76, flags=0)
    agg.add_records(values)
    agg.end_session(80 * MS)
    return agg


def test_parts_by_cause_and_gpu_busy_of_the_productive_time() -> None:
    account = _run().goodput_account()
    badput = account.badput_s
    assert badput["sidecar_start"] == pytest.approx(0.5)
    assert badput["startup"] == pytest.approx(1.5 + 0.005)
    assert badput["warmup"] == pytest.approx(0.010)
    assert badput["data_stall"] == pytest.approx(3 * 0.004)
    assert badput["validation"] == pytest.approx(0.011)  # the pass, its iteration once
    assert badput["checkpoint"] == pytest.approx(0.020)
    assert account.productive_s == pytest.approx(3 * 0.006)
    assert account.gpu_busy_s == pytest.approx(3 * 0.003)  # the warmup iteration's not
    assert account.wall_s == pytest.approx(2.0 + 0.080)
    assert badput["other"] == pytest.approx(0.080 - 0.005 - 0.040 - 0.011 - 0.020)
    assert sum(account.parts().values()) == pytest.approx(account.wall_s, abs=1e-12)


def test_straggler_wait_comes_off_the_productive_time() -> None:
    account = _run().goodput_account(straggler_per_iteration_s=0.001)
    assert account.badput_s["straggler"] == pytest.approx(0.003)
    assert account.productive_s == pytest.approx(3 * 0.005)
    assert sum(account.parts().values()) == pytest.approx(account.wall_s, abs=1e-12)


def test_counters_travel_in_the_state_and_a_later_start_leaves_the_downtime() -> None:
    agg = _run()
    saved = state.rank_state(agg)
    resumed = RankAggregator(0, Settings(warmup_iterations=1), 1000.0)
    state.load_rank(resumed, saved)
    resumed.account_resume(saved["saved_unix"], 1000.5, 1003.0)
    resumed.begin_session(1003.0, 0)
    resumed.sessions[-1].pre_run_s = 1.0
    resumed.end_session(0)
    before, after = _run().goodput_account(), resumed.goodput_account()
    assert after.badput_s["redone"] == pytest.approx(1000.5 - 1000.08)
    assert after.badput_s["downtime"] == pytest.approx(2.5 - 1.0)
    assert after.badput_s["startup"] == pytest.approx(before.badput_s["startup"] + 1.0)
    assert after.productive_s == pytest.approx(before.productive_s)
    assert after.wall_s == pytest.approx(before.wall_s + 3.0 - 0.08)
    assert sum(after.parts().values()) == pytest.approx(after.wall_s, abs=1e-9)


def test_a_state_without_counters_counts_its_sessions_as_other() -> None:
    saved = state.rank_state(_run())
    del saved["goodput"]
    agg = RankAggregator(0, Settings(), 1000.0)
    state.load_rank(agg, saved)
    account = agg.goodput_account()
    assert account.productive_s == 0.0
    assert account.badput_s["other"] == pytest.approx(0.080)
    assert goodput.total([account, account]).wall_s == pytest.approx(2 * account.wall_s)


def test_the_cause_table_gives_each_cause_one_id_and_colour() -> None:
    assert tuple(cause.id for cause in BADPUT) == CAUSES
    assert len(set(CAUSES)) == len({cause.colour for cause in BADPUT}) == len(BADPUT)
    # the two causes without advice of their own have a finding of their own in the report
    assert {cause.id for cause in BADPUT if cause.advice is None} == {"data_stall", "straggler"}
    assert list(job_efficiency.SHORT) == ["productive", *CAUSES]
    assert tuple(cause.colour for cause in BADPUT) == goodput_view.COLOURS


def test_training_against_the_frameworks_own_loop_clock() -> None:
    # session 0 killed (no loop sent), session 1 sent its loop: 10 ms in, 20 ms before
    # its end of 80 ms; the lines name the loop and the parts before and after it
    agg = RankAggregator(0, Settings(warmup_iterations=0), 1000.0)
    agg.begin_session(1000.0, 0)
    agg.end_session(50 * MS)
    assert summary._framework_loop_lines(agg, 1) == []
    agg.begin_session(1003.0, 0)
    agg.sessions[-1].loop_start_ns, agg.sessions[-1].loop_end_ns = 10 * MS, 60 * MS
    agg.end_session(80 * MS)
    assert agg.framework_loop_s() == pytest.approx((0.08, 0.05, 0.01, 0.02, 1))
    lines = summary._framework_loop_lines(agg, 2)
    assert lines[0].startswith("Training 0.08 s (the 1 of 2 sessions that sent it) = ")
    assert "own training loop 0.05 s" in lines[0]
    assert lines[1].startswith("  + 0.01 s before that loop began")
    assert lines[2].startswith("  + 0.02 s after it ended")
    again = RankAggregator(0, Settings(), 1000.0)
    state.load_rank(again, json.loads(json.dumps(state.rank_state(agg))))
    assert again.framework_loop_s() == agg.framework_loop_s()
