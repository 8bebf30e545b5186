"""When a training process on this host died, to the millisecond: the moment bounds the
work a crash lost (the redone work of a resume) and starts the downtime after it.

A process killed by SIGKILL (or the out-of-memory killer) sends nothing more, and its
last records, still in the markers' buffer, die with it: its last record can be seconds
before its death. The liveness check (``pid_alive`` every ``TICK_S``) tells it is gone,
not when. Here one thread waits on a pidfd per watched process (Linux 5.3+,
``os.pidfd_open``) and notes the wall-clock time each one becomes readable: the process
has exited. Without pidfds, ``died_at`` knows nothing and the caller keeps its bound.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Collection

log = logging.getLogger("sidecar")

_STOP = -1  # queued instead of a pid: the thread ends


class DeathWatch:
    """Notes when watched processes die. ``watch`` and ``died_at`` are for the server's
    loop; the waiting thread starts with the first ``watch``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[tuple[bytes, int]] = []  # (key, pid) for the thread to take
        self._died: dict[bytes, float] = {}  # key -> Unix s
        self._wake_r = self._wake_w = -1  # a pipe that wakes the thread, made with it
        self._thread: threading.Thread | None = None

    def watch(self, key: bytes, pid: int) -> None:
        """Note the death time of process ``pid`` under ``key`` (a run id)."""
        if not hasattr(os, "pidfd_open"):
            return
        with self._lock:
            self._queued.append((key, pid))
        if self._thread is None:
            self._wake_r, self._wake_w = os.pipe()
            self._thread = threading.Thread(target=self._run, name="sidecar-deaths", daemon=True)
            self._thread.start()
        os.write(self._wake_w, b"\0")

    def died_at(self, key: bytes) -> float | None:
        """When the process watched under ``key`` died (Unix s); None while it lives, or
        when unknown (not watched, no pidfd)."""
        with self._lock:
            return self._died.get(key)

    def forget(self, key: bytes) -> None:
        """Drop what is known of ``key`` (its run was ended)."""
        with self._lock:
            self._died.pop(key, None)

    def retain(self, keys: Collection[bytes]) -> None:
        """Forget the deaths of every key not in ``keys`` (runs no longer known)."""
        with self._lock:
            self._died = {k: v for k, v in self._died.items() if k in keys}

    def close(self) -> None:
        """Stop the thread and close the descriptors."""
        if self._thread is None:
            return
        with self._lock:
            self._queued.append((b"", _STOP))
        os.write(self._wake_w, b"\0")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._thread = None

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watched: dict[int, bytes] = {}  # pidfd -> key
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                now = time.time()
                poller.unregister(fd)
                os.close(fd)
                with self._lock:
                    self._died[watched.pop(fd)] = now
            with self._lock:
                queued, self._queued = self._queued, []
            for key, pid in queued:
                if pid == _STOP:
                    for fd in watched:
                        os.close(fd)
                    return
                try:
                    fd = os.pidfd_open(pid)
                except OSError as exc:  # gone already, or pidfds refused: the caller's bound
                    log.debug("cannot watch process %d: %s", pid, exc)
                    continue
                watched[fd] = key
                poller.register(fd, select.POLLIN)
