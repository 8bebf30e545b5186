"""The sidecar's event loop: reads the socket and hands what came to ``Messages``
(messages.py), has ``RunEndings`` (run_endings.py) end the runs whose process is gone,
``SplitWrites`` (split_writes.py) write files on checkpoint, finish, death, retry and
shutdown, and publishes a snapshot of itself every ``TICK_S`` for the lifecycle hooks.

One thread: ZeroMQ queues what arrives while the loop writes, and the loop wakes at least
every ``TICK_S`` to check signals, processes and retries, so it reacts within 2 s.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.daemon import nodes_wait
from sidecar.daemon import snapshot as snapshots
from sidecar.daemon.access import Access, claim_split
from sidecar.daemon.child_job import DEFAULT_NICE, Job, lower_priority
from sidecar.daemon.derivations import Derivations
from sidecar.daemon.dispatch import Dispatcher
from sidecar.daemon.heap import Heap, glibc
from sidecar.daemon.lifecycle import Lifecycle
from sidecar.daemon.liveness import gone_cause, pid_alive
from sidecar.daemon.messages import Messages
from sidecar.daemon.ownership import Owners
from sidecar.daemon.run_endings import RunEndings
from sidecar.daemon.snapshot import Snapshot
from sidecar.daemon.split_writes import RETRY_S, SplitWrites
from sidecar.daemon.viewers import ALL, Viewers
from sidecar.exports import export_worker
from sidecar.exports.export_worker import Exports
from sidecar.ingest.peers import Peer
from sidecar.ingest.receiver import HEARTBEAT_S, Receiver
from sidecar.ingest.stream import Stream
from sidecar.ingest.streams import Registry
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor
from sidecar.resources.samplers import DEFAULT_INTERVAL_S
from sidecar.resources.samplers.nvml import open_nvml
from sidecar.sinks import layout, resources_text, run_file
from sidecar.sinks.atomic import WriteBytes

log = logging.getLogger("sidecar")

TICK_S = 0.2
KEEP_ENDED_S = 600.0  # an ended split stays in memory (and in status) this long
RATE_WINDOW_S = 10.0  # the status view's record rate is the mean over this trailing window
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
__all__ = ["DEFAULT_NICE", "Config", "Server", "serve"]  # DEFAULT_NICE: the command line's


@dataclass(frozen=True)
class Config:
    """How a sidecar serves: where it listens and where it may write."""

    endpoint: str
    root: Path | None = None  # None: a job's own sidecar, out_dir relative to the job's cwd
    owner_pid: int | None = None  # private sidecar: stop once this process is gone
    interval_s: float = DEFAULT_INTERVAL_S  # resource sampling period
    secret: str | None = None  # serve only clients holding it (a job's own sidecar)
    heartbeat_s: float = HEARTBEAT_S  # a silent remote client is dropped after this long
    # One daemon for every local user (root, ipc): the kernel names each connection's
    # user, whose runs go under root/<user>/ and are written as that user.
    shared: bool = False
    # Shared: roots under which a job's own folder is written in place (as its user).
    allowed: tuple[Path, ...] = ()
    nice: int = DEFAULT_NICE  # added to the sidecar's CPU niceness (0: same as the job)
    # Serving rank 0 of a split whose other ranks other sidecars serve: how long its end
    # waits for their final figures (docs/multi-node.md).
    nodes_wait_s: float = nodes_wait.DEFAULT_NODES_WAIT_S
    # the exports of a run that does not choose (``--export``; docs/exports.md)
    export: tuple[str, ...] = ()
    export_every_s: float = (
        export_worker.LIVE_S
    )  # between writes, live exports this often (0: none)


class Server:
    """A running sidecar; ``run()`` returns the exit status for the command line.

    Test seams are constructor parameters: ``open_gpus`` opens NVML (a fake on machines
    without a GPU), ``write_bytes`` puts bytes into an open file (a fake full disk), and
    ``hooks`` receive the lifecycle calls (sd_notify, exporters), ``viewers`` who sees which
    runs in ``/metrics`` (the exporter's), ``heap`` the allocator's settings
    (``sidecar.daemon.heap``: kept while records flow, given back when they pause).
    ``job`` is the job of
    ``sidecar run`` once started (``serve``): the sidecar stops when it ends.
    """

    def __init__(
        self,
        config: Config,
        *,
        hooks: Sequence[Lifecycle] = (),
        open_gpus: Callable[..., Any] = open_nvml,
        write_bytes: WriteBytes | None = None,
        viewers: Viewers | None = None,
        heap: Heap | None = None,
    ) -> None:
        self.config = config
        self.heap = heap if heap is not None else Heap(glibc())
        self.job: Job | None = None
        self.hooks = list(hooks)
        self.access = Access(config.root, config.shared, viewers, config.allowed)
        # run id -> its user and token; a shared daemon keeps them across restarts
        self.owners = Owners(config.root if config.shared else None)
        self.registry = Registry(
            self.access.policy.resolve,
            self._on_stream,
            self._on_records,
            run_file.previous_activity,
            claim_split,
            lambda stream: not stream.is_local() or pid_alive(stream.pid),
        )
        # Bound first: an endpoint that cannot be served is refused before anything starts.
        self.receiver = Receiver(
            config.endpoint,
            self.registry,
            lambda run_id: self.endings.connection_lost(run_id, time.time()),
            config.secret,
            config.heartbeat_s,
            shared=config.shared,
        )
        own_job = config.root is None
        self.monitor = ResourceMonitor(
            config.interval_s,
            os.environ.get("CUDA_VISIBLE_DEVICES") if own_job else None,
            all_splits_share_gpus=own_job,
            open_gpus=open_gpus,
            private=config.owner_pid is not None,  # one rank's: only the GPUs it uses
        )
        # each split's derived figures: afresh at each write, throttled for the snapshot
        self.derivations = Derivations()
        private = config.owner_pid is not None  # stopped by its script soon after its end
        self.exports = Exports(
            config.export,
            config.shared,
            close_wait_s=export_worker.PRIVATE_CLOSE_WAIT_S
            if private
            else export_worker.CLOSE_WAIT_S,
            live_s=config.export_every_s,
            in_flight_s=export_worker.PRIVATE_IN_FLIGHT_S if private else export_worker.IN_FLIGHT_S,
        )
        self.writes = SplitWrites(
            self.registry,
            self.access,
            self.monitor,
            self.derivations,
            self.exports,
            self.heap,
            config.nodes_wait_s,
            lambda what: self.messages.progress(what),
            write_bytes,
        )
        # A run's end (by its finish, found dead, its job ended) is written through
        # ``_write``, which shows the end to the hooks before the slow final write.
        self.endings = RunEndings(self.registry, self.access, self._write, config.heartbeat_s)
        self.dispatcher = Dispatcher(
            self.registry, self.monitor, self._write, self.status_for, self.endings.finish_job
        )
        self.messages = Messages(
            self.registry,
            self.access,
            self.owners,
            self.receiver,
            self.exports,
            self.dispatcher,
            self.endings.sent_away,
        )
        self._signal: int | None = None
        self._next_liveness = 0.0
        # (monotonic s, records received) every TICK_S: the status view's record rate
        self._rate_window: deque[tuple[float, int]] = deque(
            [(time.monotonic(), 0)], maxlen=int(RATE_WINDOW_S / TICK_S) + 1
        )
        self._next_retry = 0.0
        self.nodes = nodes_wait.NodesWork(
            config.nodes_wait_s, self.writes.write, self.writes.write_node_file
        )
        self._next_publish = 0.0  # monotonic s
        self.snapshot = self.publish()
        self._handed: Snapshot | None = None  # the last snapshot the hooks were given

    def _on_stream(self, stream: Stream) -> None:
        if not stream.is_local():
            return
        self.endings.deaths.watch(stream.run_id, stream.pid)
        split = stream.split
        agg = split.ranks.get(0)
        if self.monitor.watch(split, stream.pid) and agg is not None and len(agg.sessions) > 1:
            # A resume under a sidecar that did not see the earlier sessions: their samples
            # come back from the folder, so the resources cover every session.
            run_start_ns, _ = self.monitor.session_starts_ns(split)
            self.monitor.restore(
                split,
                *resources_text.read_samples(
                    split.logs_dir / layout.RESOURCES_FILE, run_start_ns, agg.sessions[-1].number
                ),
            )

    def _on_records(self, stream: Stream, values: np.ndarray) -> None:
        self.monitor.note_records(stream.split, stream.rank, values)
        self.exports.note_records(stream.split, stream.rank, values)

    # -- the published view ---------------------------------------------------------

    def publish(self) -> Snapshot:
        """Take and publish the snapshot of this moment (loop thread only)."""
        self.snapshot = snapshots.take(
            self.registry,
            self.monitor,
            self.receiver.endpoint,
            self.config.root,
            self.config.interval_s,
            self._rate_window[0],
            self.derivations,
            self.access.job_ids.dropped,
        )
        return self.snapshot

    def status_for(self, caller: Peer | None, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The status view for ``caller``: on a shared daemon a user other than root sees
        only their own runs (the counts stay the daemon's). ``body`` (the status control):
        ``splits`` adds every split's figures it may see (``sidecar top``); a ``token`` the
        /metrics scrapes use (the admin's, a user's) shows what such a scrape sees."""
        body = body or {}
        snapshot = self.publish()
        view = snapshot.as_status()
        token = body.get("token")
        viewer = self.access.viewers.viewer(f"Bearer {token}") if token else None

        def sees(user: str | None) -> bool:
            by_token = viewer is not None and viewer in (ALL, user)
            return by_token or self.access.may_see(caller, user)

        view["runs"] = [run for run in view["runs"] if sees(run["user"])]
        if body.get("splits"):
            view["splits"] = [asdict(s) for s in snapshot.splits if sees(s.user)]
        return view

    def _publish_for_hooks(self) -> None:
        """Publish and hand the snapshot to the hooks. A snapshot that cannot be taken is
        logged and the hooks are skipped (no watchdog ping: a service manager restarts a
        daemon stuck that way), but the loop goes on and the runs' files are still written.
        """
        try:
            snapshot = self.publish()
        except Exception:  # the loop must survive anything
            log.exception("cannot publish the snapshot; lifecycle hooks skipped this turn")
            return
        self._handed = snapshot
        self._call_hooks("tick", snapshot)

    def _write(self, split: Split, with_state: bool = False) -> str | None:
        """Write ``split``'s files (``SplitWrites.write``: the error text, None on
        success), first handing the hooks a snapshot with its end when the last one they
        got shows it running: a final write takes seconds on a busy machine, and /metrics
        must not go on saying "running" for a run that ended (a report from Prometheus
        would take the last running scrape's time as its end)."""
        if split.end_unix is not None and not self._end_handed(split):
            self._publish_for_hooks()
        return self.writes.write(split, with_state)

    def _end_handed(self, split: Split) -> bool:
        """Whether the last snapshot handed to the hooks has ``split``'s end."""
        handed = self._handed
        if handed is None:
            return False
        folder = str(split.out_dir)
        return any(
            view.folder == folder and view.split == split.split and view.end_unix is not None
            for view in handed.splits
        )

    def _call_hooks(self, method: str, *args: Any) -> None:
        for hook in self.hooks:
            try:
                getattr(hook, method)(*args)
            except Exception:  # a hook must never stop the sidecar
                log.exception("lifecycle hook %s.%s failed", type(hook).__name__, method)

    # -- processes ------------------------------------------------------------------

    def _job_cause(self) -> str | None:
        return self.job.cause() if self.job is not None else None

    def _should_stop(self) -> bool:
        if self._signal is not None and self.job is None:
            return True
        if self.job is not None:
            return self.job.ended()
        owner = self.config.owner_pid
        return owner is not None and not pid_alive(owner)

    # -- loop -----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.job is not None and not self.job.ended():
            if self.job.got_it_too(signum):
                return  # the job got it too (Ctrl-C in pdb is its own); we wait for its end
            if self._signal == signum:  # asked twice: stop waiting for the job
                self.job = None
            else:
                self.job.send(signum)
        self._signal = signum

    def tick(self, now_unix: float) -> None:
        """The periodic work between reads: processes, held records, write retries."""
        if now_unix >= self._next_liveness:
            self._next_liveness = now_unix + TICK_S
            self.endings.check_processes(now_unix, self._job_cause())
            self.nodes.tick(self.registry.splits.values(), now_unix)
            self._rate_window.append((time.monotonic(), self.registry.records_received))
        self.registry.expire_pending(now_unix)
        self.receiver.connections.poll()
        if now_unix >= self._next_retry:
            self._next_retry = now_unix + RETRY_S
            self.writes.retry()
            for split in self.registry.prune(now_unix, KEEP_ENDED_S):
                self.monitor.forget(split)
                self.derivations.forget(split)
                self.exports.forget(split)
            self.endings.deaths.retain(self.registry.streams)
            self.owners.forget(self.registry.streams, now_unix, KEEP_ENDED_S)

    def turn(self) -> None:
        """One turn of the loop: read what came (waiting at most until the next sampling
        round, or TICK_S), take in the GPU readings that are back and start a round when
        due (never waiting for a GPU), the periodic work, the hooks' snapshot."""
        wait_s = min(TICK_S, self.monitor.wait_s())
        # Rounded up: a wait of 0.4 ms read as 0 would spin until the round is due.
        messages = self.receiver.read(math.ceil(wait_s * 1000))
        if messages:
            self.heap.used()
            self.messages.handle_all(messages)
        else:  # nothing came in the wait: the pages the reads kept go back
            self.heap.give_back()
        self.monitor.tick()
        self.tick(time.time())
        self.exports.live(time.monotonic(), self.monitor)
        # At most every TICK_S: under a stream of small messages the loop turns
        # thousands of times a second, and a snapshot costs a walk of every split.
        now_mono = time.monotonic()
        if now_mono >= self._next_publish:
            self._next_publish = now_mono + TICK_S
            self._publish_for_hooks()

    def run(self) -> int:
        """Serve until stopped (signal, job or owner gone); write everything; return the
        exit status: the job's under ``sidecar run``, else 0.
        """
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        log.info("listening on %s", self.receiver.endpoint)
        self._handed = self.publish()
        self._call_hooks("ready", self._handed)
        try:
            while not self._should_stop():
                self.turn()
            self._call_hooks("stopping")
            self._drain()
            self._finalize()
            for split in self.exports.close():  # summary.log says what was not exported
                self.writes.write(split)
            # The state after the final writing (each run's end and status), then the end:
            # an exporter serves until ``stopped``, so its last scrape is the final state.
            self._publish_for_hooks()
            self._call_hooks("stopped")
        finally:
            self.receiver.close()
            self.monitor.close()
            self.endings.deaths.close()
        status = self.job.exit_status() if self.job is not None else None
        if status is not None:
            return status
        return 128 + self._signal if self._signal is not None else 0

    def _drain(self) -> None:
        """Take what is still queued (a job's last records) before the final write."""
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            messages = self.receiver.read(50)
            if not messages:
                break
            self.messages.handle_all(messages)

    def _finalize(self) -> None:
        now_unix = time.time()
        cause = self._job_cause()  # the job's own end, also when a signal was forwarded
        owner = self.config.owner_pid
        if cause is None and owner is not None and not pid_alive(owner):
            cause = gone_cause(owner)
        if cause is None and self._signal is not None:
            cause = f"sidecar stopped by {signal.Signals(self._signal).name}"
            # The runs go on without us: leave the state a checkpoint leaves, taken
            # before their sessions are cut, so the next sidecar continues each of them
            # and only the time between the two is lost.
            for split in {id(s.split): s.split for s in self.registry.live_streams()}.values():
                self.writes.write(split, with_state=True)
        for stream in self.registry.live_streams():
            self.endings.end_stream(stream, cause or gone_cause(stream.pid), now_unix)
        self.nodes.wait(list(self.registry.splits.values()), TICK_S)
        self.writes.write_dirty()
        for split in self.registry.splits.values():
            if split.dirty:
                runs = sorted({s.key for s in self.registry.streams.values() if s.split is split})
                log.error(
                    "exiting with unwritten data: run %s (%s, split %d) was not written: %s",
                    ", ".join(runs) or "?",
                    split.out_dir,
                    split.split,
                    split.write_error or "unknown error",
                )


def serve(config: Config, command: list[str] | None = None, **seams: Any) -> int:
    """Run a sidecar; with ``command``, start it with SIDECAR_ENDPOINT (and
    SIDECAR_SECRET, when ``config`` has one) set and return its exit status once it ended
    and everything is written. ``seams`` go to ``Server`` (hooks, open_gpus, write_bytes,
    heap).

    Attached to a terminal (stdin is one), the job shares our process group
    (``sidecar.daemon.child_job``). Raises EndpointError when the endpoint cannot be served (the
    job is then not started). The sidecar lowers its own CPU priority by ``config.nice``
    after starting ``command``, which keeps the priority it was given.
    """
    server = Server(config, **seams)
    if command:
        try:
            server.job = Job.start(
                command, server.receiver.endpoint, config.secret, shares_group=os.isatty(0)
            )
        except OSError as exc:
            server.receiver.close()
            log.error("cannot start %s: %s", command[0], exc)
            # The shell's convention: 126 for a command found but not executable
            # (permission denied, not an executable format), 127 for one not found.
            return 127 if isinstance(exc, FileNotFoundError) else 126
    lower_priority(config.nice)
    server.heap.keep()
    return server.run()
