"""The W&B export (docs/exports.md), offline (``WANDB_MODE=offline``: W&B's own local
process writes the run's ``.wandb`` file), read back with W&B's own reader
``wandb leet inspect --json``: every phase series holds the stored rows of
computational.tsv at their optimizer steps, the host series the samples of resources.tsv,
and after a kill and a resume each step is there once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

# the job, and computational.tsv's columns -> the exported series: the other exports' test
from tests.e2e.test_exports import ITERS, JOB, SERIES, WARMUP
from tests.support.helpers import env, split_dir

pytestmark = pytest.mark.e2e

STEP_KEY = "trainmon/step"
STEP_SLOTS = 1000  # W&B steps per optimizer step (sidecar.exports.wandb)


def _wandb() -> str:
    pytest.importorskip("wandb")  # the extra trainmon[wandb]
    found = Path(sys.executable).with_name("wandb")
    return str(found) if found.exists() else shutil.which("wandb") or pytest.skip("no wandb")


def _job(cwd: Path, *args: str, under_run: str | None = None) -> subprocess.CompletedProcess[str]:
    job = [sys.executable, str(JOB), "--out-dir", "maps", "--iters", str(ITERS), *args]
    if under_run is not None:
        job = [sys.executable, "-m", "sidecar", "run", "--export", under_run, "--", *job]
    return subprocess.run(
        job,
        cwd=cwd,
        env=env(WANDB_MODE="offline", WANDB_SILENT="true"),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


def _records(path: Path) -> list[dict[str, Any]]:
    """Every record of a .wandb file, as W&B's own reader gives them."""
    done = subprocess.run(
        [_wandb(), "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _files(out: Path) -> list[Path]:
    """The .wandb files the sidecars wrote, oldest first."""
    files = sorted((split_dir(out) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, "no .wandb file"
    return files


def _runs(out: Path) -> list[list[dict[str, Any]]]:
    """The records of each .wandb file the sidecars wrote, oldest first."""
    return [_records(path) for path in _files(out)]


def _history(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run's history rows in W&B step order as W&B keeps them: a resumed process's
    file starts at a rewind (its run record's ``branch_point``), which discards the rows
    logged before it above that step."""
    rows: list[dict[str, Any]] = []
    for records in runs:
        run = next(r["run"] for r in records if r["type"] == "run")
        branch = run.get("branch_point")
        if branch is not None:
            assert branch["metric"] == "_step"
            rows = [row for row in rows if row["_step"] <= int(branch["value"])]
        rows += [r["history"]["item"] for r in records if r["type"] == "history"]
    return rows


def _series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for name, value in row.items():
            if not name.startswith("_") and name != STEP_KEY:
                series[name].append((row[STEP_KEY], value))
    return series


def _stored(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(split_dir(out) / "logs" / name, sep="\t")


def _check_against_files(out: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps))  # W&B's steps only go up: none was dropped
    # a row at its own optimizer step's slots, or later when it came late (an epoch's
    # row, at the step it began, is stored when it ends): never before; goodput, at the
    # step reached, in the slots of the step done
    for row in rows:
        goodput = any(name.startswith("goodput/") for name in row)
        assert row["_step"] // STEP_SLOTS >= row[STEP_KEY] - goodput, row
    assert sum(row["_step"] // STEP_SLOTS == row[STEP_KEY] for row in rows) > len(rows) / 2
    series = _series(rows)
    stored = _stored(out, "computational.tsv")
    for column, name in SERIES.items():
        assert sorted(v for _, v in series[name]) == sorted(stored[column].dropna().tolist())
    resources = _stored(out, "resources.tsv")
    memory = [v for _, v in series["system/memory_percent"]]
    assert memory == resources["system memory used (%)"].tolist()
    rss = [v for _, v in series["system/proc.memory.rssMB"]]
    assert rss == pytest.approx(resources["job memory rss (MB)"].tolist(), rel=1e-12)
    assert "goodput/productive_s" in series
    return series


def test_sidecar_run_export_wandb_holds_every_stored_row_and_sample(tmp_path: Path) -> None:
    _wandb()
    done = _job(tmp_path, "--epochs", "2", under_run="wandb")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "maps"
    runs = _runs(out)
    assert len(runs) == 1
    series = _check_against_files(out, _history(runs))
    forward = [step for step, _ in series["phases/forward_wall_s"]]
    assert forward == list(range(WARMUP, 2 * ITERS))  # warmup once, the run not resumed
    summary = (split_dir(out) / "summary.log").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Export wandb:"))
    assert f"(offline, {_files(out)[0]})" in line and "not exported" not in line
    exported = int(line.split(":")[1].split()[0])
    assert exported == sum(len(v) for v in series.values())  # what summary.log says is there


def test_a_kill_and_resume_shows_each_step_once(tmp_path: Path) -> None:
    _wandb()
    first = _job(tmp_path, "--export", "wandb", "--kill-after-epoch", "0")
    assert first.returncode == -9, first.stderr
    second = _job(tmp_path, "--export", "wandb", "--resume", "--epochs", "1")
    assert second.returncode == 0, second.stderr
    out = tmp_path / "maps"
    runs = _runs(out)
    assert len(runs) == 2  # one file per process's sidecar, one run id
    ids = {next(r["run"]["run_id"] for r in records if r["type"] == "run") for records in runs}
    assert len(ids) == 1
    resumed = next(r["run"] for r in runs[1] if r["type"] == "run")
    assert int(resumed["branch_point"]["value"]) == ITERS * STEP_SLOTS - 1  # at the checkpoint
    series = _check_against_files(out, _history(runs))
    forward = [step for step, _ in series["phases/forward_wall_s"]]
    assert forward == [*range(WARMUP, ITERS), *range(ITERS + WARMUP, 2 * ITERS)]


def test_the_scripts_active_run_gives_project_and_group(tmp_path: Path) -> None:
    _wandb()
    done = _job(tmp_path, "--export", "wandb", "--wandb-run", "script-project", "--epochs", "1")
    assert done.returncode == 0, done.stderr
    script_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(script_files) == 1
    script_run = next(r["run"] for r in _records(script_files[0]) if r["type"] == "run")
    ours = next(r["run"] for r in _runs(tmp_path / "maps")[0] if r["type"] == "run")
    assert ours["project"] == "script-project"
    assert ours["run_group"] == script_run["run_id"]
    assert ours["run_id"] != script_run["run_id"]
