"""The rule that decides closed iterations, on arrays: which are measured (past warmup),
which stored (while fewer than ``num_measurements`` of their kind are), their batches,
batch sizes and samples. The aggregator's record path and array path both decide through
``decide``, the record path one iteration at a time, the array path a whole read's
iterations at once (its cost per iteration is then a few array operations' share, not a
Python call)."""

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

    def of(self, index: int) -> Verdict:
        """The verdict of iteration ``index`` as Python values."""
        if not self.measured[index]:
            return None
        size, samples = int(self.sizes[index]), int(self.samples[index])
        return (
            bool(self.stored[index]),
            int(self.batches[index]),
            None if size == UNKNOWN else size,
            None if samples == UNKNOWN else samples,
        )


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
    measured = loops[:, P_BATCH] >= warmup_iterations
    # A loop record without a count (primitives driven without ``batch_done``): a whole
    # step.
    batches = np.where(
        loops[:, P_BATCHES] != 0, loops[:, P_BATCHES], np.where(validation, 1, accumulation_steps)
    )
    sizes = np.full(len(loops), UNKNOWN, dtype=np.int64)
    held = np.full(len(loops), UNKNOWN, dtype=np.int64)
    stored = np.zeros(len(loops), dtype=bool)
    for kind in (False, True):
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
