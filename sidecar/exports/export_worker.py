"""The exporters' thread and the facade the sidecar's loop calls (``Exports``).

The loop only hands over references (``feed.SplitFeed.take``) and puts them on a queue:
at each write of a split (checkpoint, end) and, between writes, every ``live_s`` while
it runs (``Exports.live``). Building points, writing event files and talking to a
tracking server happen on one background thread, so ingest never waits for an export.
An exporter that fails keeps what it could not send and is retried (``Exporter.retry``).
When the sidecar stops, new attempts go on for ``CLOSE_WAIT_S``, then a request under
way may still end or time out (``IN_FLIGHT_S``) and every exporter is closed (W&B's run
finished, which is what writes its points) before the points are counted: each split's
summary.log says, per exporter, the points exported, not confirmed (sent, no answer: the
store may hold them) and not exported (``Split.export_lines``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from sidecar import exports
from sidecar.exports.feed import LiveSamples, SplitFeed, resolve
from sidecar.exports.points import Slice
from sidecar.model.derived import SplitFigures
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceFigures

log = logging.getLogger("sidecar")

CLOSE_WAIT_S = 10.0  # at the sidecar's end, how long the exports may still take
# A private sidecar is stopped by its script 5 s after the script's end: its exports
# finish within this, or are counted as not exported.
PRIVATE_CLOSE_WAIT_S = 4.0
# After the close wait, how long a request under way may still take (MLflow's request
# bound, 5 s, and a margin); a private sidecar counts sooner, before its script stops it.
IN_FLIGHT_S = 6.0
PRIVATE_IN_FLIGHT_S = 0.5
IDLE_S = 0.5  # the thread's wake-up period for retries
LIVE_S = 5.0  # between writes, a running split's new points are handed over this often


class SampleSource(Protocol):
    """What the live hand-over reads of the resource monitor (``ResourceMonitor``)."""

    def live(self, split: Split) -> Any:
        """The split's running samples (``gpu_samples``, ``host_samples``), or None."""

    def session_starts_ns(self, split: Split) -> tuple[int, list[int]]:
        """The run's and each session's start on the monotonic clock (ns)."""


class Exporter(Protocol):
    """One tool's exporter for one split; called on the exports thread only."""

    exported: int  # points written so far (confirmed by the file system or the server)
    dropped: int  # points given up (their write failed for good)
    error: str | None  # the last failure, None once it worked again
    failed_attempts: int  # writes or requests that failed (their points kept or dropped)
    # points handed over whose write is confirmed later (W&B: at the run's finish); at
    # the end's count, those still waiting are not confirmed
    awaiting: int

    @property
    def unconfirmed(self) -> int:
        """Of the points kept (``pending``) or ``dropped``, those sent without an answer
        (a request under way, timed out, or broken once sent): the store may hold them."""

    def export(self, part: Slice) -> None:
        """Write the points of ``part``; what cannot be written is kept for ``retry``
        or counted in ``dropped``; never raises."""

    def pending(self) -> int:
        """Points kept for a retry."""

    def retry(self, now_mono: float) -> None:
        """Try the kept points again when their backoff allows (``now_mono``: monotonic s)."""

    def where(self) -> str:
        """Where the points go, in words (summary.log)."""

    def close(self) -> None:
        """Release files and clients; the pending points stay counted."""


Factory = Callable[[str, dict[str, Any]], Exporter]


def make_exporter(name: str, settings: dict[str, Any]) -> Exporter:
    """The exporter ``name`` (a key of ``exports.EXPORTERS``) with the split's settings;
    imports the tool's library (on the exports thread)."""
    if name == "tensorboard":
        from sidecar.exports.tensorboard import TensorBoardExporter

        return TensorBoardExporter(settings)
    if name == "wandb":
        from sidecar.exports.wandb import WandbExporter

        return WandbExporter(settings)
    from sidecar.exports.mlflow import MlflowExporter

    return MlflowExporter(settings)


class _Job:
    """One split's exporters, made on the thread at their first slice."""

    def __init__(self, split: Split, feed: SplitFeed) -> None:
        self.split = split
        self.feed = feed
        self.exporters: dict[str, Exporter] = {}
        self.written_lines: list[str] = []  # the export lines the last write put out
        self.not_started: dict[str, str] = {}  # exporter -> why it could not start
        self.closed: set[str] = set()  # exporters closed (at the split's end)


class Exports:
    """Every split's exports. ``default``: the sidecar's ``--export`` names (already
    checked); ``shared``: a daemon serving every user, which does not export (it would
    write as root into the users' folders and servers)."""

    def __init__(
        self,
        default: tuple[str, ...] = (),
        shared: bool = False,
        factory: Factory = make_exporter,
        close_wait_s: float = CLOSE_WAIT_S,
        live_s: float = LIVE_S,
        in_flight_s: float = IN_FLIGHT_S,
    ) -> None:
        self.default = default
        self.live_s = live_s  # 0: only at writes
        self.shared = shared
        self._factory = factory
        self._close_wait_s = close_wait_s
        self._in_flight_s = in_flight_s
        self._stop_at = float("inf")  # monotonic s: no new attempt after it (closing)
        self._feeds: dict[int, _Job] = {}  # id(split) -> its job
        # (job, None): make its exporters now (their libraries import while the run goes)
        self._queue: queue.Queue[tuple[_Job, Slice | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_live = 0.0  # monotonic s

    def hello(self, split: Split) -> str | None:
        """A run of ``split`` said hello (its info holds the hello's export fields): its
        exports are chosen once per split; returns the warning for the reply (None: none),
        which the run's ``start_run`` shows, the one place it is said."""
        if id(split) in self._feeds:
            return None
        info = split.info
        asked = info.get("export")
        names, warning = exports.choose(self.default if asked is None else asked)
        if names and self.shared:
            names = ()
            warning = "a shared daemon does not export (docs/exports.md); the run goes on"
        settings = {
            "name": f"{split.out_dir.name}-split-{split.split}",
            "split": split.split,
            "split_dir": split.split_dir,
            "tensorboard_dir": resolve(info.get("tensorboard_dir"), info.get("cwd")),
            "mlflow_experiment": info.get("mlflow_experiment") or split.out_dir.name,
            "mlflow_run_id": info.get("mlflow_run_id"),
            "mlflow_tracking_uri": info.get("mlflow_tracking_uri"),
            "wandb_project": info.get("wandb_project"),
            "wandb_group": info.get("wandb_group"),
        }
        job = self._feeds[id(split)] = _Job(split, SplitFeed(split, names, settings))
        if names:
            self._put(job, None)
        # The warning goes back in the reply, and the script's start_run shows it: said
        # here too, it would reach the same terminal twice (private sidecar, sidecar run).
        return warning

    def note_records(self, split: Split, rank: int, values: Any) -> None:
        """Records of one read (the step timeline); nothing for a split without exports."""
        job = self._feeds.get(id(split))
        if job is not None and job.feed.names:
            job.feed.note(split, rank, values)

    def written(
        self, split: Split, figures: ResourceFigures, derived: SplitFigures, with_state: bool
    ) -> None:
        """``split``'s files were written (``figures``: its resources; ``derived``: what it
        derived to for that write): hand what they added to the exports thread."""
        job = self._feeds.get(id(split))
        if job is None or not job.feed.names or self._closed:
            return
        job.written_lines = list(split.export_lines)
        part = job.feed.take(split, figures, derived.accounts, with_state)
        if part is not None:
            self._put(job, part)

    def live(self, now_mono: float, monitor: SampleSource) -> None:
        """Every ``live_s`` (``now_mono``: monotonic s), hand each running split's rows
        and samples new since the last hand-over to the exports thread, so that they are
        readable while it trains; skipped while the thread has not taken the last ones
        (a slow exporter gets bigger slices, never a growing queue)."""
        if not self.live_s or self._closed or now_mono < self._next_live:
            return
        self._next_live = now_mono + self.live_s
        if not self._queue.empty():
            return
        for job in list(self._feeds.values()):
            if not job.feed.names or job.feed.ended or job.split.end_unix is not None:
                continue
            running = monitor.live(job.split)
            run_start_ns, starts_ns = monitor.session_starts_ns(job.split)
            samples = LiveSamples(
                running.gpu_samples if running is not None else [],
                running.host_samples if running is not None else [],
                run_start_ns,
                starts_ns,
            )
            part = job.feed.take(job.split, samples, {}, False)
            if part is not None:
                self._put(job, part)

    def _put(self, job: _Job, part: Slice | None) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="exports", daemon=True)
            self._thread.start()
        self._queue.put((job, part))

    def forget(self, split: Split) -> None:
        """``split`` left the sidecar's memory: its feed goes (its exporters stay until the
        end, with their counts)."""
        job = self._feeds.get(id(split))
        if job is not None and not job.exporters:
            del self._feeds[id(split)]

    def close(self) -> list[Split]:
        """Let the exports go on trying up to the close wait, and a request under way end
        or time out and the exporters close (the in-flight wait), then count what is left;
        returns the splits whose summary lines changed since their last write (the caller
        writes them)."""
        self._closed = True
        if self._thread is None:
            return []
        self._stop_at = time.monotonic() + self._close_wait_s
        self._queue.put(None)
        self._thread.join(self._close_wait_s + self._in_flight_s)
        return self._counted()

    def _counted(self) -> list[Split]:
        """Count every split's exports for summary.log; the splits whose lines changed."""
        changed = []
        for job in list(self._feeds.values()):
            job.split.export_lines = _lines(job, final=True)
            if job.split.export_lines != job.written_lines:
                job.written_lines = list(job.split.export_lines)
                changed.append(job.split)
        return changed

    # -- the exports thread ------------------------------------------------------------

    def _work(self) -> None:
        stopping = False
        while time.monotonic() < self._stop_at:  # no new attempt after the close wait
            try:
                item = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                pass
            else:
                if item is None:
                    stopping = True
                else:
                    self._export(*item)
            # stopping: no backoff, the close wait bounds the tries
            now_mono = float("inf") if stopping else time.monotonic()
            for job in list(self._feeds.values()):
                for exporter in job.exporters.values():
                    if exporter.pending():
                        self._safely(exporter.retry, now_mono)
                job.split.export_lines = _lines(job)
            if stopping and self._queue.empty() and not self._pending():
                break
            if stopping and self._queue.empty():
                time.sleep(IDLE_S)  # retries until the close wait is over
        # Every exporter not closed yet (a split that did not end, a final slice the close
        # wait left queued) is closed now: W&B writes what was logged only at the run's
        # finish, and an exit that leaves the run open loses it.
        for job in list(self._feeds.values()):
            for name, exporter in list(job.exporters.items()):
                if name not in job.closed:
                    job.closed.add(name)
                    self._safely(exporter.close)
            job.split.export_lines = _lines(job)

    def _pending(self) -> int:
        return sum(e.pending() for j in self._feeds.values() for e in j.exporters.values())

    def _export(self, job: _Job, part: Slice | None) -> None:
        """Export ``part`` with each of ``job``'s exporters, made at their first use
        (``part`` None: only make them)."""
        for name in job.feed.names:
            exporter = job.exporters.get(name)
            if exporter is None:
                try:
                    exporter = job.exporters[name] = self._factory(name, job.feed.settings)
                except Exception as exc:  # a broken library must not stop the others
                    log.exception("cannot start the %s export", name)
                    reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                    job.not_started[name] = reason
                    continue
            if part is None:
                continue
            self._safely(exporter.export, part)
            if part.final and not exporter.pending():
                job.closed.add(name)
                self._safely(exporter.close)
        job.split.export_lines = _lines(job)

    @staticmethod
    def _safely(call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # an exporter must never stop the thread
            log.exception("export failed")


def _lines(job: _Job, final: bool = False) -> list[str]:
    """summary.log's lines on ``job``'s exports: per exporter, the points exported, those
    not confirmed (sent, no answer) and those not exported (given up or, at the end, left
    unsent); before the end, the points kept for a retry."""
    lines = [f"Export {name}: not started ({why})" for name, why in job.not_started.items()]
    for name, exporter in job.exporters.items():
        pending, dropped, unconfirmed = exporter.pending(), exporter.dropped, exporter.unconfirmed
        awaiting = exporter.awaiting
        missing = dropped + pending - unconfirmed if final else dropped
        text = f"Export {name}: {exporter.exported} points exported to {exporter.where()}"
        if final and unconfirmed + awaiting:
            # awaiting at the end: handed over, the confirmation (W&B's finish) not back
            text += (
                f"; {unconfirmed + awaiting} not confirmed"
                " (sent, no answer: the store may hold them)"
            )
        elif awaiting:
            text += f"; {awaiting} logged, counted once the run is finished"
        if missing:
            text += f"; {missing} not exported"
        elif pending and not final:
            text += f"; {pending} waiting for a retry"
        if exporter.error and (missing or pending or (final and unconfirmed)):
            text += f" ({exporter.error})"
        elif exporter.failed_attempts and not missing:
            text += f"; {exporter.failed_attempts} failed attempts, all retried"
        lines.append(text)
    return lines
