"""TensorBoard: the split's figures as scalars in event files written with TensorBoard's
own writer (``EventFileWriter``), by default under ``training/split-<k>/tensorboard/``
(with ``tensorboard_dir=``: its ``trainmon/`` subfolder, never the script's own files;
InnerEye's ``aggregate_resource_usage.csv`` is written with every run's files:
``sidecar.sinks.aggregate_text``).

Resource tags InnerEye's ResourceMonitor wrote keep their names and meaning
(docs/exports.md maps them); the others carry their unit in the tag.

A resume is shown right by both of TensorBoard's loaders. Every session starts with
TensorBoard's restart event (``SessionLog.START`` at its first step): the Python loader
takes a run's first one as its start and purges, at each later one, every point at or
after its step. The Rust loader (``--load_fast``) ignores it and only drops, per tag,
points at or after a step that comes again; a dead session's points after the
checkpoint that the resumed one never repeats (its warmup) would stay. So at a resume
the earlier event files of the folder, which only this exporter writes, are cut back to
the points the store keeps (``cut_from``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from markers import wire
from sidecar.exports.points import (
    PHASE_PREFIX,
    THROUGHPUT_PREFIX,
    Names,
    Point,
    Slice,
    cpu_share_pct,
    every_point,
    memory_used_pct,
    phase_points,
    scaled,
)
from sidecar.sinks.aggregate_text import MIB_PER_GIB

OWN_SUBFOLDER = "trainmon"  # under a tensorboard_dir= the script may write itself
EVENT_FILE_MARK = ".tfevents."  # in the name of every event file TensorBoard reads


GPU_TAGS: Names = {
    "GPU{i}/Load_Percent": scaled("util_pct"),
    "GPU{i}/MemUtil_Percent": memory_used_pct,
    "GPU{i}/MemReserved_GB": scaled("job_mem_mib", 1 / MIB_PER_GIB),
    "GPU{i}/MemControllerUtil_Percent": scaled("mem_util_pct"),
    "GPU{i}/MemUsed_MiB": scaled("mem_used_mib"),
    "GPU{i}/Power_W": scaled("power_w"),
    "GPU{i}/Temperature_C": scaled("temperature_c"),
}
HOST_TAGS: Names = {
    "CPU/Load_Percent": cpu_share_pct,
    "CPU/MemUtil_Percent": scaled("system_mem_used_pct"),
    "CPU/JobCPU_PercentOfOneCore": scaled("cpu_pct"),
    "CPU/JobRSS_MiB": scaled("rss_mib"),
}
# The training iteration's allocator peak (Forward, Backward, Optimization), GiB.
ALLOCATED_TAG = "GPU{i}/MemAllocated_GB"
_PEAK_PHASES = tuple(p.metric for p in wire.STEP_PHASES if p.gpu)


def allocated_points(points: list[Point], gpu_index: int) -> list[Point]:
    """InnerEye's MemAllocated_GB from the phase points: per step, the highest allocator
    peak of its Forward, Backward and Optimization (the training process's own allocator,
    which InnerEye read in its monitor process, where it is always zero), GiB."""
    peaks: dict[int, tuple[float, float]] = {}
    for name, value, step, wall in points:
        if name.endswith("_gpu_max_memory_mib") and name.split("/")[1].startswith(_PEAK_PHASES):
            held = peaks.get(step)
            peaks[step] = (max(value, held[0]) if held else value, wall)
    tag = ALLOCATED_TAG.format(i=gpu_index)
    return [(tag, peak / MIB_PER_GIB, step, wall) for step, (peak, wall) in peaks.items()]


def cut_from(folder: Path, part: Slice) -> int:
    """Cut the event files of ``folder`` back to what the store keeps of the sessions
    before ``part``'s (a resumed one): phase points of their stored rows only (an
    iteration under way at the checkpoint is not stored; matched by name and value),
    other points before the resumed first step (resources.tsv keeps every sample, but
    TensorBoard shows one session per step); each file rewritten in place (atomically,
    same name, so the loaders' file order stays); returns the events removed. Raises
    OSError."""
    first_step = max(part.first_steps.items())[1]
    # by name and value: the step of a row outside iterations (validation) needs the
    # earlier sessions' timeline, which a sidecar that did not serve them lacks
    stored = Counter((name, _float32(value)) for name, value, _, _ in phase_points(part, True))

    def keep(event: Event) -> bool:
        if event.HasField("file_version"):
            return True
        if event.HasField("summary") and event.summary.value:
            value = event.summary.value[0]
            if value.tag.startswith((PHASE_PREFIX, THROUGHPUT_PREFIX)):
                key = (value.tag, _float32(value.simple_value))
                if stored[key] > 0:
                    stored[key] -= 1
                    return True
                return False
        return event.step < first_step

    removed = 0
    for path in sorted(folder.iterdir()):
        if EVENT_FILE_MARK not in path.name or not path.is_file():
            continue
        events = list(LegacyEventFileLoader(str(path)).Load())
        kept = [event for event in events if keep(event)]
        if len(kept) == len(events):
            continue
        temporary = path.with_name(f".{path.name}.cut")
        with open(temporary, "wb") as file:
            records = RecordWriter(file)
            for event in kept:
                records.write(event.SerializeToString())
            records.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        removed += len(events) - len(kept)
    return removed


def _float32(value: float) -> float:
    """``value`` as an event file holds it (``simple_value`` is a float32)."""
    return float(np.float32(value))


def _after_newest(folder: Path) -> None:
    """Wait (at most a second, on the exports thread) until a new event file's name
    sorts after every one in ``folder``: the loaders read a folder's files in name order,
    and the name starts with the Unix second it was made in, then the host and the pid."""
    seconds = [
        int(parts[3])
        for path in folder.iterdir()
        if len(parts := path.name.split(".")) > 3
        and parts[3].isdigit()
        and EVENT_FILE_MARK in path.name
    ]
    newest = max(seconds, default=0)
    while int(time.time()) <= newest:
        time.sleep(0.05)


class TensorBoardExporter:
    """Scalars of one split into one event file per session and sidecar
    (``EventFileWriter``), in a folder only it writes."""

    def __init__(self, settings: dict[str, Any]) -> None:
        chosen = settings["tensorboard_dir"]
        self.folder: Path = (
            chosen / OWN_SUBFOLDER if chosen else settings["split_dir"] / "tensorboard"
        )
        self.exported = 0
        self.dropped = 0
        self.error: str | None = None
        self.failed_attempts = 0
        self.unconfirmed = 0  # a write to a file is known to work or fail at once
        self.awaiting = 0  # and is counted once written, with no later confirmation
        self._writer: EventFileWriter | None = None
        self._sessions: set[int] = set()

    def where(self) -> str:
        """The event files' folder."""
        return str(self.folder)

    def pending(self) -> int:
        """Nothing is kept: a failed write is counted at once (the next one reopens)."""
        return 0

    def retry(self, now_mono: float) -> None:
        """Nothing to retry (see ``pending``)."""

    def export(self, part: Slice) -> None:
        """Write ``part``'s scalars (at a new session: the earlier files cut back to its
        first step, then a file of its own starting with a restart event); a failure
        counts its points."""
        points = list(every_point(part, GPU_TAGS, HOST_TAGS))
        allocated = allocated_points(points, part.rank_gpu_index)
        points += allocated
        try:
            writer = self._session_writer(part)
            for name, value, step, wall in points:
                summary = Summary(value=[Summary.Value(tag=name, simple_value=value)])
                writer.add_event(Event(wall_time=wall, step=step, summary=summary))
            writer.flush()
        except Exception as exc:  # the library raises what the file system raised, or its own
            self.dropped += len(points)
            self.failed_attempts += 1
            self.error = f"{type(exc).__name__}: {exc}"
            self._drop_writer()
        else:
            self.exported += len(points)
            self.error = None

    def _session_writer(self, part: Slice) -> EventFileWriter:
        """The writer of the current session; a new session (the first this exporter
        sees included) gets a new file, after the earlier ones were cut back to its first
        step, which starts with its restart event (written once per session)."""
        session, first_step = max(part.first_steps.items())
        if session in self._sessions and self._writer is not None:
            return self._writer
        self._drop_writer()
        os.makedirs(self.folder, exist_ok=True)
        if session not in self._sessions and len(part.first_steps) > 1:
            cut_from(self.folder, part)
        _after_newest(self.folder)
        self._writer = EventFileWriter(str(self.folder), flush_secs=5)
        if session not in self._sessions:
            start = SessionLog(status=SessionLog.START)
            self._writer.add_event(
                Event(wall_time=part.session_starts[-1][0], step=first_step, session_log=start)
            )
            self._sessions.add(session)
        return self._writer

    def _drop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):  # already failing: its error was counted
                writer.close()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
