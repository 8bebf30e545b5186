"""Synthetic but well-formed records for the sidecar benchmarks: training iterations of
five phases each (data loading, forward, backward, optimization, loop), as the markers'
``train_batches`` loop sends them."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from markers import wire

STEP_NS = 600_000  # one MLP step
PHASES = (
    (wire.TRAINING_DATA_LOADING, 0, 50_000),
    (wire.FORWARD, 50_000, 250_000),
    (wire.BACKWARD, 250_000, 500_000),
    (wire.OPTIMIZATION, 500_000, 590_000),
    (wire.TRAINING_LOOP, 0, 600_000),
)
RECORDS_PER_ITERATION = len(PHASES)


def iteration_slots(iteration: int, epoch: int = 0) -> list[int]:
    """The wire slots of one training iteration (a context slot, then five phase slots)."""
    base = 1_000_000_000 + iteration * STEP_NS
    slots = list(wire.context_slot(wire.FLAG_IN_ITERATION, epoch, iteration, iteration))
    for phase, start, end in PHASES:
        slots += (phase, base + start, base + end)
    return slots


def decoded(slots: list[int]) -> array:
    """The decoded records of ``slots`` (as the sidecar's receiver hands them on)."""
    frame = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, bytes(16)) + array("q", slots).tobytes()
    return wire.decode_records(frame)


def training_records(
    iterations: int, per_message: int = wire.FLUSH_SLOTS, first: int = 0
) -> Iterator[array]:
    """Decoded records of ``iterations`` iterations numbered from ``first``, about
    ``per_message`` per batch."""
    per = max(1, per_message // RECORDS_PER_ITERATION)
    end = first + iterations
    for begin in range(first, end, per):
        slots: list[int] = []
        for i in range(begin, min(begin + per, end)):
            slots += iteration_slots(i)
        yield decoded(slots)
