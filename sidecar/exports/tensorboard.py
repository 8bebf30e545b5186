"""TensorBoard: the split's figures as scalars in event files written with TensorBoard's
own writer (``EventFileWriter``), by default under ``training/split-<k>/tensorboard/``
(InnerEye's ``aggregate_resource_usage.csv`` is written with every run's files:
``sidecar.sinks.aggregate_text``).

Resource tags InnerEye's ResourceMonitor wrote keep their names and meaning
(docs/exports.md maps them); the others carry their unit in the tag. A resumed session
starts with TensorBoard's own restart event (``SessionLog.START`` at its first step), so
TensorBoard discards what the previous process wrote after the checkpoint it resumed from.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from markers import wire
from sidecar.exports.points import (
    Names,
    Point,
    Slice,
    cpu_share_pct,
    every_point,
    memory_used_pct,
    scaled,
)
from sidecar.sinks.aggregate_text import MIB_PER_GIB

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


class TensorBoardExporter:
    """Scalars of one split into one event file per sidecar (``EventFileWriter``)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.folder: Path = settings["tensorboard_dir"] or settings["split_dir"] / "tensorboard"
        self.exported = 0
        self.dropped = 0
        self.error: str | None = None
        self.failed_attempts = 0
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
        """Write ``part``'s scalars (and a restart event for each new session after the
        first); a failure counts its points."""
        points = list(every_point(part, GPU_TAGS, HOST_TAGS))
        allocated = allocated_points(points, part.rank_gpu_index)
        points += allocated
        try:
            writer = self._open()
            for session, first_step in sorted(part.first_steps.items()):
                if session not in self._sessions:
                    self._sessions.add(session)
                    if first_step > 0:  # TensorBoard drops the orphans after a checkpoint
                        start = SessionLog(status=SessionLog.START)
                        writer.add_event(
                            Event(wall_time=part.now_unix, step=first_step, session_log=start)
                        )
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

    def _open(self) -> EventFileWriter:
        if self._writer is None:
            os.makedirs(self.folder, exist_ok=True)
            self._writer = EventFileWriter(str(self.folder), flush_secs=5)
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
