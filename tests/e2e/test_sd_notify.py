"""The node daemon under a real datagram socket as ``NOTIFY_SOCKET`` (docs/contract.md, Node
daemon): READY=1 once it serves, WATCHDOG=1 every half ``WATCHDOG_USEC`` while its loop and
samplers make progress and never for another process's watchdog, STATUS= lines, STOPPING=1 on
SIGTERM; a sampler whose NVML call hangs stops the pings (systemd then restarts the daemon).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.helpers import env, sidecar_command, start_job, status, wait_for
from tests.support.notify_socket import Manager


@pytest.fixture
def manager(short_tmp: Path) -> Iterator[Manager]:
    sock = Manager(short_tmp / "notify")
    yield sock
    sock.sock.close()


def _daemon(
    short_tmp: Path, extra_env: dict[str, str], *args: str, seams: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    (short_tmp / "root").mkdir(exist_ok=True)
    log = (short_tmp / "sidecar.log").open("ab")
    return subprocess.Popen(
        sidecar_command(
            "serve",
            "--endpoint",
            f"ipc://{short_tmp}/s.sock",
            "--root",
            str(short_tmp / "root"),
            *args,
            seams=seams,
        ),
        env=env(**extra_env),
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(20)


def test_ready_watchdog_status_and_stopping(manager: Manager, short_tmp: Path) -> None:
    daemon = _daemon(short_tmp, {"NOTIFY_SOCKET": str(manager.path), "WATCHDOG_USEC": "1000000"})
    try:
        ready_at = manager.until("READY=1", 30)
        assert status(f"ipc://{short_tmp}/s.sock", 5) is not None  # READY means it serves
        manager.collect(3.0 - (time.monotonic() - ready_at))
        assert manager.count("WATCHDOG=1", ready_at) >= 3  # every 0.5 s: about 6
        ready = next(text for _, text in manager.got if "READY=1" in text)
        assert "STATUS=0 runs (0 running), 0 records/s" in ready.split("\n")
        daemon.send_signal(signal.SIGTERM)
        manager.until("STOPPING=1", 10)
        assert daemon.wait(20) == 128 + signal.SIGTERM
    finally:
        _stop(daemon)


def test_no_watchdog_for_another_process_and_nothing_without_notify_socket(
    manager: Manager, short_tmp: Path
) -> None:
    daemon = _daemon(
        short_tmp,
        {"NOTIFY_SOCKET": str(manager.path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"},
    )
    try:
        manager.until("READY=1", 30)
        manager.collect(1.5)
        assert manager.count("WATCHDOG=1") == 0
    finally:
        _stop(daemon)
    manager.until("STOPPING=1", 5)  # its last word, read before the next daemon starts
    manager.got.clear()
    quiet = _daemon(short_tmp, {"WATCHDOG_USEC": "1000000"})
    try:
        wait_for(lambda: status(f"ipc://{short_tmp}/s.sock", 0.5), 30, "the daemon to serve")
        manager.collect(1.5)
    finally:
        assert _stop(quiet) == 128 + signal.SIGTERM
    assert manager.got == []  # the daemon served and stopped without a word


def test_a_hung_nvml_call_stops_the_pings(manager: Manager, short_tmp: Path) -> None:
    endpoint = f"ipc://{short_tmp}/s.sock"
    daemon = _daemon(
        short_tmp,
        {"NOTIFY_SOCKET": str(manager.path), "WATCHDOG_USEC": "1000000"},
        "--interval",
        "0.2",
        seams=("--fake-nvml", "hanging_gpu"),
    )
    stop_file = short_tmp / "stop"
    job = None
    try:
        ready_at = manager.until("READY=1", 30)
        manager.collect(1.5)
        assert manager.count("WATCHDOG=1", ready_at) >= 2  # idle: rounds complete
        # A job makes the samplers read the GPU: its utilization call hangs.
        job = start_job(
            endpoint,
            short_tmp,
            "--out-dir",
            "hang",
            "--stop-file",
            str(stop_file),
            "--sleep",
            "0.01",
        )
        wait_for(
            lambda: (
                "did not return" in (status(endpoint, 2) or {}).get("samplers", {}).get("gpu", "")
            ),
            30,
            "GPU sampling to stop on the hung call",
        )
        manager.collect(2.4 + 1.0)  # the last round's age passes stall_s_for(0.2) = 2.4 s
        quiet_from = time.monotonic()
        manager.collect(2.0)
        assert manager.count("WATCHDOG=1", quiet_from) == 0
        assert status(endpoint, 5) is not None  # the loop itself still turns
    finally:
        stop_file.touch()
        if job is not None:
            job.wait(60)
        _stop(daemon)
