"""An unknown exporter gives exactly one warning, whichever way it was named: by the
script's start_run (a private sidecar, or under `sidecar run`, whose logs reach the same
terminal) or by `sidecar run --export`; the run goes on and its files are whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.support.helpers import REPO, env, split_dir

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
