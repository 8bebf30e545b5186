"""The stored rows and streaming figures of each phase of one rank, and the custom
phases' keys: what ``RankAggregator`` (``model/aggregator.py``) decides is kept here.

A phase's ``PhaseSeries`` holds its stored rows (at most ``num_measurements``: the
aggregator decides which), the streaming count/mean/std of every measurement (past the
cap) and its flagged rows (phases.tsv only), up to ``num_measurements`` of them. A row's
times are seconds and MiB, its start in seconds since the run's start (the session clock,
``model/session_clock.py``, which this store is built on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from markers import wire
from markers.wire import P_BATCH, P_EPOCH, P_FLAGS, P_ITERATION, P_START
from sidecar.model.blocks import moments
from sidecar.model.session_clock import SessionClock
from sidecar.model.stats import Welford
from sidecar.model.units import BYTES_PER_MIB, NS_PER_S
from sidecar.model.whole_run import Entry, WholeRun

OUTSIDE = "outside"  # flag of a row measured outside any iteration
INCOMPLETE = "incomplete"  # flag of a row cut short: kept, never a measurement
# Flag of one part of an Epoch or Validation open at a checkpoint: the part up to the
# checkpoint, and (when the resumed process goes on in it) the part after the resume.
PART = "part"


@dataclass(slots=True)
class Row:
    """One stored measurement of one phase. Seconds and MiB; None where not measured."""

    wall_s: float
    gpu_s: float | None
    peak_mib: float | None
    epoch: int
    iteration: int
    batch: int
    session: int
    start_s: float  # since the run (first session) started
    batch_size: int | None = None  # samples per batch of the iteration (loop rows only)
    batches: int = 0  # batches of the row's iteration (0 outside iterations)
    flag: str = ""  # "", OUTSIDE, INCOMPLETE or PART (phases.tsv's flag column)
    samples: int | None = None  # the sum of its batches' sizes (loop rows only; throughput)


ROW_FIELDS = tuple(f.name for f in fields(Row))


@dataclass
class PhaseSeries:
    """The stored rows of a phase, its streaming figures over all measurements, and its
    flagged rows (phases.tsv only: cut short, or outside the iteration-aligned column)."""

    rows: list[Row] = field(default_factory=list)
    wall: Welford = field(default_factory=Welford)
    gpu: Welford = field(default_factory=Welford)
    flagged: list[Row] = field(default_factory=list)


class SeriesStore(SessionClock):
    """The series of one rank by phase key (standard ids, then custom keys by name)."""

    def __init__(self, num_measurements: int, run_start_unix: float) -> None:
        super().__init__(run_start_unix)
        self.row_cap = num_measurements  # flagged rows kept per phase
        self.series: dict[int, PhaseSeries] = {}
        self.custom_names: dict[int, str] = {}
        self.aligned_custom: set[int] = set()  # custom phases measured inside iterations
        self._names: dict[str, int] = {}  # custom name -> its key in ``series``
        self.whole_run = WholeRun()  # iterations sampled over the whole run, past the cap

    def custom_key(self, name: str) -> int:
        """The key of custom phase ``name`` in ``series`` (its identity is its name, across
        processes, resumes and sidecars); a new name gets the next free key."""
        key = self._names.get(name)
        if key is None:
            key = max(self.custom_names, default=wire.FIRST_CUSTOM_ID - 1) + 1
            self.custom_names[key] = name
            self._names[name] = key
        return key

    def restore_custom_names(self, names: dict[int, str]) -> None:
        """Take the custom phases' keys and names of a saved state (``custom_key`` then
        finds them by name)."""
        self.custom_names = dict(names)
        self._names = {name: key for key, name in names.items()}

    def measured_custom(self) -> list[int]:
        """The custom phases with at least one measurement (flagged rows alone make no
        column), in the order of their keys."""
        return sorted(
            p for p, s in self.series.items() if p >= wire.FIRST_CUSTOM_ID and s.wall.count
        )

    def _merge_moments(self, phases: np.ndarray, wall_ns: np.ndarray, gpu_ns: np.ndarray) -> None:
        """Add measured per-iteration sums (ns) to the phases' streaming figures."""
        if not len(phases):
            return
        for phase, count, mean, m2 in zip(
            *map(np.ndarray.tolist, moments(phases, wall_ns / NS_PER_S)), strict=True
        ):
            self._series(phase).wall.merge(count, mean, m2)
        measured = gpu_ns >= 0
        if measured.any():
            for phase, count, mean, m2 in zip(
                *map(np.ndarray.tolist, moments(phases[measured], gpu_ns[measured] / NS_PER_S)),
                strict=True,
            ):
                self._series(phase).gpu.merge(count, mean, m2)

    def _align(self, phase: int) -> None:
        """Custom ``phase`` is measured inside an iteration from now on: its column holds
        iteration-aligned rows only; what it measured outside iterations becomes flagged."""
        self.aligned_custom.add(phase)
        series = self.series.get(phase)
        if series is not None:
            series.flagged.extend(series.rows)
            series.rows, series.wall, series.gpu = [], Welford(), Welford()

    def _series(self, phase: int) -> PhaseSeries:
        series = self.series.get(phase)
        if series is None:
            series = self.series[phase] = PhaseSeries()
        return series

    def _row(
        self,
        record: list[int],
        wall_ns: int,
        gpu_ns: int,
        peak_bytes: int,
        start_ns: int | None,
        batch_size: int | None,
        batches: int,
        flag: str,
        samples: int | None = None,
    ) -> Row:
        session = self.sessions[-1]
        start_s = self.since_run_start_s(record[P_START] if start_ns is None else start_ns)
        return Row(
            wall_ns / NS_PER_S,
            gpu_ns / NS_PER_S if gpu_ns >= 0 else None,
            peak_bytes / BYTES_PER_MIB if peak_bytes >= 0 else None,
            record[P_EPOCH],
            record[P_ITERATION],
            record[P_BATCH],
            session.number,
            start_s,
            batch_size,
            batches,
            flag,
            samples,
        )

    def _flag(
        self,
        phase: int,
        record: list[int],
        wall_ns: int,
        gpu_ns: int,
        peak_bytes: int,
        flag: str,
        start_ns: int | None = None,
        batches: int = 0,
    ) -> None:
        """Keep a flagged row (phases.tsv only), up to ``num_measurements`` per phase; past
        them, a row of an iteration cut short goes to the whole-run sample if it keeps it."""
        series = self._series(phase)
        if len(series.flagged) < self.row_cap:
            series.flagged.append(
                self._row(record, wall_ns, gpu_ns, peak_bytes, start_ns, None, batches, flag)
            )
        elif flag == INCOMPLETE and record[P_FLAGS] & wire.FLAG_IN_ITERATION:
            entry = self.whole_run.cut_entry(
                (
                    self.sessions[-1].number,
                    record[P_EPOCH],
                    record[P_ITERATION],
                    bool(record[P_FLAGS] & wire.FLAG_VALIDATION),
                )
            )
            if entry is not None:
                row = self._row(record, wall_ns, gpu_ns, peak_bytes, start_ns, None, batches, flag)
                entry.append((phase, row))

    def _measure(
        self,
        phase: int,
        record: list[int],
        wall_ns: int,
        gpu_ns: int,
        peak_bytes: int,
        store: bool,
        start_ns: int | None = None,
        batches: int = 0,
        flag: str = "",
        batch_size: int | None = None,
        samples: int | None = None,
        sample: Entry | None = None,
    ) -> None:
        """One measurement of ``phase`` (ns, bytes): into its streaming figures, and its row
        into the stored rows when ``store``, else into ``sample`` (a whole-run entry) when
        given."""
        series = self._series(phase)
        series.wall.add(wall_ns / NS_PER_S)
        if gpu_ns >= 0:
            series.gpu.add(gpu_ns / NS_PER_S)
        if store or sample is not None:
            row = self._row(
                record, wall_ns, gpu_ns, peak_bytes, start_ns, batch_size, batches, flag, samples
            )
            if store:
                series.rows.append(row)
            elif sample is not None:
                sample.append((phase, row))
