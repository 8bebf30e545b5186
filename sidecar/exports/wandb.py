"""W&B: the split's figures as the history of a W&B run, logged with W&B's own client
(``wandb.init`` and ``Run.log``) on the exports thread, online or offline
(``WANDB_MODE=offline``: W&B writes the run's ``.wandb`` file with its own local process).

The run is the sidecar's own, one per split and lineage: its id is derived from the
split's first run id, so a resumed process logs into the same run. Project: the
script's active run's (sent with the hello), else ``WANDB_PROJECT``, else the run
folder's name; folder: ``WANDB_DIR``, else the split's folder. With an active run in
the script, ours joins its group (the script's run id when it has none), so W&B shows
them side by side. Two processes cannot write one W&B run offline, which is why the
sidecar does not log into the script's run itself (docs/exports.md).

The step axis. W&B keeps one value per name and history step and drops a point logged
at a step below its current one. A phase or resource series can hold several points at
one optimizer step (validation iterations, resource samples of a long step), so every
point carries the optimizer step in ``trainmon/step``, which W&B plots our names against
(``define_metric``), and W&B's own step is ``optimizer step × STEP_SLOTS + slot``: the
rows of one optimizer step take its slots in turn. Each point is logged once, in a row
of its own step, and never below W&B's current step (a late one takes the next free
row, still at its own ``trainmon/step``). A resumed session opens the run with W&B's
rewind (``resume_from=<id>?_step=<its first step × STEP_SLOTS − 1>``): W&B discards
what the killed process logged from the checkpoint on, as the stored rows do, so each
step is shown once.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import defaultdict
from typing import Any

import wandb

from sidecar.exports.points import (
    Names,
    Point,
    Slice,
    cpu_share_pct,
    goodput_points,
    memory_used_pct,
    phase_points,
    resource_points,
    scaled,
)

log = logging.getLogger("sidecar")
STEP_KEY = "trainmon/step"  # every row's optimizer step, the x axis of our names
STEP_SLOTS = 1000  # W&B history steps per optimizer step
PREFIXES = ("phases/*", "throughput/*", "goodput/*", "system/*")
BYTES_PER_MIB = 1024.0 * 1024.0
# W&B's own system-metric names (its System section) where it has the figure.
GPU_NAMES: Names = {
    "system/gpu.{i}.gpu": scaled("util_pct"),
    "system/gpu.{i}.memory": scaled("mem_util_pct"),
    "system/gpu.{i}.memoryAllocated": memory_used_pct,
    "system/gpu.{i}.memoryAllocatedBytes": scaled("mem_used_mib", BYTES_PER_MIB),
    "system/gpu.{i}.powerWatts": scaled("power_w"),
    "system/gpu.{i}.temp": scaled("temperature_c"),
    "system/gpu.{i}.jobMemoryMiB": scaled("job_mem_mib"),
}
HOST_NAMES: Names = {
    "system/cpu": cpu_share_pct,
    "system/memory_percent": scaled("system_mem_used_pct"),
    "system/proc.memory.rssMB": scaled("rss_mib"),
}


def run_id(lineage: str, split: int) -> str:
    """The W&B run id of a split's lineage: the same for every session of it."""
    digest = hashlib.sha256(f"{lineage}:{split}".encode()).hexdigest()[:16]
    return f"trainmon-{digest}"


def history_rows(
    points: list[tuple[Point, int]], last_step: int
) -> tuple[list[dict[str, Any]], int]:
    """``points`` (each with the optimizer step whose slots it takes) as W&B history
    rows, each ``{"_step": ..., STEP_KEY: ..., name: value}`` with one value per name, in
    W&B step order, every W&B step above ``last_step`` (the last one logged): the rows of
    slot step s from ``s × STEP_SLOTS`` on, or right after ``last_step`` when that is
    further (a late point). Returns the rows and the new last step."""
    by_slot: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for (name, value, step, _wall), slot_step in points:
        rows = by_slot[(slot_step, step)]
        row = next((r for r in rows if name not in r), None)
        if row is None:
            row = {STEP_KEY: step}
            rows.append(row)
        row[name] = value
    out = []
    for (slot_step, _step), rows in sorted(by_slot.items()):
        for row in rows:
            last_step = max(slot_step * STEP_SLOTS, last_step + 1)
            out.append({"_step": last_step, **row})
    return out, last_step


def slotted(part: Slice) -> list[tuple[Point, int]]:
    """Every point of ``part`` with the optimizer step whose slots it takes: its own, but
    the goodput parts (at the step reached, not begun yet) the last step done, so that a
    late point of that step still finds a slot below the next step, where a resume from
    this checkpoint rewinds to."""
    points = [(p, p[2]) for p in phase_points(part)]
    points += [(p, p[2]) for p in resource_points(part, GPU_NAMES, HOST_NAMES)]
    points += [(p, max(p[2] - 1, 0)) for p in goodput_points(part)]
    return points


def _reason(exc: BaseException) -> str:
    """An error as summary.log says it: its type and first line (some have no text)."""
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


class WandbExporter:
    """Points of one split into one W&B run (the sidecar's, found again on resume)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        # points of runs W&B finished: its ``Run.finish`` returned, so its own process
        # wrote them (the .wandb file, the server)
        self.exported = 0
        self.dropped = 0
        self.error: str | None = None
        self.failed_attempts = 0
        # points logged into the open run: ``Run.log`` returns once W&B's process was
        # handed them, not once it wrote them (a service that dies before the finish
        # loses them), so they are counted exported only at the run's finish
        self.awaiting = 0
        # of ``dropped``: logged into a run whose finish failed; W&B may hold some
        self._broken = 0
        self._run: Any = None  # wandb's Run
        self._session = -1  # the session the open run was opened for
        self._last_step = -1  # the last W&B step logged in the open run
        self._exit_code = 1
        self._where = "W&B (no run yet)"

    @property
    def unconfirmed(self) -> int:
        """Points logged into a run whose finish failed (W&B's process gone, its answer
        lost): its file or server may hold some of them."""
        return self._broken

    def where(self) -> str:
        """The run, its project, mode and file (W&B falls back to a folder of its own
        where the one asked for cannot be made)."""
        return self._where

    def pending(self) -> int:
        """Nothing is kept for a retry: W&B's own process takes the rows, a failure is
        counted (the logged ones wait for the run's finish in ``awaiting``)."""
        return 0

    def retry(self, now_mono: float) -> None:
        """Nothing to retry (see ``pending``)."""

    def export(self, part: Slice) -> None:
        """Log ``part``'s points (opening the run, or reopening it at a resumed session's
        first step): they await the run's finish (``awaiting``); a failure counts them as
        not exported."""
        points = slotted(part)
        try:
            session = max(part.first_steps, default=0)
            if self._run is None or session != self._session:
                self._open(part, session)
            rows, last = history_rows(points, self._last_step)
            for row in rows:
                step = row.pop("_step")
                self._run.log(row, step=step)
            self._last_step = last
        except Exception as exc:  # wandb raises its own errors and what the OS raised
            self.dropped += len(points)
            self.failed_attempts += 1
            self.error = _reason(exc)
        else:
            self.awaiting += len(points)
            self.error = None
        if part.final:
            self._exit_code = 0 if part.status == "completed" else 1

    def _open(self, part: Slice, session: int) -> None:
        """Open the split's run for ``session``: a new or continued run for the first
        session this exporter sees at step 0, W&B's rewind to the session's first step
        for a resumed one."""
        self._finish()
        first_step = part.first_steps.get(session, 0)
        ident = run_id(part.lineage, self.settings["split"])
        where = {
            "id": ident,
            "project": self.settings.get("wandb_project")
            or os.environ.get("WANDB_PROJECT")
            or part.out_dir.name,
            "dir": os.environ.get("WANDB_DIR") or str(part.split_dir),
            "name": self.settings["name"],
            "group": self.settings.get("wandb_group"),
            "reinit": "create_new",  # a daemon holds one run per split
            # W&B's own monitor would sample the sidecar, not the job; its console
            # capture would take the sidecar's log; its lines would reach the terminal
            "settings": wandb.Settings(
                silent=True, console="off", x_disable_stats=True, disable_code=True
            ),
        }
        self._run = None
        if first_step > 0:
            slot = first_step * STEP_SLOTS - 1
            try:
                self._run = wandb.init(**where, resume_from=f"{ident}?_step={slot}")
                self._last_step = slot
            except Exception:  # wandb's errors: a server without rewind refuses it
                # the run goes on without the rewind: the killed process's points after
                # the checkpoint stay, this session's come after them (none dropped)
                log.warning("W&B run %s: the rewind to step %d was refused", ident, slot)
        if self._run is None:
            self._run = wandb.init(**where, resume="allow")
            self._last_step = max(int(self._run.step) - 1, -1)
        for pattern in PREFIXES:
            self._run.define_metric(pattern, step_metric=STEP_KEY)
        self._session = session
        run = self._run
        self._where = (
            f"W&B run {run.id} in project {run.project} ({run.settings.mode}, "
            f"{run.settings.sync_file})"
        )

    def _finish(self) -> None:
        """Finish the open run: its logged points are exported once W&B's finish returned
        (it waits for W&B's process to write them), not confirmed when it failed; never
        raises."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=self._exit_code)
        except Exception as exc:  # wandb's errors, and the connection's to its process
            logged, self.awaiting = self.awaiting, 0
            self._broken += logged
            self.dropped += logged
            self.failed_attempts += 1
            self.error = _reason(exc)
            log.warning("W&B run %s: the finish failed (%s)", run.id, self.error)
        else:
            # taken from ``awaiting`` first: a count read meanwhile says less, never more
            logged, self.awaiting = self.awaiting, 0
            self.exported += logged

    def close(self) -> None:
        """Finish the run (exit code 0 for a completed split, 1 otherwise); its points
        are then exported, or not confirmed when the finish failed."""
        self._finish()
