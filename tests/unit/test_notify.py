"""sd_notify (sidecar.daemon.notify) against a real AF_UNIX datagram socket, as systemd
would hold it: path and abstract addresses, the watchdog's owner rule, and the notifier's
lifecycle: READY, STATUS, WATCHDOG only while the loop and the samplers make progress,
STOPPING.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.daemon.notify import SystemdNotifier, notify, watchdog_period_s
from sidecar.daemon.snapshot import RunView, Snapshot
from tests.support.snapshots import snapshot


class Manager:
    """The service manager's end: a bound datagram socket that collects messages."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)

    def messages(self) -> list[str]:
        """Every datagram received so far."""
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Manager]:
    sock = Manager(str(tmp_path / "notify"))
    yield sock
    sock.sock.close()


def Snap(
    loop_monotonic: float,
    sampler_round_monotonic: float | None,
    statuses: tuple[str, ...] = (),
    records_per_s: float = 0.0,
    started: bool = True,
) -> Snapshot:
    """A daemon snapshot with these times, runs of these statuses, this rate, samplers
    set up or not."""
    runs = tuple(
        RunView(f"{i:032x}", "/r", 0, 0, 1, "h", 0, status, None, None, None)
        for i, status in enumerate(statuses)
    )
    return snapshot(
        loop_monotonic=loop_monotonic,
        sampler_round_monotonic=sampler_round_monotonic,
        samplers_started=started,
        records_per_s=records_per_s,
        runs=runs,
    )


def test_path_socket_gets_the_datagram(manager: Manager, tmp_path: Path) -> None:
    assert notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert manager.messages() == ["READY=1"]


def test_abstract_socket_gets_the_datagram() -> None:
    name = f"trainmon-test-{os.getpid()}"
    manager = Manager("\0" + name)
    try:
        assert notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert manager.messages() == ["WATCHDOG=1"]
    finally:
        manager.sock.close()


def test_nothing_is_sent_without_notify_socket(manager: Manager) -> None:
    assert not notify("READY=1", {})
    notifier = SystemdNotifier(5.0, {"WATCHDOG_USEC": "1000000"})
    notifier.ready(Snap(0.0, None))
    notifier.stopping()
    assert manager.messages() == []


def test_a_vanished_manager_is_not_an_error(tmp_path: Path) -> None:
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody")})


def test_a_manager_that_stops_reading_never_blocks_the_daemon(manager: Manager) -> None:
    """The kernel queues a few datagrams (net.unix.max_dgram_qlen, 10 by default); past
    them a blocking send would wait for ever. The daemon's sends are dropped instead."""
    environ = {"NOTIFY_SOCKET": str(manager.sock.getsockname())}
    start = time.monotonic()
    sent = [notify("WATCHDOG=1", environ) for _ in range(200)]
    assert time.monotonic() - start < 5
    assert sent[0] and not all(sent)  # the first ones queued, the rest dropped


@pytest.mark.parametrize(
    ("environ", "period_s"),
    [
        ({"WATCHDOG_USEC": "1000000"}, 0.5),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_period_honours_the_owner(environ: dict[str, str], period_s: float | None) -> None:
    assert watchdog_period_s(environ) == period_s


def test_lifecycle_pings_only_while_loop_and_samplers_progress(
    manager: Manager, tmp_path: Path
) -> None:
    now = [100.0]
    environ = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000"}
    notifier = SystemdNotifier(2.0, environ, clock=lambda: now[0])
    running = ("running", "completed")
    notifier.ready(Snap(100.0, None, running, 1234.4))
    assert manager.messages() == [
        "READY=1\nSTATUS=2 runs (1 running), 1234 records/s",
        "WATCHDOG=1",
    ]
    now[0] = 100.3  # not due yet (every 0.5 s)
    notifier.tick(Snap(100.3, 100.0, running, 1234.0))
    assert manager.messages() == []
    now[0] = 100.6
    notifier.tick(Snap(100.6, 100.0, running, 1234.0))
    assert manager.messages() == ["WATCHDOG=1"]
    now[0] = 103.0  # the samplers' last round is 3 s old: stuck, no ping
    notifier.tick(Snap(103.0, 100.0, running, 10.0))
    assert manager.messages() == ["STATUS=2 runs (1 running), 10 records/s"]
    now[0] = 103.2  # the loop's last turn is 3 s old: stuck, no ping
    notifier.tick(Snap(100.2, 103.1, running, 10.0))
    assert manager.messages() == []
    now[0] = 103.4  # both move again: pings resume at once
    notifier.tick(Snap(103.4, 103.3, running, 10.0))
    assert manager.messages() == ["WATCHDOG=1"]
    notifier.stopping()
    assert manager.messages()[0].startswith("STOPPING=1\n")
    now[0] = 110.0  # the tick with the state after the final writing: STOPPING stays said
    notifier.tick(Snap(110.0, 110.0, ("completed", "completed"), 0.0))
    notifier.stopped()
    assert manager.messages() == []


def test_ready_waits_for_the_samplers(manager: Manager, tmp_path: Path) -> None:
    now = [10.0]
    environ = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000"}
    notifier = SystemdNotifier(2.0, environ, clock=lambda: now[0])
    notifier.tick(Snap(10.0, None))  # a turn before the socket is bound: nothing
    notifier.ready(Snap(10.0, None, started=False))  # bound, NVML still opening
    now[0] = 11.0
    notifier.tick(Snap(11.0, 10.8, started=False))
    assert manager.messages() == []
    now[0] = 11.2
    notifier.tick(Snap(11.2, 11.0))
    assert manager.messages() == ["READY=1\nSTATUS=0 runs (0 running), 0 records/s", "WATCHDOG=1"]
