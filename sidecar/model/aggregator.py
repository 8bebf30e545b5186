"""Turns one rank's ordered phase records into stored measurements and streaming figures.

Semantics (docs/contract.md, Semantics, docs/iteration-model.md):

* Records flagged ``FLAG_IN_ITERATION`` belong to one training or validation iteration
  (an optimization step spans ``accumulation_steps`` batches). Their times are summed per
  phase (GPU peak: the max) and the iteration is decided whole when its loop record
  (``Training loop`` / ``Validation loop``) arrives: measured when the batches that went
  through the network before it began reach ``warmup_iterations`` (so row *i* of
  Forward, Backward and Optimization is the same iteration), stored while fewer than
  ``num_measurements`` iterations of that kind are stored in the split (across resumes).
  The loop record carries the batches the iteration really held (throughput counts them).
* A loop record flagged ``FLAG_INCOMPLETE`` (an iteration cut short), an iteration whose
  loop record never comes (a later one of its kind closed first, or its process ended)
  and an Epoch or Validation cut short (flagged, or begun and never ended) are kept as
  *flagged* rows (phases.tsv only, ``incomplete``): never a measurement.
* A standard phase outside any iteration is a flagged row (``outside``): it never enters
  the iteration-aligned columns. A custom phase outside any iteration is its own
  measurement (warmup counts its occurrences in the process) in its own column — until
  the phase is measured inside an iteration: its column is then iteration-aligned and
  its outside rows become flagged rows.
* An Epoch or Validation open at the checkpoint a session resumed from is one
  measurement: its part up to the checkpoint plus its part in the resumed session (both
  kept as flagged rows, ``part``), the time between the sessions left out.
* Epoch and Validation are never warmed up nor capped. Training is derived from the
  sessions: one value per split, resumed time added up.
* Every measured value also feeds a streaming count/mean/std, past the cap. Flagged
  rows are kept up to ``num_measurements`` per phase.
* A stored loop row keeps the batch size of its iteration and the samples it held
  (``model/batch_sizes.py``).

A closed iteration is decided by one rule (``model/verdicts.py``), in order: the record
path calls its per-iteration form, the array path (``model/blocks.py``) its form on arrays
once per read for all the iterations it closes; a test holds the two forms equal.
One state machine whose two paths share its private state (open iterations, counters),
kept in one class built in layers, each its own module: ``model/aggregator_state.py``
(the state and the rule's calls), ``model/spans.py`` (Epoch and Validation spans),
``model/array_path.py`` (the array path) and this one (records in, the record path,
and which runs go which way). It is built on the rank's sessions and their clocks
(``model/session_clock.py``) and on the phases' stored rows (``model/series.py``); the
batch sizes are ``model/batch_sizes.py``'s; its state file is ``model/state.py``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from markers import wire
from markers.wire import (
    P_BATCHES,
    P_END,
    P_EPOCH,
    P_FLAGS,
    P_GPU,
    P_ITERATION,
    P_PEAK,
    P_PHASE,
    P_START,
)
from sidecar.model import goodput
from sidecar.model.aggregator_state import Settings
from sidecar.model.array_path import ArrayPath
from sidecar.model.blocks import Partial, is_validation
from sidecar.model.series import INCOMPLETE, OUTSIDE

__all__ = ["LOOP_PHASES", "MIN_ARRAY_RECORDS", "RankAggregator", "RecordValues", "Settings"]

UNCAPPED = frozenset({wire.EPOCH, wire.VALIDATION})
RecordValues = np.ndarray | array | Sequence[int]
LOOP_PHASES = wire.LOOP_ID
# Runs of ordinary iteration records shorter than this go record by record: the array
# path costs a fixed ~0.1 ms however few records it takes.
MIN_ARRAY_RECORDS = 64
# Kinds of records (``RankAggregator._kinds``): runs of one kind are taken together.
_INSIDE, _OUTSIDE, _OTHER = 0, 1, 2
# The flags that tell a training iteration's record (in an iteration, not validation).
_ITERATION_KIND = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION


# The phases whose allocator peak makes a step's peak (aggregate_resource_usage.csv's
# MemAllocated_GB).
PEAK_PHASES = tuple(p.phase for p in wire.STEP_PHASES if p.gpu)


class RankAggregator(ArrayPath):
    """Aggregation of one (run folder, split, rank): its records in, by the record or
    the array path."""

    def step_peaks_mib(self) -> list[float]:
        """Per stored training step (session, iteration, in that order), the highest
        allocator peak of its Forward, Backward and Optimization rows, MiB; [] without any
        peak (no GPU)."""
        peaks: dict[tuple[int, int], float] = {}
        for phase in PEAK_PHASES:
            series = self.series.get(phase)
            for row in series.rows if series is not None else ():
                if row.peak_mib is not None:
                    key = (row.session, row.iteration)
                    peaks[key] = max(peaks.get(key, row.peak_mib), row.peak_mib)
        return [peak for _, peak in sorted(peaks.items())]

    # -- sessions -------------------------------------------------------------------

    def begin_session(self, start_unix: float, start_ns: int, run_id: str = "") -> int:
        """Start a process session (after ``load_state`` when resuming); returns its number.

        Warmup counting restarts: a new process runs on a cold GPU.
        """
        number = super().begin_session(start_unix, start_ns, run_id)
        self._open.clear()
        self._spans.clear()
        self._standalone_seen.clear()
        self._batch_sizes = self._new_batch_sizes()
        return number

    def end_session(self, end_ns: int | None) -> None:
        """Close the current session at ``end_ns`` (or its last record when unknown).
        Iterations, epochs and validation passes still open were cut short (the process
        ended inside them): kept as flagged rows, up to the session's last record."""
        if not self.sessions:
            return
        super().end_session(end_ns)
        for key in list(self._open):
            self._cut_iteration(key)
        for phase, begin in self._spans.items():
            self._flag(phase, begin, self._open_span_ns(begin), -1, -1, INCOMPLETE)
        self._spans.clear()

    # -- records --------------------------------------------------------------------

    def add_records(self, values: RecordValues) -> None:
        """Aggregate decoded records (``wire.RECORD_WIDTH`` int64 values per record: a
        records × width array, or flat values).

        The caller has checked the records and mapped custom phase ids to ``custom_key``.
        Runs of iteration records go through ``_add_iterations`` (arrays, the work per
        iteration), runs of records outside iterations through ``_add_outside_run``
        (arrays, the work per stored row), Epoch/Validation spans and short runs record
        by record (``_add_one``); every path gives the same result.
        """
        records = np.asarray(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)
        if not len(records):
            return
        session = self.sessions[-1]
        session.last_ns = max(session.last_ns, int(records[:, P_END].max()))
        # Maxima over the masked columns, without copying the records they mask.
        training = (records[:, P_FLAGS] & wire.FLAG_VALIDATION) == 0
        # The epoch shown is the last that ran: records outside an epoch (after its end,
        # the run's own span at the end) already carry the next epoch's number.
        ran = training & (
            ((records[:, P_FLAGS] & wire.FLAG_IN_ITERATION) != 0)
            | (records[:, P_PHASE] == wire.EPOCH)
        )
        self.epoch = int(records[:, P_EPOCH].max(where=ran, initial=self.epoch))
        self.iteration = int(records[:, P_ITERATION].max(where=training, initial=self.iteration))
        stepping = (records[:, P_FLAGS] & _ITERATION_KIND) == wire.FLAG_IN_ITERATION
        session.steps = int(
            records[:, P_ITERATION].max(where=stepping, initial=session.steps - 1) + 1
        )
        self.gpu_not_measured += int(np.count_nonzero(records[:, P_FLAGS] & wire.FLAG_GPU_DROPPED))
        counters = self.goodput[-1]
        if counters is not None:
            goodput.count(
                counters,
                records,
                self.settings.warmup_iterations,
                [
                    key
                    for key, name in self.custom_names.items()
                    if name.lower() in goodput.CHECKPOINT_NAMES
                ],
            )
        span = (records[:, P_PHASE] == wire.EPOCH) | (records[:, P_PHASE] == wire.VALIDATION)
        if span.any():
            # An Epoch/Validation record touches only its own series and begun span, so it
            # commutes with the others: taken apart, it does not cut their runs.
            for record in records[span].tolist():
                self._add_span(record[P_PHASE], record, record[P_FLAGS])
            records = records[~span]
            if not len(records):
                return
        while len(records):
            records = self._add_runs(records)

    def _add_runs(self, records: np.ndarray) -> np.ndarray:
        """Aggregate ``records`` run by run, each run of one kind (``_kinds``); returns the
        records not taken yet (none, or those after a run that aligned a custom phase: their
        kinds are to be read again)."""
        kinds = self._kinds(records)
        bounds = [0, *(np.flatnonzero(kinds[1:] != kinds[:-1]) + 1).tolist(), len(records)]
        for low, high in pairwise(bounds):
            run, kind = records[low:high], kinds[low]
            if high - low < MIN_ARRAY_RECORDS or kind == _OTHER:
                aligned = len(self.aligned_custom)
                self._one_by_one(run)
                if len(self.aligned_custom) != aligned:
                    return records[high:]
            elif kind == _OUTSIDE:
                self._add_outside_run(run)
            elif not self._add_iterations(run):
                self._add_kinds_apart(run)
        return records[len(records) :]

    def _kinds(self, records: np.ndarray) -> np.ndarray:
        """Per record (none an Epoch/Validation span): ``_INSIDE`` (inside an iteration, of
        a standard phase or an iteration-aligned custom one), ``_OUTSIDE`` (outside any
        iteration) or ``_OTHER`` (a custom phase inside an iteration, not aligned yet: its
        first measured iteration aligns it, which the record path decides)."""
        flags, phase = records[:, P_FLAGS], records[:, P_PHASE]
        inside = (flags & wire.FLAG_IN_ITERATION) != 0
        kinds = np.where(inside, _INSIDE, _OUTSIDE).astype(np.int8)
        unaligned = inside & (phase >= wire.FIRST_CUSTOM_ID)
        if unaligned.any():
            unaligned &= ~np.isin(phase, list(self.aligned_custom))
            kinds[unaligned] = _OTHER
        return kinds

    def _one_by_one(self, records: np.ndarray) -> None:
        for record in records.tolist():
            self._add_one(record)

    def _add_kinds_apart(self, records: np.ndarray) -> None:
        """Iteration records the array path refused whole: validation iterations inside a
        training iteration are taken as two runs, one per kind, when the kinds share no
        phase (each kind's iterations, counters and series are then its own, so the order
        between the kinds does not matter); else, or when a kind is refused, record by
        record."""
        validation = is_validation(records)
        phase = records[:, P_PHASE]
        if (
            validation.all()
            or not validation.any()
            or np.intersect1d(phase[validation], phase[~validation]).size
        ):
            self._one_by_one(records)
            return
        for part in (records[~validation], records[validation]):
            if not self._add_iterations(part):
                self._one_by_one(part)

    def _add_one(self, record: list[int]) -> None:
        """Aggregate one record (the semantics ``_add_iterations`` reproduces on arrays)."""
        phase = record[P_PHASE]
        flags = record[P_FLAGS]
        if phase in UNCAPPED:
            self._add_span(phase, record, flags)
        elif flags & wire.FLAG_IN_ITERATION:
            self._add_to_iteration(record, bool(flags & wire.FLAG_VALIDATION))
        else:
            self._add_outside(phase, record)

    def _add_outside(self, phase: int, record: list[int]) -> None:
        """A phase outside any iteration: a standard one (or a custom one whose column is
        iteration-aligned) is a flagged row; another custom one is its own measurement."""
        wall_ns = record[P_END] - record[P_START]
        if phase < wire.FIRST_CUSTOM_ID or phase in self.aligned_custom:
            self._flag(phase, record, wall_ns, record[P_GPU], record[P_PEAK], OUTSIDE)
            return
        seen = self._standalone_seen.get(phase, 0)
        self._standalone_seen[phase] = seen + 1
        if seen >= self.settings.warmup_iterations:
            series = self.series.get(phase)
            stored = len(series.rows) if series else 0
            self._measure(
                phase,
                record,
                wall_ns,
                record[P_GPU],
                record[P_PEAK],
                store=stored < self.settings.num_measurements,
                flag=OUTSIDE,
            )

    def _add_to_iteration(self, record: list[int], validation: bool) -> None:
        key = (validation, record[P_ITERATION])
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = (record, {})
        phases = entry[1]
        phase = record[P_PHASE]
        partial = phases.get(phase)
        if partial is None:
            partial = phases[phase] = Partial(record[P_START])
        partial.add(record[P_START], record[P_END], record[P_GPU], record[P_PEAK])
        if phase == LOOP_PHASES[validation]:
            self._close_iteration(key, record)

    def _close_iteration(self, key: tuple[bool, int], loop_record: list[int]) -> None:
        validation, iteration = key
        _, phases = self._open.pop(key)
        # Iterations of the same kind still open before this one never got their loop
        # record (a message lost on the way): cut short.
        for stale in [k for k in self._open if k[0] == validation and k[1] < iteration]:
            self._cut_iteration(stale)
        if loop_record[P_FLAGS] & wire.FLAG_INCOMPLETE:
            self._flag_iteration(loop_record, phases, loop_record[P_BATCHES])
            return
        verdict = self._decide(validation, loop_record)
        if verdict is None:
            return
        store, batches, size, samples = verdict
        loop = loop_record[P_PHASE]
        sample = None if store else self.whole_run.of_kind(validation).take_one()
        for phase, partial in phases.items():
            if phase >= wire.FIRST_CUSTOM_ID and phase not in self.aligned_custom:
                self._align(phase)
            self._measure(
                phase,
                loop_record,
                partial.wall_ns,
                partial.gpu_ns,
                partial.peak_bytes,
                store,
                start_ns=partial.start_ns,
                batches=batches,
                batch_size=size if phase == loop else None,
                samples=samples if phase == loop else None,
                sample=sample,
            )

    def _cut_iteration(self, key: tuple[bool, int]) -> None:
        """An open iteration whose loop record never came: its phases are flagged rows."""
        context, phases = self._open.pop(key)
        self._flag_iteration(context, phases, 0)

    def _flag_iteration(self, context: list[int], phases: dict[int, Partial], batches: int) -> None:
        for phase, partial in phases.items():
            self._flag(
                phase,
                context,
                partial.wall_ns,
                partial.gpu_ns,
                partial.peak_bytes,
                INCOMPLETE,
                start_ns=partial.start_ns,
                batches=batches,
            )
