"""Training processes on other hosts (tcp) are watched through ZeroMQ heartbeats (docs/contract.md,
Faults and bad input): one whose host goes down or freezes (SIGSTOP stops its I/O thread too, so it
answers no ping, as an unreachable host) or that dies is noticed within the configured time; its
files are written, marked incomplete with that cause. One that is alive but silent for several
heartbeat periods stays served. The clients claim another host name, so the sidecar cannot watch
their pids. The markers, in turn, notice a frozen sidecar by their own heartbeats, so a checkpoint
or finish does not wait for it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from markers.endpoints import connect_address
from markers.transport import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, Sender
from tests.support.helpers import REPO, env, run_json, split_dir, wait_for

CLIENT = REPO / "tests" / "support" / "jobs" / "remote_client.py"
HEARTBEAT_S = 2.0
SLACK_S = 3.0  # a busy 2-core machine; a broken mechanism never notices at all


def _client(endpoint: str, out_dir: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, str(CLIENT), endpoint, out_dir, *args],
        env=env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def test_a_remote_client_that_freezes_or_dies_is_noticed_a_silent_one_is_kept(
    serve, short_tmp: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sidecar = serve(endpoint=f"tcp://127.0.0.1:{port}", args=["--heartbeat", str(HEARTBEAT_S)])
    clients = []
    try:
        silent = _client(sidecar.endpoint, "silent", "--idle", "--seconds", str(3 * HEARTBEAT_S))
        frozen = _client(sidecar.endpoint, "frozen")
        killed = _client(sidecar.endpoint, "killed")
        clients = [silent, frozen, killed]
        time.sleep(0.5)
        started = time.monotonic()
        frozen.send_signal(signal.SIGSTOP)
        killed.kill()
        root = short_tmp / "root"
        for name in ("frozen", "killed"):
            document = wait_for(
                lambda n=name: (
                    run_json(root / n).get("status") == "incomplete" and run_json(root / n)
                ),
                HEARTBEAT_S + SLACK_S,
                f"the {name} client's run written as incomplete",
            )
            print(f"{name} remote client noticed after {time.monotonic() - started:.2f} s")
            assert "the connection from node-b ended without finish()" in document["cause"]
            assert (split_dir(root / name) / "summary.log").exists()
        assert silent.wait(3 * HEARTBEAT_S + 20) == 0
        assert silent.stdout is not None and silent.stdout.read().strip() == "finished True"
        assert run_json(root / "silent")["status"] == "completed"
        rejected = sidecar.status()["rejected_by_kind"]
        assert "connection_dropped" not in rejected, rejected
    finally:
        for client in clients:
            client.kill()
            client.send_signal(signal.SIGCONT)
            client.wait()


def test_the_markers_notice_a_frozen_sidecar(serve) -> None:
    sidecar = serve()
    sender = Sender(connect_address(sidecar.endpoint), os.urandom(16), 0)
    try:
        assert sender.wait_connected(10)
        sidecar.process.send_signal(signal.SIGSTOP)  # its host gone, as far as pings tell
        started = time.monotonic()
        bound_s = (HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS) / 1000
        wait_for(
            lambda: not sender.connected,
            bound_s + SLACK_S,
            "the markers to notice the frozen sidecar",
        )
        print(f"markers noticed a frozen sidecar after {time.monotonic() - started:.2f} s")
        asked = time.monotonic()
        assert sender.request({"type": "status"}, 5.0) is None
        assert time.monotonic() - asked < 0.5  # a checkpoint or finish does not wait
    finally:
        sidecar.process.send_signal(signal.SIGCONT)
        sender.close()
