"""The sidecar never competes with training for a core: it runs every one of its
threads at a lower CPU priority (niceness +10 by default, ``--nice N``), and a job started
by ``sidecar run`` keeps the priority it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.support.helpers import env, sidecar_command, status, wait_for


def _thread_niceness(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, thread.id) for thread in psutil.Process(pid).threads()]


def test_a_served_sidecar_runs_all_its_threads_niced(short_tmp: Path) -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    endpoint = f"ipc://{short_tmp}/s.sock"
    process = subprocess.Popen(  # at its default priority (the serve fixture's is the job's)
        sidecar_command("serve", "--quiet", "--endpoint", endpoint, "--root", str(short_tmp)),
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: status(endpoint, 0.5), 30, "the sidecar to answer")
        niceness = _thread_niceness(process.pid)
        assert len(niceness) >= 2  # the loop and ZeroMQ's I/O thread at least
        assert niceness == [min(own + 10, 19)] * len(niceness)
    finally:
        process.terminate()
        process.wait(30)


def test_sidecar_run_keeps_the_jobs_priority_and_nice_is_configurable(short_tmp: Path) -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    report = short_tmp / "job-nice"
    job = f"import os, time; open({str(report)!r}, 'w').write(str(os.nice(0))); time.sleep(30)"
    process = subprocess.Popen(
        sidecar_command(
            "run",
            "--quiet",
            "--nice",
            "5",
            "--endpoint",
            f"ipc://{short_tmp}/r.sock",
            "--",
            sys.executable,
            "-c",
            job,
        ),
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: report.exists() and report.read_text(), 30, "the job to start")
        assert int(report.read_text()) == own
        wait_for(
            lambda: (
                _thread_niceness(process.pid)
                == [min(own + 5, 19)] * len(_thread_niceness(process.pid))
            ),
            10,
            "the sidecar to lower its priority",
        )
    finally:
        process.terminate()
        process.wait(30)
