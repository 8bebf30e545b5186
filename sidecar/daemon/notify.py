"""The sd_notify protocol (docs/contract.md, Node daemon), spoken by the node daemon itself: one
``AF_UNIX`` datagram per message to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract
namespace). Without ``NOTIFY_SOCKET`` nothing is sent, so the daemon behaves the same
outside systemd.

``SystemdNotifier`` plugs into the server's lifecycle hooks: READY=1 once the socket is
bound and the samplers are up (NVML opened or found unavailable: at most its 5 s bound),
a STATUS= line (runs, records/s) when it changes, WATCHDOG=1 every half
``WATCHDOG_USEC`` only while the loop turns and the samplers complete rounds (a hung
NVML call or a stuck loop stops the pings and systemd restarts the daemon), STOPPING=1
when the shutdown writing begins.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

from sidecar.daemon.snapshot import Snapshot

STATUS_EVERY_S = 1.0  # a STATUS= line at most this often (only when its text changed)


def stall_s_for(interval_s: float) -> float:
    """How old the samplers' last round may be before the daemon counts as stuck: two
    sampling periods, plus room for a loop turn that writes files."""
    return 2 * interval_s + 2.0


def notify(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (``KEY=VALUE`` lines) to ``$NOTIFY_SOCKET``; True when sent.

    False, with nothing sent, when the variable is unset or the socket cannot take it (a
    manager that went away must not stop the daemon). Never raises.
    """
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            # never wait: a manager that stops reading fills its queue (10 datagrams by
            # default), and a blocking send would then stop the loop for good
            sock.send(message.encode(), socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


def watchdog_period_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """How often to send WATCHDOG=1 (s): half of ``WATCHDOG_USEC`` when the watchdog is
    meant for this process (``WATCHDOG_PID`` unset or ours); None otherwise, also for an
    unset, malformed or zero value.
    """
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
        owner = int(environ.get("WATCHDOG_PID") or os.getpid())
    except ValueError:
        return None
    if usec <= 0 or owner != os.getpid():
        return None
    return usec / 2e6


def status_line(snapshot: Snapshot) -> str:
    """The STATUS= text for a snapshot: how many runs (and how many still running) and the
    record rate."""
    running = sum(1 for run in snapshot.runs if run.status == "running")
    return f"{len(snapshot.runs)} runs ({running} running), {snapshot.records_per_s:.0f} records/s"


class SystemdNotifier:
    """Lifecycle hooks (``ready``/``tick``/``stopping``/``stopped``) that speak sd_notify.

    ``stall_s``: the watchdog is fed only while the loop turned and the samplers completed
    a round within that many seconds (``stall_s_for`` gives it for a sampling interval).
    ``environ`` and ``clock`` (monotonic seconds, the snapshot's clock) are seams for tests.
    """

    def __init__(
        self,
        stall_s: float,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_s = stall_s
        self._environ = environ
        self._clock = clock
        self._watchdog_s = watchdog_period_s(environ)
        self._next_ping = 0.0
        self._next_status = 0.0
        self._status: str | None = None
        self._bound = False
        self._ready = False
        self._stopping = False

    def healthy(self, snapshot: Snapshot, now_mono: float) -> bool:
        """True when the loop turned and the samplers completed a round (or have not
        started one yet) within ``stall_s`` of ``now_mono``."""
        sampled = snapshot.sampler_round_monotonic
        return now_mono - snapshot.loop_monotonic <= self.stall_s and (
            sampled is None or now_mono - sampled <= self.stall_s
        )

    def ready(self, snapshot: Snapshot) -> None:
        """The socket is bound: READY=1 (with the first STATUS= line) now if the samplers
        are set up, else at the first loop turn where they are."""
        self._bound = True
        self.tick(snapshot)

    def tick(self, snapshot: Snapshot) -> None:
        """Each loop turn: READY=1 when it becomes true; after it, WATCHDOG=1 when due and
        healthy, STATUS= when due and changed. Nothing once stopping: the last tick (the
        state after the final writing) leaves STOPPING's status line in place."""
        if self._stopping:
            return
        if not self._ready:
            if not (self._bound and snapshot.samplers_started):
                return
            self._ready = True
            self._status = status_line(snapshot)
            self._next_status = self._clock() + STATUS_EVERY_S
            notify(f"READY=1\nSTATUS={self._status}", self._environ)
        now_mono = self._clock()
        if (
            self._watchdog_s is not None
            and now_mono >= self._next_ping
            and self.healthy(snapshot, now_mono)
        ):
            notify("WATCHDOG=1", self._environ)
            self._next_ping = now_mono + self._watchdog_s
        if now_mono >= self._next_status:
            self._next_status = now_mono + STATUS_EVERY_S
            text = status_line(snapshot)
            if text != self._status:
                self._status = text
                notify(f"STATUS={text}", self._environ)

    def stopping(self) -> None:
        """STOPPING=1: the shutdown writing begins."""
        self._stopping = True
        notify("STOPPING=1\nSTATUS=stopping: writing every run's files", self._environ)

    def stopped(self) -> None:
        """Nothing: STOPPING=1 was sent when the writing began; the exit tells the rest."""
