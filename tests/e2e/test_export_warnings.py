"""An unknown exporter gives exactly one warning, whichever way it was named: by the
script's start_run (a private sidecar, or under `sidecar run`, whose logs reach the same
terminal), by `sidecar run --export`, or by a daemon's `sidecar serve --export` that the
script reaches through SIDECAR_ENDPOINT; the run goes on and its files are whole."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.support.helpers import REPO, env, split_dir, wait_for

pytestmark = pytest.mark.e2e
JOB = [sys.executable, str(REPO / "tests" / "support" / "jobs" / "export_job.py")]
SIDECAR_RUN = [sys.executable, "-m", "sidecar", "run"]
ITERS, WARMUP = 6, 2


@pytest.mark.parametrize(
    "command",
    [
        [*JOB, "--export", "bogus"],
        [*SIDECAR_RUN, "--", *JOB, "--export", "bogus"],
        [*SIDECAR_RUN, "--export", "bogus", "--", *JOB],
    ],
    ids=["start_run", "start_run-under-sidecar-run", "sidecar-run-export"],
)
def test_an_unknown_exporter_is_warned_of_once(tmp_path: Path, command: list[str]) -> None:
    done = subprocess.run(
        [*command, "--out-dir", "maps", "--iters", str(ITERS), "--epochs", "1"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert output.count("unknown export 'bogus'") == 1, output
    stored = pd.read_csv(split_dir(tmp_path / "maps") / "logs" / "computational.tsv", sep="\t")
    assert len(stored["Forward (s)"].dropna()) == ITERS - WARMUP  # the run went on, whole


def test_a_daemons_unknown_exporter_is_warned_of_once_in_its_log(tmp_path: Path) -> None:
    # `sidecar serve --export`, the script finding it through SIDECAR_ENDPOINT: the
    # daemon says it at its start; the runs it serves, which did not name it, hear nothing
    socket_file = tmp_path / "s.sock"
    log = tmp_path / "serve.log"
    serve = [sys.executable, "-m", "sidecar", "serve", "--root", str(tmp_path)]
    with log.open("w") as stderr:
        daemon = subprocess.Popen(
            [*serve, "--endpoint", f"ipc://{socket_file}", "--export", "bogus"],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        wait_for(lambda: "listening on" in log.read_text(), 60, "the daemon to listen")
        done = subprocess.run(
            [*JOB, "--out-dir", "maps", "--iters", str(ITERS), "--epochs", "1"],
            cwd=tmp_path,
            env=env(SIDECAR_ENDPOINT=f"ipc://{socket_file}"),
            capture_output=True,
            text=True,
            timeout=240,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        assert "unknown export" not in done.stderr, done.stderr
        assert "no answer" not in done.stderr, done.stderr  # the daemon served it
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    assert log.read_text().count("unknown export 'bogus'") == 1, log.read_text()
