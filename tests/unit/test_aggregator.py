"""The aggregator in-process: warmup at iteration boundaries, caps, accumulation sums,
streaming figures past the cap, uncapped phases, abandoned iterations (docs/contract.md,
Semantics)."""

from __future__ import annotations

from array import array

import pytest

from markers import wire
from sidecar.model import state
from sidecar.model.aggregator import RankAggregator, Settings

MS = 1_000_000  # ns
TRAIN = wire.FLAG_IN_ITERATION
VAL = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION


def record(
    phase: int,
    start_ms: float,
    end_ms: float,
    flags: int = TRAIN,
    epoch: int = 0,
    iteration: int = 0,
    batch: int = 0,
    gpu_ns: int = -1,
    peak: int = -1,
    batches: int = 0,
    lag_ns: int = 0,
) -> list[int]:
    """One decoded record (``wire.RECORD_FIELDS`` order; fields not named here are 0)."""
    values = [0] * wire.RECORD_WIDTH
    for offset, value in (
        (wire.P_PHASE, phase),
        (wire.P_FLAGS, flags),
        (wire.P_EPOCH, epoch),
        (wire.P_ITERATION, iteration),
        (wire.P_BATCH, batch),
        (wire.P_START, int(start_ms * MS)),
        (wire.P_END, int(end_ms * MS)),
        (wire.P_GPU, gpu_ns),
        (wire.P_PEAK, peak),
        (wire.P_BATCHES, batches),
        (wire.P_LAG, lag_ns),
    ):
        values[offset] = value
    return values


def iteration(
    i: int, t_ms: float, batch: int, forward_ms: float = 2.0, flags: int = TRAIN
) -> list[int]:
    """Data loading 1 ms, forward, then the loop record over the whole iteration."""
    loading, loop = (
        (wire.VALIDATION_DATA_LOADING, wire.VALIDATION_LOOP)
        if flags & 2
        else (wire.TRAINING_DATA_LOADING, wire.TRAINING_LOOP)
    )
    return (
        record(loading, t_ms, t_ms + 1, flags, iteration=i, batch=batch)
        + record(wire.FORWARD, t_ms + 1, t_ms + 1 + forward_ms, flags, iteration=i, batch=batch)
        + record(loop, t_ms, t_ms + 1 + forward_ms, flags, iteration=i, batch=batch)
    )


def aggregator(**settings: int) -> RankAggregator:
    """An aggregator in its first session; no warmup unless ``settings`` asks for one."""
    agg = RankAggregator(0, Settings(**{"warmup_iterations": 0, **settings}), 1000.0)
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
    agg.add_records(array("q", values))
    assert walls(agg, wire.FORWARD) == [3.0, 4.0, 5.0]  # iterations 2, 3, 4
    assert walls(agg, wire.TRAINING_LOOP) == [4.0, 5.0, 6.0]
    assert [r.iteration for r in agg.series[wire.FORWARD].rows] == [2, 3, 4]
    assert [r.iteration for r in agg.series[wire.TRAINING_LOOP].rows] == [2, 3, 4]


def test_caps_bound_the_rows_but_not_the_streaming_figures() -> None:
    agg = aggregator(num_measurements=3)
    values = []
    for i in range(10):
        values += iteration(i, 10.0 * i, batch=i, forward_ms=float(i + 1))
    agg.add_records(array("q", values))
    series = agg.series[wire.FORWARD]
    assert len(series.rows) == 3 and len(agg.series[wire.TRAINING_LOOP].rows) == 3
    assert series.wall.count == 10
    assert series.wall.mean == pytest.approx(5.5e-3)
    assert agg.stored_iterations[False] == 3


def test_accumulation_sums_the_phases_of_one_step() -> None:
    agg = aggregator()
    # One optimization step of two batches: two loadings and forwards, one loop record.
    values = (
        record(wire.TRAINING_DATA_LOADING, 0, 1)
        + record(wire.FORWARD, 1, 3)
        + record(wire.TRAINING_DATA_LOADING, 3, 5)
        + record(wire.FORWARD, 5, 9)
        + record(wire.OPTIMIZATION, 9, 10)
        + record(wire.TRAINING_LOOP, 0, 10)
    )
    agg.add_records(array("q", values))
    assert walls(agg, wire.TRAINING_DATA_LOADING) == [3.0]
    assert walls(agg, wire.FORWARD) == [6.0]
    assert walls(agg, wire.OPTIMIZATION) == [1.0]
    assert walls(agg, wire.TRAINING_LOOP) == [10.0]
    assert agg.series[wire.FORWARD].rows[0].start_s == pytest.approx(0.001)


def flagged(agg: RankAggregator, phase: int) -> list[tuple[float, str]]:
    series = agg.series.get(phase)
    return [(round(r.wall_s * 1000, 6), r.flag) for r in series.flagged] if series else []


def test_an_iteration_whose_loop_record_never_came_is_kept_flagged() -> None:
    agg = aggregator()
    values = (
        record(wire.FORWARD, 0, 5, iteration=0)  # its loop record was lost
        + iteration(1, 10.0, batch=1)
    )
    agg.add_records(array("q", values))
    assert walls(agg, wire.FORWARD) == [2.0]
    assert [r.iteration for r in agg.series[wire.FORWARD].rows] == [1]
    assert flagged(agg, wire.FORWARD) == [(5.0, "incomplete")]
    assert agg.stored_iterations[False] == 1


def test_an_incomplete_loop_record_flags_its_iteration_and_measures_nothing() -> None:
    agg = aggregator()
    cut = TRAIN | wire.FLAG_INCOMPLETE
    values = (
        record(wire.TRAINING_DATA_LOADING, 0, 1)
        + record(wire.FORWARD, 1, 4)
        + record(wire.TRAINING_LOOP, 0, 6, flags=cut, batches=1)
        + iteration(1, 10.0, batch=1)
    )
    agg.add_records(array("q", values))
    assert walls(agg, wire.TRAINING_LOOP) == [3.0]  # iteration 1 only
    assert flagged(agg, wire.TRAINING_LOOP) == [(6.0, "incomplete")]
    assert flagged(agg, wire.FORWARD) == [(3.0, "incomplete")]
    assert agg.series[wire.FORWARD].wall.count == 1  # streaming figures: measurements only
    assert agg.series[wire.TRAINING_LOOP].flagged[0].batches == 1


def test_spans_cut_short_or_never_ended_are_kept_flagged() -> None:
    agg = aggregator()
    begin = wire.FLAG_BEGIN
    values = (
        record(wire.EPOCH, 0, 0, flags=begin)
        + record(wire.EPOCH, 0, 50, flags=0)
        + record(wire.EPOCH, 50, 50, flags=begin)
        + record(wire.EPOCH, 50, 70, flags=wire.FLAG_INCOMPLETE, epoch=1)
        + record(wire.VALIDATION, 70, 70, flags=begin, epoch=2)
        + record(wire.EPOCH, 70, 70, flags=begin, epoch=2)
        + record(wire.FORWARD, 71, 90, epoch=2)
    )  # then the process ends
    agg.add_records(array("q", values))
    agg.end_session(None)
    assert walls(agg, wire.EPOCH) == [50.0]
    assert flagged(agg, wire.EPOCH) == [(20.0, "incomplete"), (20.0, "incomplete")]
    assert flagged(agg, wire.VALIDATION) == [(20.0, "incomplete")]  # up to the last record
    assert flagged(agg, wire.FORWARD) == [(19.0, "incomplete")]  # its iteration was open


def test_phases_outside_iterations_stay_out_of_the_aligned_columns() -> None:
    agg = aggregator()
    probe = agg.custom_key("probe")
    values = (
        iteration(0, 0.0, 0)
        + record(wire.FORWARD, 5, 9, flags=0)
        + record(probe, 9, 10, flags=0)
        + record(probe, 10, 12, flags=0)
    )
    agg.add_records(array("q", values))
    assert walls(agg, wire.FORWARD) == [2.0]
    assert flagged(agg, wire.FORWARD) == [(4.0, "outside")]
    # A custom phase only ever used outside iterations is its own column, flagged outside.
    assert walls(agg, probe) == [1.0, 2.0]
    assert {r.flag for r in agg.series[probe].rows} == {"outside"}
    # Once measured inside an iteration, its column is iteration-aligned only.
    inside = record(probe, 20, 23, iteration=1, batch=1)
    agg.add_records(array("q", inside + iteration(1, 20.0, 1) + record(probe, 30, 31, flags=0)))
    assert walls(agg, probe) == [3.0]
    assert [r.iteration for r in agg.series[probe].rows] == [1]
    assert flagged(agg, probe) == [(1.0, "outside"), (2.0, "outside"), (1.0, "outside")]
    assert agg.series[probe].wall.count == 1


def test_loop_records_carry_the_batches_their_step_held() -> None:
    agg = aggregator(accumulation_steps=3, train_batch_size=4)
    values = (
        record(wire.FORWARD, 0, 3)
        + record(wire.TRAINING_LOOP, 0, 4, batches=3)
        + record(wire.FORWARD, 5, 6, iteration=1)
        + record(wire.TRAINING_LOOP, 5, 7, iteration=1, batches=1)
        + record(wire.FORWARD, 8, 9, iteration=2)
        + record(wire.TRAINING_LOOP, 8, 10, iteration=2)
    )  # no count: a whole step
    agg.add_records(array("q", values))
    assert [r.batches for r in agg.series[wire.TRAINING_LOOP].rows] == [3, 1, 3]
    assert [r.batches for r in agg.series[wire.FORWARD].rows] == [3, 1, 3]
    assert [r.batch_size for r in agg.series[wire.TRAINING_LOOP].rows] == [4, 4, 4]
    assert agg.samples == {False: 4 * 7, True: None}  # what each step held, past the cap too
    copy = RankAggregator(0, Settings(accumulation_steps=3), 0.0)
    state.load_rank(copy, state.rank_state(agg))
    assert copy.samples == {False: 28, True: None}
    assert [r.batches for r in copy.series[wire.TRAINING_LOOP].rows] == [3, 1, 3]


def test_sizes_read_inside_a_step_count_each_batch() -> None:
    # Steps of 4 batches, sizes read from the batches: 64 from the start; a short batch
    # (10) second in step 2; 64 again from step 3; then one it could not read (None) as
    # the third batch of step 4.
    agg = aggregator(accumulation_steps=4)
    for at, position, size in ((0, 0, 64), (2, 1, 10), (3, 0, 64), (4, 2, None)):
        agg.note_batch_size(False, at, size, position)
    values: list[int] = []
    for i, batches in enumerate((4, 4, 2, 4, 4)):
        values += record(wire.TRAINING_LOOP, 10 * i, 10 * i + 5, iteration=i, batches=batches)
    agg.add_records(array("q", values))
    rows = agg.series[wire.TRAINING_LOOP].rows
    assert [r.batch_size for r in rows] == [64, 64, 64, 64, 64]  # of the first batch
    assert [r.samples for r in rows] == [256, 256, 74, 256, None]
    assert agg.samples == {False: 842, True: None}
    saved = state.rank_state(agg)

    def loaded_samples() -> list[int | None]:
        copy = RankAggregator(0, Settings(accumulation_steps=4), 0.0)
        state.load_rank(copy, saved)
        return [r.samples for r in copy.series[wire.TRAINING_LOOP].rows]

    assert loaded_samples() == [256, 256, 74, 256, None]
    # A state saved before rows kept their samples: batch size × batches, as counted then.
    del saved["series"][str(wire.TRAINING_LOOP)]["rows"]["samples"]
    assert loaded_samples() == [256, 256, 128, 256, 256]


def test_custom_phases_are_keyed_by_name_and_survive_the_state() -> None:
    agg = aggregator()
    a, b = agg.custom_key("a"), agg.custom_key("b")
    assert (a, b) == (wire.FIRST_CUSTOM_ID, wire.FIRST_CUSTOM_ID + 1)
    assert agg.custom_key("a") == a
    agg.add_records(
        array(
            "q",
            record(a, 0, 1)
            + record(wire.TRAINING_LOOP, 0, 2)
            + record(wire.FORWARD, 3, 4, flags=0),
        )
    )
    copy = RankAggregator(0, Settings(), 0.0)
    state.load_rank(copy, state.rank_state(agg))
    assert copy.custom_key("b") == b and copy.custom_key("c") == b + 1
    assert copy.aligned_custom == {a}
    assert [r.flag for r in copy.series[wire.FORWARD].flagged] == ["outside"]


def test_uncapped_phases_are_always_stored_and_validation_has_its_own_cap() -> None:
    agg = aggregator(num_measurements=1, warmup_iterations=0)
    values = []
    for e in range(3):
        values += record(wire.EPOCH, 100.0 * e, 100.0 * e + 50, flags=0, epoch=e)
    values += iteration(0, 0.0, 0) + iteration(1, 10.0, 1)
    values += iteration(0, 20.0, 2, flags=VAL) + iteration(1, 30.0, 3, flags=VAL)
    agg.add_records(array("q", values))
    assert walls(agg, wire.EPOCH) == [50.0, 50.0, 50.0]
    assert len(agg.series[wire.TRAINING_LOOP].rows) == 1
    assert len(agg.series[wire.VALIDATION_LOOP].rows) == 1
    assert agg.series[wire.VALIDATION_LOOP].wall.count == 2


def test_gpu_times_and_peaks_are_summed_and_maxed_and_drops_counted() -> None:
    agg = aggregator()
    values = (
        record(wire.FORWARD, 0, 1, gpu_ns=2 * MS, peak=4 * 1024 * 1024)
        + record(wire.FORWARD, 1, 2, gpu_ns=3 * MS, peak=8 * 1024 * 1024)
        + record(wire.BACKWARD, 2, 3, flags=TRAIN | wire.FLAG_GPU_DROPPED)
        + record(wire.TRAINING_LOOP, 0, 3)
    )
    agg.add_records(array("q", values))
    (row,) = agg.series[wire.FORWARD].rows
    assert row.gpu_s == pytest.approx(0.005) and row.peak_mib == 8.0
    assert agg.series[wire.BACKWARD].rows[0].gpu_s is None
    assert agg.gpu_not_measured == 1


def test_training_time_adds_sessions_and_state_round_trips() -> None:
    agg = aggregator()
    agg.add_records(array("q", iteration(0, 0.0, 0)))
    agg.end_session(int(500 * MS))
    assert agg.training_s() == pytest.approx(0.5)
    copy = RankAggregator(0, agg.settings, 0.0)
    state.load_rank(copy, state.rank_state(agg))
    copy.begin_session(2000.0, 0)
    copy.add_records(array("q", iteration(0, 0.0, 0)))
    copy.end_session(int(250 * MS))
    assert copy.training_s() == pytest.approx(0.75)
    assert walls(copy, wire.FORWARD) == [2.0, 2.0]
    assert [r.session for r in copy.series[wire.FORWARD].rows] == [0, 1]


def test_an_epoch_open_at_a_state_is_two_flagged_parts_and_one_epoch_on_resume() -> None:
    """Epoch 1, open at the state (3 ms up to its last record), goes on for 25 ms in the
    resumed process: phases.tsv keeps both parts, the Epoch column one row of 28 ms (the
    time between the processes left out), where epoch 1 began."""
    agg = RankAggregator(0, Settings(warmup_iterations=0), 1000.0)
    agg.begin_session(1000.0, 0, "first")
    begin = wire.FLAG_BEGIN
    agg.add_records(
        array(
            "q",
            record(wire.EPOCH, 0, 0, flags=begin)
            + iteration(0, 0.0, 0)
            + record(wire.EPOCH, 0, 10, flags=0)
            + record(wire.EPOCH, 10, 10, flags=begin, epoch=1)
            + iteration(1, 10.0, 1),
        )
    )
    saved = state.rank_state(agg)  # epoch 1 open, its last record at 13 ms
    agg.add_records(array("q", record(wire.EPOCH, 10, 40, flags=0, epoch=1)))
    assert walls(agg, wire.EPOCH) == [10.0, 30.0]  # the process went on: whole
    resumed = RankAggregator(0, agg.settings, 0.0)
    state.load_rank(resumed, saved)
    resumed.begin_session(2000.0, 0)
    resumed.add_records(
        array(
            "q",
            record(wire.EPOCH, 0, 0, flags=begin, epoch=1)
            + record(wire.EPOCH, 0, 25, flags=0, epoch=1)
            + record(wire.EPOCH, 25, 25, flags=begin, epoch=2)
            + record(wire.EPOCH, 25, 45, flags=0, epoch=2),
        )
    )
    assert flagged(resumed, wire.EPOCH) == [(3.0, "part"), (25.0, "part")]
    assert walls(resumed, wire.EPOCH) == [10.0, 28.0, 20.0]
    rows = resumed.series[wire.EPOCH].rows
    assert [(r.epoch, r.session, r.flag) for r in rows] == [(0, 0, ""), (1, 0, ""), (2, 1, "")]
    assert rows[1].start_s == pytest.approx(0.010)
    assert resumed.series[wire.EPOCH].wall.count == 3
    # Resumed at the next epoch (the checkpoint was the epoch's last step): the part up to
    # the checkpoint is the epoch's row.
    later = RankAggregator(0, agg.settings, 0.0)
    state.load_rank(later, saved)
    later.begin_session(2000.0, 0)
    later.add_records(
        array(
            "q",
            record(wire.EPOCH, 0, 0, flags=begin, epoch=2)
            + record(wire.EPOCH, 0, 20, flags=0, epoch=2),
        )
    )
    assert flagged(later, wire.EPOCH) == [(3.0, "part")]
    assert walls(later, wire.EPOCH) == [10.0, 3.0, 20.0]
    # A new sidecar taking over the same process: its epoch goes on and ends whole.
    taken_over = RankAggregator(0, agg.settings, 0.0)
    state.load_rank(taken_over, saved, continue_run="first")
    taken_over.add_records(array("q", record(wire.EPOCH, 10, 40, flags=0, epoch=1)))
    assert flagged(taken_over, wire.EPOCH) == []
    assert walls(taken_over, wire.EPOCH) == [10.0, 30.0]


def test_the_epoch_shown_is_the_last_that_ran_not_the_next_one() -> None:
    # the markers number what follows an epoch's end (a save outside an epoch, the run's
    # own span at its end) with the next epoch
    agg = aggregator()
    save = agg.custom_key("checkpoint")
    values: list[int] = []
    for epoch in range(3):
        t_ms = epoch * 10.0
        values += record(wire.TRAINING_DATA_LOADING, t_ms, t_ms + 1, epoch=epoch, iteration=epoch)
        values += record(wire.TRAINING_LOOP, t_ms, t_ms + 2, epoch=epoch, iteration=epoch)
        values += record(wire.EPOCH, t_ms, t_ms + 3, flags=0, epoch=epoch)
        values += record(save, t_ms + 3, t_ms + 4, flags=0, epoch=epoch + 1)
    values += record(wire.TRAINING, 0, 40, flags=0, epoch=3)
    agg.add_records(array("q", values))
    assert agg.epoch == 2
