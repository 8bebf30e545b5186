"""The death watch notes when a process died, by its own clock's measure: a child that
reads ``time.time()`` just before it kills itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar.daemon.deaths import DeathWatch
from tests.support.helpers import wait_for

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open")

SUICIDE = (
    "import os, signal, sys, time; sys.stdin.readline(); "
    "print(repr(time.time()), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
)


def test_a_sigkilled_process_dies_when_its_clock_says() -> None:
    deaths = DeathWatch()
    child = subprocess.Popen(
        [sys.executable, "-c", SUICIDE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        deaths.watch(b"run", child.pid)
        assert deaths.died_at(b"run") is None  # alive, waiting for its line
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        killed_unix = float(child.stdout.readline())
        died = wait_for(lambda: deaths.died_at(b"run"), 30, "the death noted")
        assert killed_unix <= died < killed_unix + 0.15, died - killed_unix
        deaths.retain({b"other"})
        assert deaths.died_at(b"run") is None
    finally:
        child.wait(30)
        deaths.close()


def test_a_process_gone_before_it_is_watched_is_unknown() -> None:
    deaths = DeathWatch()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    try:
        deaths.watch(b"run", child.pid + 10**7)  # no such process: no pidfd, no death
        deaths.watch(b"known", os.getpid())
        wait_for(lambda: not deaths._queued, 30, "the watches taken")
        assert deaths.died_at(b"run") is None and deaths.died_at(b"known") is None
    finally:
        deaths.close()
