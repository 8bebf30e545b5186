"""The sidecar's event loop: reads the socket, dispatches controls, watches the training
processes, writes files on checkpoint, finish, death and shutdown.

One thread: ZeroMQ queues what arrives while the loop writes, and the loop wakes at least
every ``TICK_S`` to check signals, processes and retries, so it reacts within 2 s.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markers import wire
from sidecar import output
from sidecar.liveness import describe_exit, pid_alive
from sidecar.monitor import ResourceMonitor
from sidecar.receiver import Incoming, Receiver
from sidecar.registry import Refused, Registry, Stream
from sidecar.samplers import DEFAULT_INTERVAL_S
from sidecar.split import Split

log = logging.getLogger("sidecar")

TICK_S = 0.2
LIVENESS_S = 0.4  # a process found gone is declared dead on the next check
RETRY_S = 5.0  # a failed write is retried this often (and at every checkpoint/finish)
KEEP_ENDED_S = 600.0  # an ended split stays in memory (and in status) this long


@dataclass(frozen=True)
class Config:
    """How a sidecar serves: where it listens and where it may write."""

    endpoint: str
    root: Path | None = None  # None: a job's own sidecar, out_dir relative to the job's cwd
    owner_pid: int | None = None  # private sidecar: stop once this process is gone
    interval_s: float = DEFAULT_INTERVAL_S  # resource sampling period


class Server:
    """A running sidecar; ``run()`` returns the exit status for the command line."""

    def __init__(self, config: Config, child: subprocess.Popen[bytes] | None = None) -> None:
        self.config = config
        self.child = child
        own_job = config.root is None
        self.monitor = ResourceMonitor(
            config.interval_s, os.environ.get("CUDA_VISIBLE_DEVICES") if own_job else None,
            all_splits_share_gpus=own_job)
        self.registry = Registry(self._resolve_out_dir, self._on_stream, self._on_records)
        self.receiver = Receiver(config.endpoint, self.registry, self._run_alive)
        self._signal: int | None = None
        self._gone: dict[bytes, float] = {}  # run id -> when its process was first seen gone
        self._next_liveness = 0.0
        # (monotonic s, records received) every TICK_S: the status view's record rate
        self._rate_window: deque[tuple[float, int]] = deque([(time.monotonic(), 0)],
                                                            maxlen=int(10 / TICK_S))
        self._next_retry = 0.0

    # -- policy ---------------------------------------------------------------------

    def _resolve_out_dir(self, out_dir: str, cwd: str) -> Path:
        path = Path(out_dir)
        root = self.config.root
        if root is None:
            return (Path(cwd) / path).resolve()
        root = root.resolve()
        try:
            resolved = (root / path).resolve()  # follows symlinks and '..'
        except (OSError, ValueError) as exc:
            raise Refused(f"out_dir {out_dir!r} cannot be resolved: {exc}") from None
        if not resolved.is_relative_to(root):
            raise Refused(f"out_dir {out_dir!r} lies outside the daemon's root {root}")
        return resolved

    def _on_stream(self, stream: Stream) -> None:
        if stream.is_local():
            self.monitor.watch(stream.split, stream.pid)

    def _on_records(self, stream: Stream, values: array) -> None:
        self.monitor.note_records(stream.split, stream.rank, values)

    def _outside_root(self, split: Split) -> str | None:
        """Why ``split``'s folder may not be written now (a symlink put there since the
        run started points outside the root), or None.
        """
        root = self.config.root
        if root is None or split.split_dir.resolve().is_relative_to(root.resolve()):
            return None
        return f"{split.split_dir} now lies outside the daemon's root {root}; nothing written"

    def _run_alive(self, run_id: bytes) -> bool | None:
        stream = self.registry.streams.get(run_id)
        if stream is None or not stream.is_local():
            return None
        return pid_alive(stream.pid)

    # -- writing --------------------------------------------------------------------

    def records_lines(self, split: Split) -> list[str]:
        """The record counts of ``split`` for its summary."""
        streams = [s for s in self.registry.streams.values() if s.split is split]
        received = sum(s.received for s in streams) - sum(split.lost.values())
        lines = [f"Records: received {received}, dropped {sum(split.dropped.values())} (not "
                 f"sent), lost {sum(split.lost.values())} (sent, never received), rejected "
                 f"{split.rejected}"]
        if split.gpus:  # the markers' CUDA event pool ran dry or a device call failed
            not_measured = sum(agg.gpu_not_measured for agg in split.ranks.values())
            lines.append(f"GPU times not measured: {not_measured} phases")
        return lines

    def write(self, split: Split, with_state: bool = False) -> str | None:
        """Write ``split``'s files; returns the error text, None on success."""
        try:
            refusal = self._outside_root(split)
            if refusal:
                raise PermissionError(refusal)
            output.write_split(split, self.monitor.report(split, self.records_lines(split)),
                               with_state)
        except OSError as exc:
            # without the file name: it is a fresh temporary one at each try
            error = f"cannot write {split.split_dir}: {exc.strerror or exc}"
            if split.write_error != error:
                log.error("%s (data kept in memory, retried every %.0f s)", error, RETRY_S)
            split.write_error = self.registry.last_error = error
            return error
        return None

    def write_dirty(self) -> None:
        """Write every split that changed since its last successful write."""
        for split in self.registry.splits.values():
            if split.dirty:
                self.write(split)

    # -- messages -------------------------------------------------------------------

    def handle(self, message: Incoming, now: float) -> None:
        """Dispatch one decoded message."""
        if message.records is not None:
            self.registry.records(message.header, message.records, now)
            return
        body = message.control or {}
        try:
            reply = self._control(message.header, body, now)
        except wire.WireError as exc:
            self.registry.reject(exc.kind, str(exc))
            reply = {"ok": False, "error": str(exc)}
        except Refused as exc:
            self.registry.reject("refused", str(exc))
            self.registry.last_error = str(exc)
            reply = {"ok": False, "error": str(exc)}
        if "reply_to" in body and reply is not None:
            self.receiver.reply(message.identity, {"reply_to": body["reply_to"], **reply})

    def handle_safely(self, message: Incoming) -> None:
        """``handle``, with any error counted and logged: one bad message never stops the
        sidecar nor loses what it holds.
        """
        try:
            self.handle(message, time.time())
        except Exception as exc:  # the loop must survive anything
            log.exception("internal error on a message from run %s", message.header.run_id.hex())
            self.registry.reject("internal_error", repr(exc))
            body = message.control or {}
            if "reply_to" in body:  # a waiting client learns at once, not by its timeout
                self.receiver.reply(message.identity, {"reply_to": body["reply_to"],
                                                       "ok": False, "error": repr(exc)})

    def _control(self, header: wire.Header, body: dict[str, Any],
                 now: float) -> dict[str, Any] | None:
        kind = body["type"]
        if kind == "status":
            return {"ok": True, **self.status()}
        if kind == "hello":
            return self.registry.hello(header, body, now)
        stream = self.registry.stream_for(header, kind)
        if stream is None:
            return {"ok": False, "error": "unknown run: no hello received"}
        split = stream.split
        if kind == "phase":
            self.registry.declare_phase(stream, body)
        elif kind == "gpu":
            uuid, name = body.get("uuid"), body.get("name")
            if not isinstance(uuid, str) or not isinstance(name, str):
                raise wire.WireError("malformed", "gpu needs 'uuid' and 'name' strings")
            split.add_gpu(uuid, name)
            self.monitor.add_gpu(uuid)
        elif kind == "batch_size":
            which, value = body.get("kind"), body.get("value")
            if which not in ("train", "validation") or not isinstance(value, int) or value < 1:
                raise wire.WireError("malformed", "batch_size needs kind and a positive value")
            split.batch_sizes.setdefault(which, value)
        elif kind == "state":
            return self.registry.state_of(stream)
        elif kind == "load_state":
            return self.registry.load_state(stream, body.get("state"))
        elif kind == "checkpoint":
            return self._reply_written(split, with_state=True)
        elif kind == "finish":
            status = body.get("status")
            if status not in ("completed", "failed"):
                raise wire.WireError("malformed", "finish status must be completed or failed")
            end_ns = body.get("end_ns")
            error = body.get("error")
            self.registry.finish(stream, status, error if isinstance(error, str) else None,
                                 end_ns if isinstance(end_ns, int) else None, now)
            return self._reply_written(split)
        else:
            raise wire.WireError("unknown_control", f"control type {kind!r}")
        return None

    def _reply_written(self, split: Split, with_state: bool = False) -> dict[str, Any]:
        error = self.write(split, with_state)
        return {"ok": error is None, "error": error, "out_dir": str(split.out_dir)}

    def status(self) -> dict[str, Any]:
        """The status view: the registry's counts plus the server's own state: the record
        rate over the last ~10 s and whether each sampler is on."""
        now, records = time.monotonic(), self.registry.records_received
        then, before = self._rate_window[0]
        self._rate_window.append((now, records))
        gpu_off = self.monitor.gpu_off_reason
        return {**self.registry.status(), "endpoint": self.receiver.endpoint,
                "root": str(self.config.root) if self.config.root else None,
                "records_per_s": (records - before) / (now - then) if now > then else 0.0,
                "samplers": {"host": "on", "gpu": "on" if gpu_off is None else
                             f"off ({gpu_off})", "interval_s": self.config.interval_s}}

    # -- processes ------------------------------------------------------------------

    def _child_cause(self) -> str | None:
        if self.child is None or self.child.poll() is None:
            return None
        return "job " + describe_exit(self.child.returncode)

    def check_processes(self, now: float) -> None:
        """Declare incomplete every local run whose process is gone without finishing."""
        for stream in self.registry.live_streams():
            if not stream.is_local() or pid_alive(stream.pid):
                self._gone.pop(stream.run_id, None)
                continue
            first_seen = self._gone.setdefault(stream.run_id, now)
            if now - first_seen < LIVENESS_S:
                continue  # its last messages may still be on the way
            cause = self._child_cause() or f"process {stream.pid} ended without finish()"
            self._end_stream(stream, cause, now)

    def _end_stream(self, stream: Stream, cause: str, now: float) -> None:
        log.warning("run %s (pid %d): %s; files marked incomplete", stream.key, stream.pid,
                    cause)
        self.registry.finish(stream, "incomplete", cause, None, now)
        self.write(stream.split)

    def _should_stop(self) -> bool:
        if self._signal is not None and self.child is None:
            return True
        if self.child is not None:
            return self.child.poll() is not None
        owner = self.config.owner_pid
        return owner is not None and not pid_alive(owner)

    # -- loop -----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.child is not None and self.child.poll() is None:
            if self._signal == signum:  # asked twice: stop waiting for the job
                self.child = None
            else:
                self.child.send_signal(signum)
        self._signal = signum

    def tick(self, now: float) -> None:
        """The periodic work between reads: processes, held records, write retries."""
        if now >= self._next_liveness:
            self._next_liveness = now + TICK_S
            self.check_processes(now)
            self._rate_window.append((time.monotonic(), self.registry.records_received))
        self.registry.expire_pending(now)
        self.receiver.connections.poll()
        if now >= self._next_retry:
            self._next_retry = now + RETRY_S
            for split in self.registry.splits.values():
                if split.write_error and split.dirty:
                    self.write(split)
            for split in self.registry.prune(now, KEEP_ENDED_S):
                self.monitor.forget(split)

    def run(self) -> int:
        """Serve until stopped (signal, job or owner gone); write everything; return the
        exit status: the job's under ``sidecar run``, else 0.
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        log.info("listening on %s", self.receiver.endpoint)
        try:
            while not self._should_stop():
                wait_s = min(TICK_S, self.monitor.wait_s())
                for message in self.receiver.read(int(wait_s * 1000)):
                    self.handle_safely(message)
                self.monitor.tick()
                self.tick(time.time())
            self._drain()
            self._finalize()
        finally:
            self.receiver.close()
            self.monitor.close()
        if self.child is not None and self.child.returncode is not None:
            code = self.child.returncode
            return 128 - code if code < 0 else code
        return 128 + self._signal if self._signal is not None else 0

    def _drain(self) -> None:
        """Take what is still queued (a job's last records) before the final write."""
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            messages = self.receiver.read(50)
            if not messages:
                break
            for message in messages:
                self.handle_safely(message)

    def _finalize(self) -> None:
        now = time.time()
        cause = self._child_cause()  # the job's own end, also when a signal was forwarded
        if cause is None and self._signal is not None:
            cause = f"sidecar stopped by {signal.Signals(self._signal).name}"
        cause = cause or "the training process is gone"
        for stream in self.registry.live_streams():
            self._end_stream(stream, cause, now)
        self.write_dirty()
        pending = [s.write_error for s in self.registry.splits.values() if s.dirty]
        for error in pending:
            log.error("exiting with unwritten data: %s", error)


def serve(config: Config, command: list[str] | None = None) -> int:
    """Run a sidecar; with ``command``, start it with SIDECAR_ENDPOINT set and return its
    exit status once it ended and everything is written.
    """
    server = Server(config)
    if command:
        env = {**os.environ, "SIDECAR_ENDPOINT": server.receiver.endpoint}
        try:
            server.child = subprocess.Popen(command, env=env, process_group=0)
        except OSError as exc:
            server.receiver.close()
            log.error("cannot start %s: %s", command[0], exc)
            return 127
    return server.run()
