"""The liveness check on real processes: alive while running, gone as a zombie and once
reaped, and a watched process forgotten once seen gone."""

from __future__ import annotations

import subprocess
import sys
import time

from sidecar.daemon import liveness
from sidecar.daemon.liveness import pid_alive


def _wait_for(predicate: object, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_process_is_alive_then_gone_as_a_zombie_and_once_reaped() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert pid_alive(child.pid)
        assert pid_alive(child.pid)  # the watched process, read again
        assert child.pid in liveness._watched
        assert child.stdin is not None
        child.stdin.close()  # it exits; not reaped yet: a zombie
        assert _wait_for(lambda: not pid_alive(child.pid))
        assert child.pid not in liveness._watched
    finally:
        child.kill()  # a no-op once it exited
        child.wait()
    assert not pid_alive(child.pid)
    assert child.pid not in liveness._watched


def test_a_pid_that_never_ran_is_gone() -> None:
    assert not pid_alive(2**22 + 12345)  # above Linux's pid_max
