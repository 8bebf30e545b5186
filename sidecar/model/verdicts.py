"""The rule that decides a closed iteration: measured (past warmup) or not, stored (while
fewer than ``num_measurements`` of its kind are) or not, its batches, batch size and
samples. In two forms side by side, held equal by a test: ``decide_one``, which the
aggregator's record path calls per iteration, and ``decide``, on arrays, which its array
path calls once per read for all the iterations it closes (a Python call per iteration
there cost ~6 µs, more than the rest of the ingest; a few array operations per read on a
single iteration cost the record path as much again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from markers.wire import P_BATCH, P_BATCHES, P_ITERATION
from sidecar.model.batch_sizes import UNKNOWN, SessionBatchSizes

# What the rule says of one closed iteration: None (warmup), else (rows stored, batches,
# batch size or None, samples or None).
Verdict = tuple[bool, int, int | None, int | None] | None


@dataclass(frozen=True)
class Verdicts:
    """The rule's word on closed iterations, per iteration in order: ``measured`` (False:
    left out by warmup), ``stored``, ``batches``, ``sizes`` and ``samples`` (``UNKNOWN``
    where not known)."""

    measured: np.ndarray
    stored: np.ndarray
    batches: np.ndarray
    sizes: np.ndarray
    samples: np.ndarray

    def some(self, indices: np.ndarray) -> list[Verdict]:
        """The verdicts of the iterations ``indices`` as Python values (converted together:
        a stored row each may be asked for)."""
        columns = (self.measured, self.stored, self.batches, self.sizes, self.samples)
        return [
            (store, batches, None if size == UNKNOWN else size, None if n == UNKNOWN else n)
            if measured
            else None
            for measured, store, batches, size, n in zip(
                *(column[indices].tolist() for column in columns), strict=True
            )
        ]


def decide_one(
    validation: bool,
    loop: list[int],
    *,
    warmup_iterations: int,
    num_measurements: int,
    accumulation_steps: int,
    stored_iterations: dict[bool, int],
    samples: dict[bool, int | None],
    batch_sizes: SessionBatchSizes,
) -> Verdict:
    """The rule of the one iteration closed by the loop record ``loop`` (``decide`` on
    one iteration, with Python values)."""
    if loop[P_BATCH] < warmup_iterations:
        return None
    # A loop record without a count (primitives driven without ``batch_done``): a whole
    # step.
    batches = loop[P_BATCHES] or (1 if validation else accumulation_steps)
    size, held = batch_sizes.iteration_samples(validation, loop[P_ITERATION], batches)
    if held is not None:
        samples[validation] = (samples[validation] or 0) + held
    store = stored_iterations[validation] < num_measurements
    if store:
        stored_iterations[validation] += 1
    return store, batches, size, held


def decide(
    validation: np.ndarray,
    loops: np.ndarray,
    *,
    warmup_iterations: int,
    num_measurements: int,
    accumulation_steps: int,
    stored_iterations: dict[bool, int],
    samples: dict[bool, int | None],
    batch_sizes: SessionBatchSizes,
) -> Verdicts:
    """Decide the iterations closed by the loop records ``loops`` (records × width, in
    the order they closed; ``validation``: per loop record, a validation one) under the
    run's settings, the rank's session ``batch_sizes``. Counts the stored ones in
    ``stored_iterations`` and adds the samples of the measured ones to ``samples`` (both
    by "is validation"; samples None until one size is known)."""
    if not len(loops):
        return Verdicts(*(np.zeros(0, dtype=dtype) for dtype in (bool, bool, int, int, int)))
    measured = loops[:, P_BATCH] >= warmup_iterations
    batches = np.where(
        loops[:, P_BATCHES] != 0, loops[:, P_BATCHES], np.where(validation, 1, accumulation_steps)
    )
    sizes = np.full(len(loops), UNKNOWN, dtype=np.int64)
    held = np.full(len(loops), UNKNOWN, dtype=np.int64)
    stored = np.zeros(len(loops), dtype=bool)
    # One kind of iteration in all but a read that holds both (the record path's one).
    kinds = (bool(validation[0]),) if validation.all() or not validation.any() else (False, True)
    for kind in kinds:
        at = np.flatnonzero(measured & (validation == kind))
        if not len(at):
            continue
        sizes[at], held[at] = batch_sizes.samples_many(kind, loops[at, P_ITERATION], batches[at])
        known = held[at][held[at] != UNKNOWN]
        if len(known):
            samples[kind] = (samples[kind] or 0) + int(known.sum())
        room = max(num_measurements - stored_iterations[kind], 0)
        stored[at[:room]] = True
        stored_iterations[kind] += min(room, len(at))
    return Verdicts(measured, stored, batches, sizes, held)
