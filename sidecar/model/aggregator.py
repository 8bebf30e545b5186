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
kept in one class. It is built on the rank's sessions and their clocks
(``model/session_clock.py``) and on the phases' stored rows (``model/series.py``); the
batch sizes are ``model/batch_sizes.py``'s; its state file is ``model/state.py``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import numpy as np

from markers import hello, wire
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
from sidecar.model.batch_sizes import SessionBatchSizes
from sidecar.model.blocks import (
    Blocks,
    Partial,
    is_validation,
    partial_records,
    split_blocks,
)
from sidecar.model.series import INCOMPLETE, OUTSIDE, PART, Row, SeriesStore
from sidecar.model.verdicts import Verdict, Verdicts, decide, decide_one
from sidecar.model.whole_run import Entry

UNCAPPED = frozenset({wire.EPOCH, wire.VALIDATION})
# Runs of ordinary iteration records shorter than this go record by record: the array
# path costs a fixed ~0.1 ms however few records it takes.
MIN_ARRAY_RECORDS = 64
# Kinds of records (``RankAggregator._kinds``): runs of one kind are taken together.
_INSIDE, _OUTSIDE, _OTHER = 0, 1, 2
# The flags that tell a training iteration's record (in an iteration, not validation).
_ITERATION_KIND = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION
RecordValues = np.ndarray | array | Sequence[int]
LOOP_PHASES = wire.LOOP_ID


@dataclass(frozen=True)
class Settings:
    """What a run told the sidecar about itself in its hello (defaults: ``markers.hello``)."""

    warmup_iterations: int = hello.FIELDS["warmup_iterations"].default
    num_measurements: int = hello.FIELDS["num_measurements"].default
    train_batch_size: int | None = hello.FIELDS["train_batch_size"].default
    val_batch_size: int | None = hello.FIELDS["val_batch_size"].default
    accumulation_steps: int = hello.FIELDS["accumulation_steps"].default


class RankAggregator(SeriesStore):
    """Aggregation state of one (run folder, split, rank)."""

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

    # -- sessions -------------------------------------------------------------------

    def _new_batch_sizes(self) -> SessionBatchSizes:
        return SessionBatchSizes(self.settings.train_batch_size, self.settings.val_batch_size)

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

    def open_span_parts(self) -> dict[int, Row]:
        """Each Epoch or Validation open now, as the row of its part so far (up to the
        session's last record), flagged PART: what a state taken now keeps of it."""
        return {
            phase: self._row(begin, self._open_span_ns(begin), -1, -1, None, None, 0, PART)
            for phase, begin in self._spans.items()
            if self.sessions
        }

    def _open_span_ns(self, begin: list[int]) -> int:
        """Wall time (ns) so far of the span ``begin`` opened: up to the session's last
        record (never negative)."""
        return max(self.sessions[-1].last_ns, begin[P_START]) - begin[P_START]

    def continue_parts(self, parts: dict[int, Row]) -> None:
        """Resume from a state that kept ``parts`` (``open_span_parts``): each is a flagged
        row, and the same span's end in the next session is its second part."""
        self.continued = {(phase, row.epoch): row for phase, row in parts.items()}
        for phase, row in parts.items():
            self._series(phase).flagged.append(row)

    def _measure_whole(self, phase: int, first: Row, second: Row | None) -> None:
        """One measurement of an Epoch or Validation cut by a checkpoint: its ``first`` part
        (up to the checkpoint) and its ``second`` (from the resume to its end; None when
        the resumed process went on with a later one), the time between them (downtime,
        redone work) left out. The row starts where the span did."""
        whole = replace(first, flag="")
        if second is not None:
            gpus = (first.gpu_s, second.gpu_s)
            peaks = [p for p in (first.peak_mib, second.peak_mib) if p is not None]
            whole = replace(
                whole,
                wall_s=first.wall_s + second.wall_s,
                gpu_s=None if None in gpus else sum(g for g in gpus if g is not None),
                peak_mib=max(peaks) if peaks else None,
            )
        series = self._series(phase)
        series.wall.add(whole.wall_s)
        if whole.gpu_s is not None:
            series.gpu.add(whole.gpu_s)
        series.rows.append(whole)

    def note_batch_size(
        self, validation: bool, iteration: int, size: int | None, position: int = 0
    ) -> None:
        """The markers read ``size`` (None: unreadable) from the batches of this session
        from batch ``position`` (0: its first) of ``iteration`` on."""
        self._batch_sizes.note(validation, iteration, size, position)

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

    def _add_outside_run(self, records: np.ndarray) -> None:
        """Records outside any iteration (no Epoch/Validation span), on arrays: each phase
        is its own series, so they are taken phase by phase (``_add_outside``'s rule)."""
        phase = records[:, P_PHASE]
        for number in np.unique(phase).tolist():
            mine = records[phase == number]
            if number < wire.FIRST_CUSTOM_ID or number in self.aligned_custom:
                room = self.settings.num_measurements - len(self._series(number).flagged)
                for record in mine[: max(room, 0)].tolist():
                    self._flag(
                        number,
                        record,
                        record[P_END] - record[P_START],
                        record[P_GPU],
                        record[P_PEAK],
                        OUTSIDE,
                    )
                continue
            seen = self._standalone_seen.get(number, 0)
            self._standalone_seen[number] = seen + len(mine)
            measured = mine[max(self.settings.warmup_iterations - seen, 0) :]
            if not len(measured):
                continue
            wall_ns = measured[:, P_END] - measured[:, P_START]
            self._merge_moments(np.full(len(measured), number), wall_ns, measured[:, P_GPU])
            series = self.series[number]
            room = self.settings.num_measurements - len(series.rows)
            for record in measured[: max(room, 0)].tolist():
                series.rows.append(
                    self._row(
                        record,
                        record[P_END] - record[P_START],
                        record[P_GPU],
                        record[P_PEAK],
                        None,
                        None,
                        0,
                        OUTSIDE,
                    )
                )

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

    def _add_iterations(self, records: np.ndarray) -> bool:
        """Aggregate a run of ordinary iteration records on arrays; False (nothing done)
        when their shape needs the record-by-record path: interleaved iterations, an
        iteration left open earlier that these records do not continue first, or one that
        holds a custom phase not aligned yet."""
        validation = is_validation(records)
        present = (bool(validation.any()), not bool(validation.all()))  # (val, train)
        touched = [key for key in self._open if present[0 if key[0] else 1]]
        first_key = (bool(validation[0]), int(records[0, P_ITERATION]))
        if len(touched) > 1 or (touched and touched[0] != first_key):
            return False
        if touched and any(
            p >= wire.FIRST_CUSTOM_ID and p not in self.aligned_custom
            for p in self._open[first_key][1]
        ):
            return False  # its close aligns a custom phase: the record path decides that
        context = None
        if touched:
            context, partials = self._open[first_key]
            records = np.concatenate((partial_records(context, partials), records))
            validation = np.concatenate((np.full(len(partials), first_key[0]), validation))
        blocks = split_blocks(records, validation)
        if blocks is None:
            return False
        if touched:
            del self._open[first_key]
        self._close_blocks(records, blocks)
        if not blocks.closed[-1]:
            self._keep_open(records, blocks, context)
        return True

    def _close_blocks(self, records: np.ndarray, blocks: Blocks) -> None:
        """Decide the closed iterations of ``blocks`` together with ``_decide_many`` (the
        rule the record path calls per iteration), their phases' sums on arrays."""
        closed = np.flatnonzero(blocks.closed)
        if not len(closed):
            return
        loops = records[blocks.last[closed]]
        cut = (loops[:, P_FLAGS] & wire.FLAG_INCOMPLETE) != 0
        whole = np.flatnonzero(~cut)
        verdicts = self._decide_many(blocks.validation[closed][whole], loops[whole])
        # Per iteration: measured (past warmup, not cut) and stored.
        measured = np.zeros(len(loops), dtype=bool)
        stored = np.zeros(len(loops), dtype=bool)
        measured[whole], stored[whole] = verdicts.measured, verdicts.stored
        of_block = np.full(len(blocks.first), -1)
        of_block[closed] = np.arange(len(closed))
        loop_of = of_block[blocks.block]  # per group: its loop's index in ``loops``, or -1
        taken = loop_of >= 0
        if cut.any():
            short = np.flatnonzero(taken)
            short = short[cut[loop_of[short]]]
            self._flag_groups(blocks, short, loops, loop_of)
        taken[taken] = measured[loop_of[taken]]
        self._merge_moments(blocks.phase[taken], blocks.wall_ns[taken], blocks.gpu_ns[taken])
        kept = np.flatnonzero(taken)
        kept = kept[stored[loop_of[kept]]]
        of_whole = np.full(len(loops), -1)
        of_whole[whole] = np.arange(len(whole))
        if len(kept):
            self._store_rows(blocks, kept, loops, loop_of, verdicts, of_whole)
        sampled = self.whole_run.pick(blocks.validation[closed], measured & ~stored)
        if sampled:  # measured iterations past the cap that the whole-run sample keeps
            groups = np.flatnonzero(taken)
            groups = groups[np.isin(loop_of[groups], list(sampled))]
            self._store_rows(blocks, groups, loops, loop_of, verdicts, of_whole, sampled)

    def _flag_groups(
        self, blocks: Blocks, groups: np.ndarray, loops: np.ndarray, loop_of: np.ndarray
    ) -> None:
        """Flagged rows of ``groups`` (in block order), iterations cut short (their loop
        record flagged incomplete), as ``_flag_iteration`` keeps them (``_flag``: the first
        ones of each phase under the cap, then the whole-run sample's)."""
        indices = np.unique(loop_of[groups])
        loop_of_index = dict(zip(indices.tolist(), loops[indices].tolist(), strict=True))
        for number, index, start_ns, wall_ns, gpu_ns, peak_bytes in blocks.sums(
            groups, blocks.phase, loop_of
        ):
            loop = loop_of_index[index]
            self._flag(
                number,
                loop,
                wall_ns,
                gpu_ns,
                peak_bytes,
                INCOMPLETE,
                start_ns=start_ns,
                batches=loop[P_BATCHES],
            )

    def _store_rows(
        self,
        blocks: Blocks,
        kept: np.ndarray,
        loops: np.ndarray,
        loop_of: np.ndarray,
        verdicts: Verdicts,
        of_whole: np.ndarray,
        sampled: dict[int, Entry] | None = None,
    ) -> None:
        """Store the rows of the groups ``kept`` (in block order, as ``_measure`` would);
        ``verdicts`` of the iterations not cut short, ``of_whole``: per loop of ``loops``,
        its index in them; ``sampled``: instead of storing, the whole-run entry of each
        loop (by index) to put its rows in."""
        # Each stored loop's record and verdict as Python values, converted together.
        indices = np.unique(loop_of[kept])
        by_index = dict(
            zip(
                indices.tolist(),
                zip(loops[indices].tolist(), verdicts.some(of_whole[indices]), strict=True),
                strict=True,
            )
        )
        for phase, index, start_ns, wall_ns, gpu_ns, peak_bytes in blocks.sums(
            kept, blocks.phase, loop_of
        ):
            loop, verdict = by_index[index]
            assert verdict is not None  # kept: its iteration was measured
            _, batches, size, samples = verdict
            is_loop = phase == loop[P_PHASE]
            row = self._row(
                loop,
                wall_ns,
                gpu_ns,
                peak_bytes,
                start_ns,
                size if is_loop else None,
                batches,
                "",
                samples if is_loop else None,
            )
            if sampled is None:
                self._series(phase).rows.append(row)
            else:
                sampled[index].append((phase, row))

    def _keep_open(self, records: np.ndarray, blocks: Blocks, context: list[int] | None) -> None:
        """The last block has no loop record yet: it stays open (``_open``), its phases'
        sums in the order they came, its context the record that opened it."""
        last = len(blocks.first) - 1
        groups = np.flatnonzero(blocks.block == last)
        groups = groups[np.argsort(blocks.order[groups])]
        partials: dict[int, Partial] = {}
        for phase, start_ns, wall_ns, gpu_ns, peak_bytes in blocks.sums(groups, blocks.phase):
            partial = partials[phase] = Partial(start_ns)
            partial.wall_ns, partial.gpu_ns, partial.peak_bytes = wall_ns, gpu_ns, peak_bytes
        opener = records[blocks.first[last]].tolist()
        if context is None or last > 0:
            context = opener
        self._open[(bool(opener[P_FLAGS] & wire.FLAG_VALIDATION), opener[P_ITERATION])] = (
            context,
            partials,
        )

    def _add_span(self, phase: int, record: list[int], flags: int) -> None:
        """An Epoch or Validation record: its begin mark, its end, or its end cut short."""
        if flags & wire.FLAG_BEGIN:
            earlier = self._spans.get(phase)
            if earlier is not None:  # begun again without an end: the earlier one was cut
                self._flag(phase, earlier, record[P_START] - earlier[P_START], -1, -1, INCOMPLETE)
            self._spans[phase] = record
            for key in [k for k in self.continued if k[0] == phase and k[1] != record[P_EPOCH]]:
                # the resumed process went on with another one: the part up to the
                # checkpoint is all of it
                self._measure_whole(phase, self.continued.pop(key), None)
            return
        self._spans.pop(phase, None)
        wall_ns = record[P_END] - record[P_START]
        if flags & wire.FLAG_INCOMPLETE:
            self._flag(phase, record, wall_ns, record[P_GPU], record[P_PEAK], INCOMPLETE)
        elif (phase, record[P_EPOCH]) in self.continued:
            first = self.continued.pop((phase, record[P_EPOCH]))
            second = self._row(record, wall_ns, record[P_GPU], record[P_PEAK], None, None, 0, PART)
            flagged = self._series(phase).flagged
            if len(flagged) < self.settings.num_measurements:
                flagged.append(second)
            self._measure_whole(phase, first, second)
        else:
            self._measure(phase, record, wall_ns, record[P_GPU], record[P_PEAK], store=True)

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
