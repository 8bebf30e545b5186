"""One rank's runs of records aggregated on arrays, the work per iteration or per
stored row rather than per record: iterations closed together (their rule on arrays,
``model/verdicts.py``; their phases' sums, ``model/blocks.py``), the one left open kept,
and records outside iterations phase by phase. Each gives what the record path
(model/aggregator.py) gives for the same records."""

from __future__ import annotations

import numpy as np

from markers import wire
from markers.wire import (
    P_BATCHES,
    P_END,
    P_FLAGS,
    P_GPU,
    P_ITERATION,
    P_PEAK,
    P_PHASE,
    P_START,
)
from sidecar.model.blocks import (
    Blocks,
    Partial,
    is_validation,
    partial_records,
    split_blocks,
)
from sidecar.model.series import INCOMPLETE, OUTSIDE
from sidecar.model.spans import SpanAggregator
from sidecar.model.verdicts import Verdicts
from sidecar.model.whole_run import Entry


class ArrayPath(SpanAggregator):
    """The array path of a rank's aggregation."""

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
