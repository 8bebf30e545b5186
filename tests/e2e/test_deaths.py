"""Processes that die or are told to stop (docs/contract.md, Faults and bad input),
with real processes and real signals.

The spec's "within 2 s" is asserted with a bound of 4 s: on a busy 2-core machine a
subprocess can be descheduled for a while, and a broken mechanism never reacts at all.
Each test prints the measured time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.helpers import (
    JOB,
    SAME_PRIORITY,
    env,
    job_args,
    progress,
    run_json,
    split_dir,
    start_job,
    under_sidecar_run,
    wait_for,
)

BOUND_S = 4.0  # the spec says 2 s; see the module docstring
# SIGHUP: a closed terminal or a dropped ssh session; SIGQUIT: Ctrl-backslash
STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]


def _wait_iterations(path: Path, count: int = 400) -> dict:
    def reached() -> dict:
        now = progress(path)
        return now if now.get("iterations", 0) >= count else {}

    return wait_for(reached, 60, f"{count} iterations of the job")


def test_sigkill_of_the_training_process_mid_epoch_is_noticed(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "killed"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        *job_args(out_dir=out, iters=100000, epochs=1, progress=short_tmp / "p.json"),
    )
    _wait_iterations(short_tmp / "p.json")
    killed_at = time.monotonic()
    job.send_signal(signal.SIGKILL)
    job.wait(10)
    document = wait_for(
        lambda: run_json(out).get("status") == "incomplete" and run_json(out),
        10,
        "the run marked incomplete",
    )
    elapsed = time.monotonic() - killed_at
    print(f"SIGKILL noticed and files written in {elapsed:.2f} s")
    assert elapsed < BOUND_S
    assert f"process {job.pid} ended without finish()" in document["cause"]
    logs = split_dir(out) / "logs"
    rows = (logs / "computational.tsv").read_text().splitlines()
    assert len(rows) > 100  # the measurements taken before the kill are all there
    summary = (split_dir(out) / "summary.log").read_text()
    assert "Computational Summary" in summary
    assert sidecar.status()["runs"][0]["status"] == "incomplete"


def _sidecar_run(short_tmp: Path, *more: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        under_sidecar_run(
            JOB,
            *job_args(out_dir="maps", progress=short_tmp / "p.json"),
            *more,
            options=("--quiet", *SAME_PRIORITY),
        ),
        cwd=short_tmp,
        env=env(XDG_RUNTIME_DIR=str(short_tmp)),
        stdin=subprocess.DEVNULL,
    )


def test_sigkill_of_the_job_under_sidecar_run_gives_the_signal(short_tmp: Path) -> None:
    sidecar = _sidecar_run(short_tmp, "--iters", "100000", "--epochs", "1")
    pid = _wait_iterations(short_tmp / "p.json")["pid"]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert sidecar.wait(30) == 128 + signal.SIGKILL
    elapsed = time.monotonic() - killed_at
    print(f"sidecar run wrote and exited {elapsed:.2f} s after the job's SIGKILL")
    assert elapsed < BOUND_S
    document = run_json(short_tmp / "maps")
    assert document["status"] == "incomplete"
    assert document["cause"] == "job killed by signal 9 (SIGKILL)"


def test_exception_inside_with_run_writes_files_marked_failed(serve, short_tmp: Path) -> None:
    sidecar = serve()
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        "--out-dir",
        "boom",
        "--epochs",
        "3",
        "--raise-at-epoch",
        "1",
        stderr=subprocess.DEVNULL,
    )
    assert job.wait(60) == 1
    document = run_json(short_tmp / "root" / "boom")
    assert document["status"] == "failed"
    assert document["cause"] == "RuntimeError: boom in epoch 1"
    assert (split_dir(short_tmp / "root" / "boom") / "logs" / "computational.tsv").exists()


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_sidecar_signal_writes_and_exits_without_disturbing_training(
    serve, short_tmp: Path, signum: int
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "stopped"
    stop = short_tmp / "stop"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        *job_args(out_dir=out, iters=50, stop_file=stop, progress=short_tmp / "p.json"),
    )
    before = _wait_iterations(short_tmp / "p.json")
    signalled_at = time.monotonic()
    sidecar.process.send_signal(signum)
    code = sidecar.process.wait(30)
    elapsed = time.monotonic() - signalled_at
    print(f"sidecar wrote and exited {elapsed:.2f} s after {signal.Signals(signum).name}")
    assert elapsed < BOUND_S
    assert code == 128 + signum
    document = run_json(out)
    assert document["status"] == "incomplete"
    assert document["cause"] == f"sidecar stopped by {signal.Signals(signum).name}"
    # training goes on without a sidecar, then ends normally
    wait_for(
        lambda: progress(short_tmp / "p.json")["iterations"] > before["iterations"] + 200,
        30,
        "the job to go on",
    )
    stop.touch()
    assert job.wait(60) == 0
    assert progress(short_tmp / "p.json")["done"]


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_sidecar_run_forwards_the_signal_and_still_writes(short_tmp: Path, signum: int) -> None:
    sidecar = _sidecar_run(short_tmp, "--iters", "50", "--stop-file", str(short_tmp / "never"))
    _wait_iterations(short_tmp / "p.json")
    signalled_at = time.monotonic()
    sidecar.send_signal(signum)
    code = sidecar.wait(30)
    elapsed = time.monotonic() - signalled_at
    print(f"sidecar run: job stopped, files written {elapsed:.2f} s after the signal")
    assert elapsed < BOUND_S
    assert code == 128 + signum  # the job's own status: it got the signal
    document = run_json(short_tmp / "maps")
    if signum == signal.SIGINT:  # KeyboardInterrupt inside ``with run:``
        assert document["status"] == "failed"
        assert document["cause"] == "KeyboardInterrupt"
    else:  # no handler: the job dies of it
        assert document["status"] == "incomplete"
        assert document["cause"] == (
            f"job killed by signal {signum} ({signal.Signals(signum).name})"
        )
    assert not list((short_tmp / "sidecar").glob("job-*"))  # no socket folder left behind
    assert (split_dir(short_tmp / "maps") / "summary.log").exists()
