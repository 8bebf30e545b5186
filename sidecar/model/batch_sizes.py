"""The batch sizes of one rank's session, and so the samples each iteration held.

A stored loop row keeps the batch size of its iteration (``Row.batch_size``: of its first
batch) and the samples it held (``Row.samples``): the sum of the sizes the markers read
from its batches (each applies from the batch it was read at on), a batch that cannot
tell counting the size given at the start of its session (a readable size wins, so a
short last batch counts what it holds). Throughput sums the rows'
samples, so a size that changes (across a resume, a short last batch, or one inside a
step of ``accumulation_steps`` batches) counts right.
"""

from __future__ import annotations

import numpy as np

UNKNOWN = -1  # a batch size or a sample count not known, in ``samples_many``'s arrays


class SessionBatchSizes:
    """The sizes given in a session's hello (None: not given) and those the markers read
    from its batches, per kind of iteration ("is validation")."""

    def __init__(self, train_batch_size: int | None, val_batch_size: int | None) -> None:
        self._given = {False: train_batch_size, True: val_batch_size}
        # Sizes read from the batches, by "is validation": (first iteration, first batch
        # within it, size or None when the batches could not tell), in order.
        self._read: dict[bool, list[tuple[int, int, int | None]]] = {False: [], True: []}
        # ``_read`` as arrays for ``samples_many`` (firsts, sizes, firsts of the sizes read
        # inside an iteration), made on first use after a note
        self._arrays: dict[bool, tuple[np.ndarray, np.ndarray, np.ndarray] | None] = {}

    def note(self, validation: bool, iteration: int, size: int | None, position: int = 0) -> None:
        """The markers read ``size`` (None: unreadable) from the batches from batch
        ``position`` (0: its first) of ``iteration`` on."""
        self._read[validation].append((iteration, position, size))
        self._arrays.pop(validation, None)

    def iteration_samples(
        self, validation: bool, iteration: int, batches: int
    ) -> tuple[int | None, int | None]:
        """``(batch size, samples)`` of ``iteration``, which held ``batches`` batches: the
        size of its first batch and the sum of its batches' sizes. As read from the
        batches, a batch that cannot tell having the size given at the session's start;
        None when unknown (samples: when any of its batches' is)."""
        given = self._given[validation]
        size = given  # the size from before ``iteration`` (or from its first batch) on
        inside: list[tuple[int, int | None]] = []  # (position, size) read within it
        for first, position, read in self._read[validation]:
            read = given if read is None else read
            if first > iteration:
                break
            if first < iteration or not position:
                size = read
            else:
                inside.append((position, read))
        first_size, samples, done = size, 0, 0
        for position, read in [*inside, (batches, None)]:
            position = min(position, batches)
            if position > done:  # batches ``done`` .. ``position`` - 1 held ``size`` each
                if size is None:
                    return first_size, None
                samples += size * (position - done)
                done = position
            size = read
        return first_size, samples

    def samples_many(
        self, validation: bool, iterations: np.ndarray, batches: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``iteration_samples`` of many iterations at once (int64 arrays of iteration
        numbers and batches held): their batch sizes and samples, ``UNKNOWN`` for None.

        Array work for the iterations no size was read inside of (the size of each is the
        last read from before it on); ``iteration_samples`` for the others, and for all when
        the sizes were not read in iteration order.
        """
        arrays = self._read_arrays(validation)
        if arrays is None:  # out of order: as ``iteration_samples`` walks them
            pairs = [
                self.iteration_samples(validation, iteration, held)
                for iteration, held in zip(iterations.tolist(), batches.tolist(), strict=True)
            ]
            return (
                np.array([UNKNOWN if s is None else s for s, _ in pairs], dtype=np.int64),
                np.array([UNKNOWN if n is None else n for _, n in pairs], dtype=np.int64),
            )
        given = self._given[validation]
        sizes = np.full(len(iterations), UNKNOWN if given is None else given, dtype=np.int64)
        firsts, read, inside = arrays
        if len(firsts):
            last = np.searchsorted(firsts, iterations, side="right") - 1
            sizes = np.where(last >= 0, read[np.maximum(last, 0)], sizes)
        # no batch held: no samples, whatever the size
        samples = np.where(batches > 0, np.where(sizes == UNKNOWN, UNKNOWN, sizes * batches), 0)
        if len(inside):
            for at in np.flatnonzero(np.isin(iterations, inside)).tolist():
                size, held = self.iteration_samples(
                    validation, int(iterations[at]), int(batches[at])
                )
                sizes[at] = UNKNOWN if size is None else size
                samples[at] = UNKNOWN if held is None else held
        return sizes, samples

    def _read_arrays(self, validation: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The sizes read, as arrays: (first iterations, sizes with the given one for an
        unreadable one or ``UNKNOWN``, iterations a size was read inside of); None when
        they were not read in iteration order."""
        if validation not in self._arrays:
            read = self._read[validation]
            given = self._given[validation]
            firsts = np.array([first for first, _, _ in read], dtype=np.int64)
            values = [given if size is None else size for _, _, size in read]
            self._arrays[validation] = (
                None
                if np.any(firsts[1:] < firsts[:-1])
                else (
                    firsts,
                    np.array([UNKNOWN if v is None else v for v in values], dtype=np.int64),
                    np.array([first for first, position, _ in read if position], dtype=np.int64),
                )
            )
        return self._arrays[validation]
