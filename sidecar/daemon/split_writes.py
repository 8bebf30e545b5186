"""A split's files written from the sidecar's loop: derived afresh, laid out by the
writers, as the run's user on a shared daemon; a failed write kept in memory, said once
and retried, and an ended split's run.json written alone when the rest does not fit."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sidecar.daemon import nodes_wait
from sidecar.daemon.access import Access
from sidecar.daemon.derivations import Derivations
from sidecar.daemon.heap import Heap
from sidecar.exports.export_worker import Exports
from sidecar.ingest.peers import Peer
from sidecar.ingest.streams import Registry
from sidecar.model.derived import own_figures
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor
from sidecar.sinks import layout, writer
from sidecar.sinks.atomic import WriteBytes
from sidecar.sinks.nodes import HOSTNAME, NODE_ID

log = logging.getLogger("sidecar")

RETRY_S = 5.0  # a failed write is retried this often (and at every checkpoint/finish)


class SplitWrites:
    """Writes splits' files for the loop. ``progress(what)`` is told as each file of a
    write is done (the loop passes it on to a client waiting for that write);
    ``write_bytes`` puts bytes into an open file (a test's full disk)."""

    def __init__(
        self,
        registry: Registry,
        access: Access,
        monitor: ResourceMonitor,
        derivations: Derivations,
        exports: Exports,
        heap: Heap,
        nodes_wait_s: float,
        progress: Callable[[str], None],
        write_bytes: WriteBytes | None = None,
    ) -> None:
        self.registry = registry
        self.access = access
        self.monitor = monitor
        self.derivations = derivations
        self.exports = exports
        self.heap = heap
        self.nodes_wait_s = nodes_wait_s
        self._progress = progress
        self._write_bytes = write_bytes

    def _owner(self, split: Split) -> Peer | None:
        """The user whose runs feed ``split`` (the kernel's word; None when unknown)."""
        return next((s.owner for s in self.registry.streams.values() if s.split is split), None)

    def write(self, split: Split, with_state: bool = False) -> str | None:
        """Write ``split``'s files (on a shared daemon as the run's user); returns the
        error text, None on success."""
        owner = self._owner(split)
        nodes_wait.settle(split, time.time(), self.nodes_wait_s)
        self.heap.used()  # a write's tables are megabytes too: given back when idle
        try:
            refusal = self.access.write_refusal(split.split_dir, owner)
            if refusal:
                raise PermissionError(refusal)
            self.monitor.final_round(split)
            writer.load_modules()  # with the daemon's own identity, see there
            resources = self.monitor.figures(split)
            with self.access.acting(owner):  # other nodes' files are read as the user
                figures, others = self.derivations.at_write(split, resources)
                writer.write_split(
                    split,
                    figures,
                    resources,
                    split.record_counts(),
                    with_state,
                    self._write_bytes,
                    self._progress,
                    others,
                )
        except OSError as exc:
            # without the file name: it is a fresh temporary one at each try
            error = f"cannot write {split.split_dir}: {exc.strerror or exc}"
            if split.write_error != error:
                log.error("%s (data kept in memory, retried every %.0f s)", error, RETRY_S)
            split.write_error = self.registry.last_error = error
            if split.end_unix is not None:
                self._write_status_only(split, owner)
            return error
        self.exports.written(split, resources, figures, with_state)
        if split.end_unix is not None and not nodes_wait.waiting(split):
            self.registry.release(split)  # ended and written: another run may take it now
        return None

    def write_node_file(self, split: Split) -> None:
        """Refresh this sidecar's node file of ``split``, whose other ranks other sidecars
        serve (docs/multi-node.md); a failure waits for the next full write to say it."""
        owner = self._owner(split)
        if self.access.write_refusal(split.split_dir, owner):
            return
        try:
            resources = self.monitor.figures(split)
            own = own_figures(split, NODE_ID, HOSTNAME, resources.gpu_readings)
            with self.access.acting(owner):
                writer.write_node_file(split, own, resources, split.record_counts())
        except OSError as exc:
            log.debug("node file of %s not refreshed: %s", split.split_dir, exc)

    def _write_status_only(self, split: Split, owner: Peer | None) -> None:
        """An ended split whose files did not fit: its run.json alone (small), so that it
        says how the run ended rather than ``running``; the rest is retried."""
        try:
            with self.access.acting(owner):
                figures = self.derivations.latest(split)
                if figures is None:  # the write failed before deriving them
                    figures, _ = self.derivations.at_write(split, self.monitor.figures(split))
                writer.write_run_file(split, figures, split.record_counts(), self._write_bytes)
        except OSError as exc:
            log.error(
                "cannot write %s either: %s", split.out_dir / layout.RUN_FILE, exc.strerror or exc
            )

    def write_dirty(self) -> None:
        """Write every split that changed since its last successful write."""
        for split in self.registry.splits.values():
            if split.dirty:
                self.write(split)

    def retry(self) -> None:
        """Write again each split whose last write failed and that holds unwritten data."""
        for split in self.registry.splits.values():
            if split.write_error and split.dirty:
                self.write(split)
