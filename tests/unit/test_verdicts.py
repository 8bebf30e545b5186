"""The rule of a closed iteration in its two forms: ``decide`` on arrays (the array path's,
a read's iterations at once) says of every iteration what ``decide_one`` (the record
path's) says one iteration at a time, and counts the same stored iterations and samples;
random settings, kinds, warmup, caps, batches and batch sizes, reads of random sizes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from markers import wire
from sidecar.model.batch_sizes import SessionBatchSizes
from sidecar.model.verdicts import decide, decide_one


def _loop(rng: random.Random, iteration: int, validation: bool) -> list[int]:
    record = [0] * wire.RECORD_WIDTH
    record[wire.P_PHASE] = wire.VALIDATION_LOOP if validation else wire.TRAINING_LOOP
    record[wire.P_FLAGS] = wire.FLAG_IN_ITERATION | (wire.FLAG_VALIDATION if validation else 0)
    record[wire.P_ITERATION] = iteration
    record[wire.P_BATCH] = iteration + rng.choice([0, 0, 1])  # batches before it
    record[wire.P_BATCHES] = rng.choice([0, 0, 1, 2, 3])  # 0: a whole step
    return record


def _state(rng: random.Random) -> dict[str, Any]:
    given = rng.choice([None, 16, 64])
    sizes = SessionBatchSizes(given, rng.choice([None, 8]))
    for _ in range(rng.randint(0, 6)):
        sizes.note(rng.random() < 0.3, rng.randrange(0, 60), rng.choice([None, 5, 64]),
                   rng.choice([0, 0, 1, 2]))  # fmt: skip
    return {
        "warmup_iterations": rng.choice([0, 3, 10]),
        "num_measurements": rng.choice([1, 5, 40, 1000]),
        "accumulation_steps": rng.choice([1, 4]),
        "stored_iterations": {False: rng.choice([0, 3]), True: 0},
        "samples": {False: rng.choice([None, 100]), True: None},
        "batch_sizes": sizes,
    }


@pytest.mark.parametrize("seed", range(40))
def test_decide_on_arrays_is_decide_one_per_iteration(seed: int) -> None:
    rng = random.Random(seed)
    one, many = _state(rng), _state(random.Random(seed))  # the same state twice
    loops = [_loop(rng, it, rng.random() < 0.2) for it in range(rng.randint(1, 80))]
    validation = [bool(loop[wire.P_FLAGS] & wire.FLAG_VALIDATION) for loop in loops]
    expected = [decide_one(v, loop, **one) for v, loop in zip(validation, loops, strict=True)]
    got = []
    at = 0
    while at < len(loops):  # in reads of random sizes, one iteration included
        size = rng.choice([1, 2, 7, 30])
        verdicts = decide(
            np.array(validation[at : at + size]), np.array(loops[at : at + size]), **many
        )
        got += verdicts.some(np.arange(len(verdicts.measured)))
        at += size
    assert got == expected
    assert many["stored_iterations"] == one["stored_iterations"]
    assert many["samples"] == one["samples"]


def test_no_iteration_is_no_verdict() -> None:
    state = _state(random.Random(0))
    verdicts = decide(np.zeros(0, dtype=bool), np.zeros((0, wire.RECORD_WIDTH)), **state)
    assert len(verdicts.measured) == 0
