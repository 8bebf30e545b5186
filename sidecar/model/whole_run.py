"""A bounded sample of one rank's iterations over the whole run, beside its stored rows
(docs/contract.md, Whole-run sample).

The stored rows are the first ``num_measurements`` measured iterations of each kind: a
long run's middle and end are not among them. So each kind (training, validation) also
keeps a *stride sample* of the measured iterations past the stored ones: every k-th of
them (k = 1 at first), at most ``ITERATIONS`` iterations; when one more would pass that
bound, every other kept iteration is dropped and k doubles. At any time the sample holds
every k-th iteration since the first, k the smallest power of two that fits them in the
bound: between ``ITERATIONS / 2`` and ``ITERATIONS`` iterations spread evenly over the
run, whatever its length. Iterations cut short past the cap of flagged rows are sampled
the same way, up to ``FLAGGED`` of them. An iteration is kept whole: every phase's row
of it (seconds and MiB, as the stored rows).

The counts and strides go into the resume state (``model/state.py``): a resumed run goes
on counting, so its sample stays even over all its sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

ITERATIONS = 512  # training (and, apart, validation) iterations kept at most
FLAGGED = 128  # iterations cut short kept at most
# The rows of one kept iteration: (phase key, its ``series.Row``; the series module holds
# a WholeRun, so this one does not import it back).
Entry = list[tuple[int, Any]]


@dataclass
class Stride:
    """Every ``stride``-th item of a stream, at most ``capacity`` kept: item *n* (the
    ``n``-th offered, from 0) is kept while ``n % stride == 0``."""

    capacity: int
    stride: int = 1
    seen: int = 0  # items offered so far
    kept: dict[int, Entry] = field(default_factory=dict)  # item number -> its rows

    def take(self, count: int) -> dict[int, Entry]:
        """Offer the next ``count`` items; returns, by position among them (0 to
        ``count - 1``), the empty entry of each one kept, for its rows. Work per kept
        item, not per item offered."""
        first, end = self.seen, self.seen + count
        picked: dict[int, Entry] = {}
        number = -(-first // self.stride) * self.stride  # first multiple of the stride
        while number < end:
            if len(self.kept) >= self.capacity:
                self.stride *= 2
                self.kept = {n: e for n, e in self.kept.items() if n % self.stride == 0}
                picked = {p: e for p, e in picked.items() if (first + p) % self.stride == 0}
                number = -(-number // self.stride) * self.stride
                continue
            picked[number - first] = self.kept[number] = []
            number += self.stride
        self.seen = end
        return picked

    def take_one(self) -> Entry | None:
        """Offer one item: its entry when it is kept, else None."""
        return self.take(1).get(0)


@dataclass
class WholeRun:
    """One rank's whole-run sample: a stride per kind of iteration and one for the
    iterations cut short past the flagged rows' cap."""

    training: Stride = field(default_factory=lambda: Stride(ITERATIONS))
    validation: Stride = field(default_factory=lambda: Stride(ITERATIONS))
    flagged: Stride = field(default_factory=lambda: Stride(FLAGGED))
    # the cut iteration whose rows are being offered now: (its key, its entry or None)
    _cut: tuple[tuple[int, int, int, bool], Entry | None] | None = field(
        default=None, init=False, repr=False
    )

    def of_kind(self, validation: bool) -> Stride:
        """The stride of training (False) or validation (True) iterations."""
        return self.validation if validation else self.training

    def pick(self, validation: np.ndarray, offered: np.ndarray) -> dict[int, Entry]:
        """Offer the iterations where ``offered`` (bool per iteration, in order;
        ``validation``: its kind) to their kind's stride; returns the entry of each one
        kept by its index."""
        picked: dict[int, Entry] = {}
        for kind in (False, True):
            indices = np.flatnonzero(offered & (validation == kind)).tolist()
            for position, entry in self.of_kind(kind).take(len(indices)).items():
                picked[indices[position]] = entry
        return picked

    def cut_entry(self, key: tuple[int, int, int, bool]) -> Entry | None:
        """The entry for a row of the cut iteration ``key`` (session, epoch, iteration,
        is validation) past the cap, or None when it is not kept; its phases' rows come
        one after another, so a new key is the next cut iteration."""
        if self._cut is None or self._cut[0] != key:
            self._cut = (key, self.flagged.take_one())
        return self._cut[1]

    def rows(self) -> Entry:
        """Every kept row, with its phase key."""
        return [
            pair
            for stride in (self.training, self.validation, self.flagged)
            for entry in stride.kept.values()
            for pair in entry
        ]
