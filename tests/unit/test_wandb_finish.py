"""The W&B export counts a point exported only once W&B's finish of the run returned:
``Run.log`` returns as soon as W&B's own process was handed the point, and a service that
is gone before the finish (torn down by the process's exit) loses what was logged. Real
W&B, offline, in a process of its own whose W&B service the test kills."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb")  # the extra trainmon[wandb]

from tests.support.helpers import env
from tests.support.wandb_finish import ROWS


def _export(out: Path, how: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.wandb_finish", str(out), how],
        env=env(WANDB_MODE="offline", WANDB_SILENT="true"),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(300)
def test_logged_points_are_exported_once_the_run_is_finished(tmp_path: Path) -> None:
    counts = _export(tmp_path, "keep")
    assert counts["logged"] == {"exported": 0, "awaiting": ROWS}  # logged, not yet written
    closed = counts["closed"]
    assert (closed["exported"], closed["awaiting"], closed["dropped"]) == (ROWS, 0, 0)
    assert closed["error"] is None
    assert list(tmp_path.glob("training/split-0/wandb/offline-run-*/run-*.wandb"))


@pytest.mark.timeout(300)
def test_a_run_whose_finish_fails_has_none_of_its_points_exported(tmp_path: Path) -> None:
    closed = _export(tmp_path, "kill")["closed"]
    assert (closed["exported"], closed["awaiting"]) == (0, 0)
    # sent to W&B's process, which may have written some before it died: not confirmed
    assert closed["dropped"] == closed["unconfirmed"] == ROWS
    assert closed["error"], closed
