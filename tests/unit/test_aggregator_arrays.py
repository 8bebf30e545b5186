"""The aggregator's array path (runs of iteration records, ``sidecar.model.blocks``) gives
what its record-by-record path gives, on random streams of the loop shapes users write:
accumulation, validation inside and between training iterations, epochs, iterations cut
short or never closed (one by one and many in a row), phases outside iterations (one by
one and in floods), custom phases (in one kind of iteration or both), GPU times, warmup,
caps and batch sizes read from the batches; records fed in chunks of random sizes."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from markers import wire
from sidecar.model.aggregator import MIN_ARRAY_RECORDS, RankAggregator, Settings
from sidecar.model.batch_sizes import SessionBatchSizes
from sidecar.model.blocks import moments
from sidecar.model.state import rank_state

TRAIN = wire.FLAG_IN_ITERATION
VAL = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION
CUSTOM = wire.FIRST_CUSTOM_ID


def record(
    phase: int,
    flags: int,
    it: int,
    batch: int,
    start: int,
    end: int,
    rng: random.Random,
    batches: int = 0,
    epoch: int = 0,
) -> list[int]:
    # Any negative value is "not measured" (a hostile sender's -2 too).
    gpu = rng.choice([-1, -1, -2, rng.randrange(0, 10**7), rng.randrange(0, 10**7)])
    peak = rng.choice([-1, -2, rng.randrange(0, 10**9)])
    if gpu < 0 and rng.random() < 0.05:
        flags |= wire.FLAG_GPU_DROPPED
    return [phase, flags, epoch, it, batch, start, end, gpu, peak, batches, 0]


def stream(rng: random.Random) -> list[list[int]]:
    """Records of a random training run as the markers would send them (mostly)."""
    out: list[list[int]] = []
    t = 1_000_000
    batch = 0
    phases = [wire.TRAINING_DATA_LOADING, wire.FORWARD, wire.BACKWARD, wire.OPTIMIZATION, CUSTOM]
    for epoch in range(rng.randint(1, 3)):
        out.append([wire.EPOCH, wire.FLAG_BEGIN, epoch, -1, batch, t, t, -1, -1, 0, 0])
        epoch_start = t
        iterations = rng.randint(5, 60)
        cut_above = rng.choice([0.98, 0.98, 0.5, 0.0])  # some epochs cut many iterations
        for it in range(iterations):
            shape = rng.random()
            start = t
            accumulation = rng.choice([1, 1, 2, 3])
            for _ in range(accumulation):
                for phase in rng.sample(phases, rng.randint(1, len(phases))):
                    out.append(record(phase, TRAIN, it, batch, t, t + 1000, rng, epoch=epoch))
                    t += 1100
                batch += 1
            if shape < 0.05:  # validation inside the training iteration
                out += validation(rng, t, epoch)
                t += 10**6
            if shape < 0.03:
                continue  # its loop record never comes (lost)
            flags = TRAIN | (wire.FLAG_INCOMPLETE if shape > cut_above else 0)
            out.append(
                record(
                    wire.TRAINING_LOOP,
                    flags,
                    it,
                    batch - accumulation,
                    start,
                    t,
                    rng,
                    batches=rng.choice([0, accumulation]),
                    epoch=epoch,
                )
            )
            if rng.random() < 0.03:  # a phase outside any iteration
                out.append(
                    record(
                        rng.choice([wire.FORWARD, CUSTOM + 1]),
                        0,
                        -1,
                        batch,
                        t,
                        t + 50,
                        rng,
                        epoch=epoch,
                    )
                )
            if rng.random() < 0.02:  # a flood of phases outside any iteration
                for _ in range(rng.randint(50, 400)):
                    out.append(
                        record(
                            rng.choice([wire.FORWARD, wire.BACKWARD, CUSTOM, CUSTOM + 1]),
                            0,
                            -1,
                            batch,
                            t,
                            t + 50,
                            rng,
                            epoch=epoch,
                        )
                    )
                    t += 60
            t += 100
        if rng.random() < 0.5:  # validation between epochs
            out.append([wire.VALIDATION, wire.FLAG_BEGIN, epoch, -1, batch, t, t, -1, -1, 0, 0])
            begin = t
            out += validation(rng, t, epoch)
            t += 10**6
            out.append([wire.VALIDATION, 0, epoch, -1, batch, begin, t, -1, -1, 0, 0])
        out.append([wire.EPOCH, 0, epoch, -1, batch, epoch_start, t, -1, -1, 0, 0])
    return out


def validation(rng: random.Random, t: int, epoch: int) -> list[list[int]]:
    out = []
    shared = rng.random() < 0.2  # a custom phase timed in both kinds of iteration
    for it in range(rng.randint(1, 12)):
        start = t
        for phase in (
            wire.VALIDATION_DATA_LOADING,
            wire.EVALUATION,
            wire.METRICS,
            *([CUSTOM + 1] if shared else []),
        ):
            out.append(record(phase, VAL, it, it, t, t + 500, rng, epoch=epoch))
            t += 600
        out.append(
            record(
                wire.VALIDATION_LOOP,
                VAL,
                it,
                it,
                start,
                t,
                rng,
                batches=rng.choice([0, 1]),
                epoch=epoch,
            )
        )
        t += 10
    return out


def new_aggregator(
    settings: Settings, rng: random.Random, read_sizes: bool = True
) -> RankAggregator:
    """An aggregator; with ``read_sizes``, half the time with sizes read from batches."""
    agg = RankAggregator(0, settings, 1000.0)
    agg.begin_session(1000.0, 0)
    for name in ("step-extra", "outside-extra"):
        agg.custom_key(name)
    if read_sizes and rng.random() < 0.5:
        agg.note_batch_size(False, 0, 32)
        agg.note_batch_size(False, 7, rng.choice([None, 16]))
        agg.note_batch_size(False, 9, 5, 1)  # a short batch inside a step
    return agg


def close(a: Any, b: Any, path: str = "") -> None:
    """Equal, floats to a relative 1e-9 (streaming figures are summed in another order)."""
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("seed", range(150))
def test_array_path_matches_record_path(seed: int) -> None:
    rng = random.Random(seed)
    settings = Settings(
        warmup_iterations=rng.choice([0, 0, 3, 20]),
        num_measurements=rng.choice([2, 10, 40, 100_000]),
        train_batch_size=rng.choice([None, None, 8]),
        accumulation_steps=rng.choice([1, 2]),
    )
    records = stream(rng)
    one_by_one = new_aggregator(settings, random.Random(seed))
    for values in records:
        one_by_one.add_records(values)  # a single record always takes the record path
    chunked = new_aggregator(settings, random.Random(seed))
    at = 0
    while at < len(records):
        size = rng.choice([1, 7, MIN_ARRAY_RECORDS, 150, 1000])
        chunked.add_records([v for r in records[at : at + size] for v in r])
        at += size
    chunked_open = {
        k: (c, {p: vars_of(x) for p, x in ph.items()}) for k, (c, ph) in chunked._open.items()
    }
    expected_open = {
        k: (c, {p: vars_of(x) for p, x in ph.items()}) for k, (c, ph) in one_by_one._open.items()
    }
    assert chunked_open == expected_open
    for agg in (one_by_one, chunked):
        agg.end_session(None)
    close(rank_state(chunked), rank_state(one_by_one))


def vars_of(partial: Any) -> tuple[int, int, int, int]:
    return (partial.start_ns, partial.wall_ns, partial.gpu_ns, partial.peak_bytes)


def test_a_long_regular_run_takes_the_array_path() -> None:
    """A plain training loop of 10 000 iterations is decided by the array path (the
    record path would need ~50 000 Python steps): same figures as computed by hand."""
    rng = random.Random(1)
    agg = new_aggregator(
        Settings(warmup_iterations=0, num_measurements=100, train_batch_size=4),
        rng,
        read_sizes=False,  # every batch of the given size
    )
    values = []
    for it in range(10_000):
        start = it * 10_000
        values += [wire.FORWARD, TRAIN, 0, it, it, start, start + 1000 + it % 7, -1, -1, 0, 0]
        values += [wire.TRAINING_LOOP, TRAIN, 0, it, it, start, start + 5000, -1, -1, 1, 0]
    agg.add_records(values)
    forward = agg.series[wire.FORWARD]
    walls = [1000 + it % 7 for it in range(10_000)]
    mean = sum(walls) / len(walls) / 1e9
    assert forward.wall.count == 10_000 and math.isclose(forward.wall.mean, mean)
    assert len(forward.rows) == 100 and agg.stored_iterations[False] == 100
    assert agg.samples[False] == 40_000


def flood(kind: str, steps: int) -> list[int]:
    """Records of ``steps`` repeats of one shape (flat values)."""
    rng = random.Random(0)
    out: list[list[int]] = []
    for it in range(steps):
        t = it * 10_000
        if kind == "outside":
            out.append(record(rng.choice([wire.FORWARD, CUSTOM + 1]), 0, -1, it, t, t + 5, rng))
        elif kind == "cut_short":
            out.append(record(wire.FORWARD, TRAIN, it, it, t, t + 5, rng))
            out.append(
                record(
                    wire.TRAINING_LOOP,
                    TRAIN | wire.FLAG_INCOMPLETE,
                    it,
                    it,
                    t,
                    t + 9,
                    rng,
                    batches=1,
                )
            )
        elif kind == "validation_inside":
            out.append(record(wire.FORWARD, TRAIN, it, it, t, t + 5, rng))
            out.append([wire.VALIDATION, wire.FLAG_BEGIN, 0, -1, it, t, t, -1, -1, 0, 0])
            out += validation(random.Random(it), t + 10, 0)
            out.append([wire.VALIDATION, 0, 0, -1, it, t, t + 9000, -1, -1, 0, 0])
            out.append(record(wire.TRAINING_LOOP, TRAIN, it, it, t, t + 9999, rng, batches=1))
        else:  # a custom phase in every iteration, aligned by the first measured one
            out.append(record(CUSTOM, TRAIN, it, it, t, t + 5, rng))
            out.append(record(wire.TRAINING_LOOP, TRAIN, it, it, t, t + 9, rng, batches=1))
    return [v for r in out for v in r]


@pytest.mark.parametrize("kind", ["outside", "cut_short", "validation_inside", "custom"])
def test_a_flood_of_any_kind_takes_the_array_path(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Floods of each kind in chunks of a message's size: only the few records that open
    a run or align a custom phase go one by one (the record path costs ~2 µs a record)."""
    agg = new_aggregator(Settings(warmup_iterations=3, num_measurements=50), random.Random(0))
    expected = new_aggregator(Settings(warmup_iterations=3, num_measurements=50), random.Random(0))
    values = flood(kind, 5000)
    for record_values in [
        values[i : i + wire.RECORD_WIDTH] for i in range(0, len(values), wire.RECORD_WIDTH)
    ]:
        expected.add_records(record_values)
    one_by_one = 0
    add_one = RankAggregator._add_one

    def counted(self: RankAggregator, values: list[int]) -> None:
        nonlocal one_by_one
        one_by_one += 1
        add_one(self, values)

    monkeypatch.setattr(RankAggregator, "_add_one", counted)
    chunk = 1024 * wire.RECORD_WIDTH
    for at in range(0, len(values), chunk):
        agg.add_records(values[at : at + chunk])
    total = len(values) // wire.RECORD_WIDTH
    spans = 2 * 5000 if kind == "validation_inside" else 0  # begin and end: one by one
    assert one_by_one - spans < total // 100
    close(rank_state(agg), rank_state(expected))


def test_a_readable_batch_size_wins_over_the_given_one() -> None:
    """train_batch_size=64 given; the markers send what the batches tell when it differs:
    a short batch counts its own samples, a batch that cannot tell the given size."""
    sizes = SessionBatchSizes(64, None)
    sizes.note(False, 2, 10)  # iteration 2: a short last batch of 10
    sizes.note(False, 3, None)  # iteration 3 on: batches that cannot tell
    assert sizes.iteration_samples(False, 1, 1) == (64, 64)
    assert sizes.iteration_samples(False, 2, 1) == (10, 10)
    assert sizes.iteration_samples(False, 3, 2) == (64, 128)


@pytest.mark.parametrize("offset", [0, 1 << 20])
def test_moments_are_each_keys_count_mean_and_squared_deviations(offset: int) -> None:
    # Small keys (phase keys) are counted by bincount over the keys, large ones sorted
    # first: both give every key present once, in order, with its own figures.
    rng = random.Random(offset)
    groups = [offset + rng.choice([2, 3, 5, 64, 70]) for _ in range(500)]
    values = [rng.uniform(0.0, 1.0) for _ in groups]
    keys, counts, means, m2 = moments(np.array(groups), np.array(values))
    assert keys.tolist() == sorted(set(groups))
    for key, count, mean, squares in zip(keys, counts, means, m2, strict=True):
        mine = [v for g, v in zip(groups, values, strict=True) if g == key]
        assert count == len(mine)
        assert mean == pytest.approx(sum(mine) / len(mine))
        assert squares == pytest.approx(sum((v - sum(mine) / len(mine)) ** 2 for v in mine))
