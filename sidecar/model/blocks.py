"""Per-iteration sums of a run of ordinary iteration records, on arrays.

The aggregator's record-by-record path (``RankAggregator._add_one``) defines the
semantics; this module computes the same per-iteration, per-phase sums for the shape
nearly every record has: records inside iterations, each iteration's records together
and closed by its loop record. ``split_blocks`` refuses (returns None) any run it cannot
do exactly that way, and the aggregator then takes it record by record. An iteration
still open between the two paths is held as ``Partial`` sums per phase.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from markers import wire
from markers.wire import P_END, P_FLAGS, P_GPU, P_ITERATION, P_PEAK, P_PHASE, P_START

# A key packs (iteration, is validation); iterations outside this range take the slow path.
MAX_ITERATION = 2**61


@dataclass(frozen=True)
class Blocks:
    """The iterations (blocks) of a run of records and their per-phase sums (groups).

    Per block: ``last`` (row of its last record, the loop record when ``closed``),
    ``first`` (row of its first record), ``validation`` (a validation iteration). Per
    group (one phase of one block): ``block``, ``phase``, ``start_ns`` (its first
    record's start), ``wall_ns`` (sum), ``gpu_ns`` (sum of the measured ones, -1 when
    none), ``peak_bytes`` (max, -1 when none), ``order`` (row of its first record: the
    order the phases came in).
    """

    first: np.ndarray
    last: np.ndarray
    closed: np.ndarray
    validation: np.ndarray
    block: np.ndarray
    phase: np.ndarray
    start_ns: np.ndarray
    wall_ns: np.ndarray
    gpu_ns: np.ndarray
    peak_bytes: np.ndarray
    order: np.ndarray

    def sums(self, groups: np.ndarray, *leading: np.ndarray) -> Iterator[tuple[int, ...]]:
        """Per group of ``groups`` (indices, in that order): its values of the per-group
        arrays ``leading``, then its ``start_ns``, ``wall_ns``, ``gpu_ns`` and
        ``peak_bytes``, as Python ints."""
        columns = (*leading, self.start_ns, self.wall_ns, self.gpu_ns, self.peak_bytes)
        return zip(*(column[groups].tolist() for column in columns), strict=True)


def is_validation(records: np.ndarray) -> np.ndarray:
    """Per record: recorded during validation."""
    return (records[:, P_FLAGS] & wire.FLAG_VALIDATION) != 0


def closes(records: np.ndarray, validation: np.ndarray) -> np.ndarray:
    """Per record: the loop record of its kind (``validation``: per record, recorded
    during validation), which closes its iteration."""
    return records[:, P_PHASE] == np.where(validation, wire.VALIDATION_LOOP, wire.TRAINING_LOOP)


def split_blocks(records: np.ndarray, validation: np.ndarray) -> Blocks | None:
    """The blocks and groups of ``records`` (in-iteration records, no Epoch/Validation
    span; a loop record flagged incomplete closes its block too); None when an
    iteration's records are not together (another iteration's records come before its
    loop record) or an iteration number is out of range. ``validation``:
    ``is_validation(records)``."""
    iteration = records[:, P_ITERATION]
    if iteration.min() < 0 or iteration.max() >= MAX_ITERATION:
        return None
    key = iteration * 2 + validation
    loop = closes(records, validation)
    changed = key[1:] != key[:-1]
    if np.any(changed & ~loop[:-1]):
        return None  # interleaved iterations: the record-by-record path decides cuts
    begins = np.empty(len(records), dtype=bool)
    begins[0] = True
    begins[1:] = changed | loop[:-1]
    first = np.flatnonzero(begins)
    last = np.append(first[1:] - 1, len(records) - 1)
    # Counted in int32: numpy's cumsum of a mask into int64 takes a cast path ~10x slower.
    block = np.cumsum(begins, dtype=np.int32) - 1
    phase = records[:, P_PHASE]
    group_key = np.multiply(block, int(phase.max()) + 1, dtype=np.int64) + phase
    order = np.argsort(group_key, kind="stable")
    sorted_key = group_key[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_key[1:] != sorted_key[:-1])))
    wall_ns = records[:, P_END] - records[:, P_START]
    if len(starts) == len(records):
        # One record a group, the usual shape (each phase once an iteration): nothing to
        # sum, and "not measured" is any negative value, as the sums below read it.
        rows = order
        gpu_ns = np.maximum(records[rows, P_GPU], -1)
        group_wall_ns = wall_ns[rows]
        peak_bytes = np.maximum(records[rows, P_PEAK], -1)
    else:
        rows = order[starts]
        # Only the columns summed are gathered in group order (a whole record is 11 values).
        gpu = records[order, P_GPU]
        measured = gpu >= 0
        gpu_sum = np.add.reduceat(np.where(measured, gpu, 0), starts)
        gpu_count = np.add.reduceat(measured.astype(np.int64), starts)
        gpu_ns = np.where(gpu_count > 0, gpu_sum, -1)
        group_wall_ns = np.add.reduceat(wall_ns[order], starts)
        peak_bytes = np.maximum(np.maximum.reduceat(records[order, P_PEAK], starts), -1)
    return Blocks(
        first=first,
        last=last,
        closed=loop[last],
        validation=validation[last],
        block=block[rows],
        phase=phase[rows],
        start_ns=records[rows, P_START],
        wall_ns=group_wall_ns,
        gpu_ns=gpu_ns,
        peak_bytes=peak_bytes,
        order=rows,
    )


# Keys below this are counted with one bincount over the keys themselves (phase keys are
# small: np.unique's sort cost ~25x as much on a read's groups); larger ones are sorted.
_BINCOUNT_KEYS = 1 << 16


def moments(
    groups: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct value of ``groups`` (non-negative ints: phase keys): (that value,
    count, mean, sum of squared deviations) of ``values`` (the parts of a streaming mean
    and variance to merge)."""
    keys = None  # None: the groups index the counts themselves
    index = groups
    if groups.max() >= _BINCOUNT_KEYS:
        keys, index = np.unique(groups, return_inverse=True)
    counts = np.bincount(index)
    means = np.bincount(index, values) / np.maximum(counts, 1)
    m2 = np.bincount(index, (values - means[index]) ** 2, minlength=len(counts))
    present = np.flatnonzero(counts)
    keys = present if keys is None else keys[present]
    return keys, counts[present], means[present], m2[present]


class Partial:
    """Sums of one phase within an open iteration (``__slots__``: many are made)."""

    __slots__ = ("gpu_ns", "peak_bytes", "start_ns", "wall_ns")

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.wall_ns = 0
        self.gpu_ns = -1
        self.peak_bytes = -1

    def add(self, start_ns: int, end_ns: int, gpu_ns: int, peak_bytes: int) -> None:
        """Add one record of the phase: its span (ns), GPU time (ns) and peak (bytes),
        -1 where not measured."""
        self.wall_ns += end_ns - start_ns
        if gpu_ns >= 0:
            self.gpu_ns = gpu_ns + max(self.gpu_ns, 0)
        self.peak_bytes = max(self.peak_bytes, peak_bytes)


def partial_records(context: list[int], partials: dict[int, Partial]) -> np.ndarray:
    """An open iteration's sums so far as records (one per phase) that sum to the same
    figures: the array path continues an iteration the record path left open."""
    out = np.zeros((len(partials), wire.RECORD_WIDTH), dtype=np.int64)
    for row, (phase, partial) in zip(out, partials.items(), strict=True):
        row[[P_PHASE, P_FLAGS, wire.P_EPOCH, P_ITERATION, wire.P_BATCH]] = (
            phase,
            context[P_FLAGS],
            context[wire.P_EPOCH],
            context[P_ITERATION],
            context[wire.P_BATCH],
        )
        row[[P_START, P_END, P_GPU, P_PEAK]] = (
            partial.start_ns,
            partial.start_ns + partial.wall_ns,
            partial.gpu_ns,
            partial.peak_bytes,
        )
    return out
