"""The state one rank's aggregation keeps (``RankAggregator``, model/aggregator.py,
builds on it): the run's settings, its open iterations and spans, the counts the rule
of a closed iteration reads (warmup, cap, batch sizes), and that rule called on one
iteration or on arrays (``model/verdicts.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from markers import hello
from sidecar.model.batch_sizes import SessionBatchSizes
from sidecar.model.blocks import Partial
from sidecar.model.series import Row, SeriesStore
from sidecar.model.verdicts import Verdict, Verdicts, decide, decide_one


@dataclass(frozen=True)
class Settings:
    """What a run told the sidecar about itself in its hello (defaults: ``markers.hello``)."""

    warmup_iterations: int = hello.FIELDS["warmup_iterations"].default
    num_measurements: int = hello.FIELDS["num_measurements"].default
    train_batch_size: int | None = hello.FIELDS["train_batch_size"].default
    val_batch_size: int | None = hello.FIELDS["val_batch_size"].default
    accumulation_steps: int = hello.FIELDS["accumulation_steps"].default


class AggregatorState(SeriesStore):
    """Aggregation state of one (run folder, split, rank), which the record and array
    paths share."""

    def __init__(self, rank: int, settings: Settings, run_start_unix: float) -> None:
        super().__init__(settings.num_measurements, run_start_unix)
        self.rank = rank
        self.settings = settings
        self.stored_iterations = {False: 0, True: 0}  # keyed by "is validation"
        # Samples of every measured iteration of known batch size (past the cap too), by
        # "is validation"; None until one size is known.
        self.samples: dict[bool, int | None] = {False: None, True: None}
        self.gpu_not_measured = 0  # phases whose GPU time the markers could not take
        # the latest training epoch and iteration seen (live view only; -1: none yet)
        self.epoch = self.iteration = -1
        # Open iterations: their phases' sums and the context record of each.
        self._open: dict[tuple[bool, int], tuple[list[int], dict[int, Partial]]] = {}
        self._spans: dict[int, list[int]] = {}  # Epoch/Validation begun, not ended: begin record
        # (phase, epoch) of the spans open at the checkpoint this aggregator resumed from,
        # with the row of their first part: their end in this session closes their second
        # part, and both make one measurement.
        self.continued: dict[tuple[int, int], Row] = {}
        self._standalone_seen: dict[int, int] = {}
        self._batch_sizes = self._new_batch_sizes()  # of the current session

    def _new_batch_sizes(self) -> SessionBatchSizes:
        return SessionBatchSizes(self.settings.train_batch_size, self.settings.val_batch_size)

    def note_batch_size(
        self, validation: bool, iteration: int, size: int | None, position: int = 0
    ) -> None:
        """The markers read ``size`` (None: unreadable) from the batches of this session
        from batch ``position`` (0: its first) of ``iteration`` on."""
        self._batch_sizes.note(validation, iteration, size, position)

    def _decide(self, validation: bool, loop_record: list[int]) -> Verdict:
        """The rule of the iteration ``loop_record`` closes (``verdicts.decide_one``; the
        array path's ``_decide_many`` is its form on arrays): left out by warmup (None),
        else whether its rows are stored (while fewer than ``num_measurements`` of its kind
        are), its batches and its batch size and samples. Counts it as stored and adds its
        samples."""
        return decide_one(validation, loop_record, **self._rule_state())

    def _decide_many(self, validation: np.ndarray, loops: np.ndarray) -> Verdicts:
        """``_decide`` of the iterations closed by ``loops`` (records × width, in order;
        ``validation`` per loop), on arrays (``verdicts.decide``)."""
        return decide(validation, loops, **self._rule_state())

    def _rule_state(self) -> dict[str, Any]:
        """What the rule of a closed iteration reads and counts in."""
        return {
            "warmup_iterations": self.settings.warmup_iterations,
            "num_measurements": self.settings.num_measurements,
            "accumulation_steps": self.settings.accumulation_steps,
            "stored_iterations": self.stored_iterations,
            "samples": self.samples,
            "batch_sizes": self._batch_sizes,
        }
