"""Epoch and Validation spans of one rank: begun, ended or cut short, never warmed up
nor capped; one open at the checkpoint a session resumed from is one measurement of
its two parts (the time between the sessions left out)."""

from __future__ import annotations

from dataclasses import replace

from markers import wire
from markers.wire import (
    P_END,
    P_EPOCH,
    P_GPU,
    P_PEAK,
    P_START,
)
from sidecar.model.aggregator_state import AggregatorState
from sidecar.model.series import INCOMPLETE, PART, Row


class SpanAggregator(AggregatorState):
    """The spans (Epoch, Validation) of a rank's aggregation."""

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
