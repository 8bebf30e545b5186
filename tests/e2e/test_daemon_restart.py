"""A daemon stopped mid-run and started again while the run goes on (a watchdog restart:
SIGTERM, then a fresh daemon on the same socket): the second continues the run from what
the first stored at its stop, so only the time between the two is lost, and the
summary's account of that gap is true (docs/node-daemon.md, "Restarts").
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.helpers import Sidecar, run_json, split_dir, start_job, wait_for


def _records(daemon: Sidecar) -> int:
    runs = daemon.status()["runs"]
    return runs[0]["records"] if runs else 0


def test_a_sigterm_restart_keeps_what_was_stored(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    first = serve()
    stop_file = short_tmp / "stop"  # the job trains whole epochs until it exists
    # no checkpoint before the stop: the first epoch outlasts it
    job = start_job(
        first.endpoint,
        short_tmp,
        "--out-dir",
        "maps",
        "--epochs",
        "1",
        "--iters",
        "400",
        "--val-iters",
        "0",
        "--sleep",
        "0.01",
        "--warmup",
        "0",
        "--stop-file",
        str(stop_file),
    )
    try:
        wait_for(lambda: _records(first) > 300, 60, "records before the restart")
        stopped_unix = time.time()
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(30) == 128 + signal.SIGTERM
        folder = first.root / "maps"
        meta = run_json(folder)
        assert (meta["status"], meta["cause"]) == ("incomplete", "sidecar stopped by SIGTERM")
        second = serve()
        wait_for(lambda: _records(second), 60, "the run to come back")
        stop_file.touch()
        assert job.wait(120) == 0
    finally:
        if job.poll() is None:
            job.kill()
    log = second.log.read_text()
    assert "starting this split afresh" not in log, log
    meta = run_json(folder)
    assert meta["status"] == "completed", (meta, log)
    summary = (split_dir(folder) / "summary.log").read_text()
    gaps = [float(m) for m in re.findall(r"Sidecar gap: from ([0-9.]+) s", summary)]
    assert len(gaps) == 1, summary
    # the gap starts where the first daemon stopped, not at the run's start
    assert gaps[0] >= stopped_unix - meta["splits"]["0"]["start_unix"] - 1.0, summary
