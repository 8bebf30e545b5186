"""The whole-run sample (sidecar/model/whole_run.py): a stride that doubles keeps every
k-th iteration within its bound, however the items are offered, and a resumed run goes on
counting where its state left off."""

from __future__ import annotations

import random

import pytest

from markers import wire
from sidecar.model.aggregator import RankAggregator, Settings
from sidecar.model.state import load_rank, rank_state
from sidecar.model.whole_run import ITERATIONS, Stride

TRAIN = wire.FLAG_IN_ITERATION


def expected_kept(offered: int, capacity: int) -> list[int]:
    """Every k-th of ``offered`` items, k the smallest power of two that fits them."""
    stride = 1
    while -(-offered // stride) > capacity:
        stride *= 2
    return list(range(0, offered, stride))


@pytest.mark.parametrize("offered", [0, 1, 15, 16, 17, 100, 1000, 4099])
def test_a_stride_keeps_every_kth_item_within_its_bound(offered: int) -> None:
    rng = random.Random(offered)
    one_by_one, chunked = Stride(16), Stride(16)
    for _ in range(offered):
        one_by_one.take_one()
    left = offered
    while left:
        size = min(left, rng.choice([1, 3, 64, 500]))
        for position, entry in chunked.take(size).items():
            entry.append((0, chunked.seen - size + position))  # its own number
        left -= size
    for stride in (one_by_one, chunked):
        assert sorted(stride.kept) == expected_kept(offered, 16)
        assert len(stride.kept) <= 16 and stride.seen == offered
    assert all(entry == [(0, number)] for number, entry in chunked.kept.items())


def steps(first: int, count: int) -> list[int]:
    """Flat records of training iterations ``first`` to ``first + count - 1``."""
    values: list[int] = []
    for it in range(first, first + count):
        t = it * 10_000
        values += [wire.FORWARD, TRAIN, 0, it, it, t, t + 1000, -1, -1, 0, 0]
        values += [wire.TRAINING_LOOP, TRAIN, 0, it, it, t, t + 5000, -1, -1, 1, 0]
    return values


def sampled_iterations(agg: RankAggregator) -> list[int]:
    return sorted(
        row.iteration for phase, row in agg.whole_run.rows() if phase == wire.TRAINING_LOOP
    )


def test_a_resumed_run_goes_on_with_its_sample() -> None:
    settings = Settings(warmup_iterations=0, num_measurements=100)
    whole = RankAggregator(0, settings, 1000.0)
    whole.begin_session(1000.0, 0)
    whole.add_records(steps(0, 20_000))
    first = RankAggregator(0, settings, 1000.0)
    first.begin_session(1000.0, 0)
    first.add_records(steps(0, 7_000))
    first.end_session(None)
    resumed = RankAggregator(0, settings, 1000.0)
    load_rank(resumed, rank_state(first))
    resumed.begin_session(1100.0, 7_000 * 10_000)
    resumed.add_records(steps(7_000, 13_000))
    # past the 100 stored ones: every 64th of the 19 900 measured iterations after them
    assert sampled_iterations(resumed) == sampled_iterations(whole)
    assert sampled_iterations(whole) == [100 + n for n in expected_kept(19_900, ITERATIONS)]
    assert {phase for phase, _ in whole.whole_run.rows()} == {wire.FORWARD, wire.TRAINING_LOOP}
