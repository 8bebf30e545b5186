"""The loop thread's side of the exports: per split, what was handed over so far
(cursors over the stored rows and resource samples), the step timeline, and the
``Slice`` of each write or live hand-over. Everything here is references and counts: the
points are made on the exporters' thread (``sidecar.exports.export_worker``).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from markers import wire
from sidecar.exports.points import Slice, StepTimeline
from sidecar.model.goodput import Account
from sidecar.model.split import Split
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml_gpu import GpuSample
from sidecar.sinks import layout
from sidecar.sinks.aggregate_text import AGGREGATE_FILE

# Files of a split uploaded as artifacts at its end (those that exist).
RUN_FILES = (
    layout.SUMMARY_FILE,
    f"logs/{layout.computational_file(0)}",
    f"logs/{layout.phases_file(0)}",
    f"logs/{layout.RESOURCES_FILE}",
    f"logs/{AGGREGATE_FILE}",
)


class Samples(Protocol):
    """A split's resource samples as the feed reads them (``ResourceFigures`` at a write,
    ``LiveSamples`` between writes): in time order, on the sidecar's monotonic clock (ns)."""

    @property
    def gpu_samples(self) -> Sequence[GpuSample]: ...
    @property
    def host_samples(self) -> Sequence[HostSample]: ...
    @property
    def run_start_ns(self) -> int: ...
    @property
    def session_starts_ns(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class LiveSamples:
    """The samples of a running split between two writes (no summary is taken)."""

    gpu_samples: Sequence[GpuSample]
    host_samples: Sequence[HostSample]
    run_start_ns: int
    session_starts_ns: Sequence[int] = field(default_factory=list)


class SplitFeed:
    """What one split's exports were handed so far. ``names``: its exporters."""

    def __init__(self, split: Split, names: tuple[str, ...], settings: dict[str, Any]) -> None:
        self.names = names
        self.settings = settings  # tensorboard_dir, mlflow_* of the hello, resolved
        self.timeline = StepTimeline()
        self._rows: dict[int, tuple[list[Any], int]] = {}  # phase -> (rows list, handed)
        # the last sample handed (monotonic ns; None: not yet decided): a time, not an
        # index, as the monitor thins older samples on long runs
        self._gpu_ns: int | None = None
        self._host_ns: int | None = None
        self._session = -1  # the last session seen (a resume cuts the rows back)
        self.ended = False

    def rank(self, split: Split) -> int | None:
        """The rank whose figures are exported: 0, else the lowest one served here."""
        return 0 if 0 in split.ranks else min(split.ranks, default=None)

    def note(self, split: Split, rank: int, values: Any) -> None:
        """The records of one read of ``rank``: the iterations' starts (step axis)."""
        if rank != self.rank(split):
            return
        agg = split.ranks[rank]
        if agg.sessions:
            records = np.asarray(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)
            self.timeline.note(agg, records)

    def take(
        self,
        split: Split,
        figures: Samples,
        accounts: Mapping[int, Account],
        with_state: bool,
    ) -> Slice | None:
        """The slice of this write, or of a live hand-over between writes (None when the
        split has no rank to export yet, or ended); ``accounts``: the goodput accounts of
        the ranks served here, as derived for a write (empty between writes).

        On the first write and after a resume, rows of earlier sessions count as handed
        over already: another sidecar, or this one before the resume, exported them (the
        rows a resume dropped were after its checkpoint)."""
        rank = self.rank(split)
        if rank is None or not split.ranks[rank].sessions or self.ended:
            return None
        agg = split.ranks[rank]
        current = agg.sessions[-1].number
        rows: dict[tuple[int, str], list[Any]] = {}
        earlier_rows: dict[tuple[int, str], list[Any]] = {}  # at a new session only
        for phase, series in agg.series.items():
            if phase in (wire.TRAINING,) or (phase >= wire.FIRST_CUSTOM_ID and not series.rows):
                continue
            kept, handed = self._rows.get(phase, (None, 0))
            if kept is not series.rows or self._session != current:
                # a new list (a custom phase aligned, a resume) or a new session
                earlier = sum(1 for row in series.rows if row.session < current)
                handed = min(handed, earlier) if kept is series.rows else earlier
            new = series.rows[handed:]
            name = agg.custom_names.get(phase, "")
            if new:
                rows[(phase, name)] = new
            if self._session != current:
                earlier_rows[(phase, name)] = [r for r in series.rows if r.session < current]
            self._rows[phase] = (series.rows, len(series.rows))
        session_start_ns = figures.session_starts_ns[-1] if figures.session_starts_ns else 0
        if self._gpu_ns is None or self._host_ns is None or self._session != current:
            # samples of earlier sessions were handed before (by this or another sidecar)
            before = session_start_ns - 1
            self._gpu_ns = max(self._gpu_ns if self._gpu_ns is not None else before, before)
            self._host_ns = max(self._host_ns if self._host_ns is not None else before, before)
        self._session = current
        gpu = _after(figures.gpu_samples, self._gpu_ns)
        host = _after(figures.host_samples, self._host_ns)
        self._gpu_ns = gpu[-1].t_ns if gpu else self._gpu_ns
        self._host_ns = host[-1].t_ns if host else self._host_ns
        final = split.end_unix is not None
        self.ended = final
        account = None
        if with_state or final:
            account = accounts.get(rank)
        uuid = split.rank_gpus.get(rank)
        return Slice(
            split_dir=split.split_dir,
            out_dir=split.out_dir,
            lineage=agg.sessions[0].run_id,
            rows=rows,
            first_steps={s.number: s.first_step for s in agg.sessions},
            session_starts=[(s.start_unix, s.first_step) for s in agg.sessions],
            earlier_rows=earlier_rows,
            run_start_unix=agg.run_start_unix,
            timeline=self.timeline.arrays(),
            gpu_samples=gpu,
            host_samples=host,
            run_start_ns=figures.run_start_ns,
            step_now=agg.step(),
            now_unix=time.time(),
            cpu_count=os.cpu_count() or 1,
            rank_gpu_index=next(
                (s.gpu_index for s in figures.gpu_samples if uuid and s.uuid == uuid), 0
            ),
            goodput=account,
            final=final,
            status=split.status,
            files=[split.split_dir / name for name in RUN_FILES] if final else [],
        )


def _after(samples: Sequence[Any], t_ns: int) -> list[Any]:
    """The ``samples`` (in time order) taken after ``t_ns``."""
    return list(samples[bisect.bisect_right(samples, t_ns, key=lambda s: s.t_ns) :])


def resolve(folder: str | None, cwd: str | None) -> Path | None:
    """A folder a hello names, relative to the process's working directory."""
    if not folder:
        return None
    return Path(cwd or "/") / os.path.expanduser(folder)
