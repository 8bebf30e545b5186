"""The batch sizes of a session on arrays (``SessionBatchSizes.samples_many``, the array
path's) give what ``iteration_samples`` gives one iteration at a time, on random sizes
read from the batches: in iteration order or not, from a batch inside an iteration or
from its first, readable or not, with or without a size given at the start."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sidecar.model.batch_sizes import UNKNOWN, SessionBatchSizes


def _noted(rng: random.Random, given: int | None, in_order: bool) -> SessionBatchSizes:
    sizes = SessionBatchSizes(given, given)
    iteration = 0
    for _ in range(rng.randint(0, 12)):
        iteration = iteration + rng.choice([0, 0, 1, 2, 5]) if in_order else rng.randrange(0, 40)
        size = rng.choice([None, rng.randint(1, 128)])
        sizes.note(rng.random() < 0.3, iteration, size, rng.choice([0, 0, 1, 2, 3]))
    return sizes


@pytest.mark.parametrize("seed", range(60))
def test_samples_many_is_iteration_samples_of_each(seed: int) -> None:
    rng = random.Random(seed)
    given = rng.choice([None, 32, 64])
    sizes = _noted(rng, given, in_order=seed % 4 != 0)
    for validation in (False, True):
        iterations = np.array([rng.randrange(0, 45) for _ in range(50)], dtype=np.int64)
        batches = np.array([rng.choice([0, 1, 1, 2, 4]) for _ in range(50)], dtype=np.int64)
        got_sizes, got_samples = sizes.samples_many(validation, iterations, batches)
        for n, (iteration, held) in enumerate(
            zip(iterations.tolist(), batches.tolist(), strict=True)
        ):
            size, samples = sizes.iteration_samples(validation, iteration, held)
            assert got_sizes[n] == (UNKNOWN if size is None else size), (iteration, held)
            assert got_samples[n] == (UNKNOWN if samples is None else samples), (iteration, held)


def test_a_size_noted_after_a_lookup_is_seen_by_the_next() -> None:
    """The arrays follow the notes (they are made again after each)."""
    sizes = SessionBatchSizes(64, None)
    its, batches = np.array([1, 2, 3]), np.array([1, 1, 2])
    assert sizes.samples_many(False, its, batches)[1].tolist() == [64, 64, 128]
    sizes.note(False, 2, 10)
    assert sizes.samples_many(False, its, batches)[1].tolist() == [64, 10, 20]
    sizes.note(False, 3, 7, position=1)  # the second batch of iteration 3 held 7
    assert sizes.samples_many(False, its, batches)[1].tolist() == [64, 10, 17]
