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


class SessionBatchSizes:
    """The sizes given in a session's hello (None: not given) and those the markers read
    from its batches, per kind of iteration ("is validation")."""

    def __init__(self, train_batch_size: int | None, val_batch_size: int | None) -> None:
        self._given = {False: train_batch_size, True: val_batch_size}
        # Sizes read from the batches, by "is validation": (first iteration, first batch
        # within it, size or None when the batches could not tell), in order.
        self._read: dict[bool, list[tuple[int, int, int | None]]] = {False: [], True: []}

    def note(self, validation: bool, iteration: int, size: int | None, position: int = 0) -> None:
        """The markers read ``size`` (None: unreadable) from the batches from batch
        ``position`` (0: its first) of ``iteration`` on."""
        self._read[validation].append((iteration, position, size))

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
