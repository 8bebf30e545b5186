"""MonitorHandler for MONAI's engines: a real ``SupervisedTrainer`` with a
``SupervisedEvaluator`` on synthetic dict data, the parts sleeping known times. Rows
against the script's own clock; a crash, then a resume through Ignite's ``Checkpoint``;
a plain Ignite engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import REPO, env, read_tsv, run_json, split_dir
from tests.support.spin import assert_between, assert_close

pytest.importorskip("monai")
pytest.importorskip("ignite")
JOB = REPO / "tests" / "support" / "jobs" / "monai_job.py"
PARTS = {
    "Forward (s)": "forward",
    "Backward (s)": "backward",
    "Optimization (s)": "optimization",
    "Evaluation (s)": "evaluation",
}
# The engine events markers' handler opens and closes each part at.
EVENTS = {
    "forward": ("train.ITERATION_STARTED", "train.LOSS_COMPLETED"),
    "backward": ("train.LOSS_COMPLETED", "train.BACKWARD_COMPLETED"),
    "optimization": ("train.BACKWARD_COMPLETED", "train.MODEL_COMPLETED"),
    "evaluation": ("eval.ITERATION_STARTED", "eval.MODEL_COMPLETED"),
}


def windows(truth: dict[str, Any], part: str) -> list[float]:
    """The script's clock from just before markers' handler at the part's opening event to
    just after it at its closing one, each time: a window that holds the monitor's row."""
    opening, closing = EVENTS[part]
    starts, ends = truth["open"][opening], truth["close"][closing]
    return [end - start for start, end in zip(starts, ends, strict=True)]


def train(out: Path, *args: str, code: int = 0) -> dict[str, Any]:
    """Run the MONAI job, its run folder ``out``; its truth."""
    out.parent.mkdir(parents=True, exist_ok=True)
    truth = out.parent / f"truth-{len(list(out.parent.glob('truth-*')))}.json"
    result = subprocess.run(
        [sys.executable, str(JOB), str(out), str(truth), *args],
        cwd=out.parent,
        env=env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-3000:]
    return {**json.loads(truth.read_text()), "stderr": result.stderr}


def test_trainer_and_evaluator_rows_against_the_script_clock(tmp_path: Path) -> None:
    """3 epochs of 4 batches of 2 (the first 2 warmup), the evaluator's 2 batches after
    each epoch."""
    out = tmp_path / "maps"
    truth = train(out)
    assert truth["warnings"] == []  # the events fire: nothing to say
    frame = read_tsv(split_dir(out) / "logs" / "computational.tsv")
    counts = frame.notna().sum()
    for name in ("Training loop (s)", "Training data loading (s)", *list(PARTS)[:3]):
        assert counts[name] == 10, name
    for name in ("Validation loop (s)", "Validation data loading (s)", "Evaluation (s)"):
        assert counts[name] == 6, name
    assert counts["Metrics computation (s)"] == 6
    assert (counts["Epoch (s)"], counts["Validation (s)"]) == (3, 3)
    for name, part in PARTS.items():
        skip = 0 if part == "evaluation" else 2
        # between the part's own sleep (less 5 % or 0.5 ms) and the script's clock around
        # markers' handlers at its events (plus 0.5 ms)
        inner, outer = truth[part][skip:], windows(truth, part)[skip:]
        assert_between(frame[name].dropna().tolist(), inner, outer, name, 0.05, 0.5e-3)
    assert frame["Training (s)"].iloc[0] <= truth["run_s"]
    phases = read_tsv(split_dir(out) / "logs" / "phases.tsv")
    assert set(phases.query("phase == 'Training loop'")["batch size"]) == {2}  # dict batches
    assert run_json(out)["status"] == "completed"


def test_a_crash_then_resume_through_ignite_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "maps"
    checkpoints = ("--checkpoints", str(tmp_path / "checkpoints"))
    first = train(out, *checkpoints, "--raise-at-epoch", "3", code=1)
    document = run_json(out)
    assert document["status"] == "failed" and "boom at epoch 3" in document["cause"]
    assert read_tsv(split_dir(out) / "logs" / "computational.tsv")["Epoch (s)"].count() == 2
    second = train(out, *checkpoints, "--resume")
    assert run_json(out)["status"] == "completed"
    frame = read_tsv(split_dir(out) / "logs" / "computational.tsv")
    assert frame["Epoch (s)"].count() == 3, second["stderr"][-3000:]  # 1-2, then 3
    phases = read_tsv(split_dir(out) / "logs" / "phases.tsv")
    epochs = phases.query("phase == 'Epoch'")
    assert sorted(zip(epochs["session"], epochs["epoch"], strict=True)) == [(0, 0), (0, 1), (1, 2)]
    assert frame["Training (s)"].iloc[0] <= first["run_s"] + second["run_s"]
    summary = (split_dir(out) / "summary.log").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Throughput: "))
    assert float(line.split()[1]) > 0


def test_a_custom_iteration_update_leaves_the_phases_empty_with_one_warning(
    tmp_path: Path,
) -> None:
    """A SupervisedTrainer whose ``iteration_update`` is the script's own step, firing no
    IterationEvents: Forward, Backward and Optimization stay empty (never the whole step
    as Forward), one warning says why and what to do; the loop and the evaluator's rows
    are still right."""
    out = tmp_path / "maps"
    truth = train(out, "--custom-step")
    assert len(truth["warnings"]) == 1, truth["warnings"]
    assert "fired none of MONAI's IterationEvents" in truth["warnings"][0]
    assert "fire_event" in truth["warnings"][0] and "run.phase" in truth["warnings"][0]
    frame = read_tsv(split_dir(out) / "logs" / "computational.tsv")
    counts = frame.notna().sum()
    for name in list(PARTS)[:3]:
        assert counts[name] == 0, name
    assert counts["Training loop (s)"] == 10
    # Each stored step holds the script's forward, backward and step (the first 2 warmup).
    steps = [
        sum(x)
        for x in zip(*(truth[p][2:] for p in ("forward", "backward", "optimization")), strict=True)
    ]
    assert (frame["Training loop (s)"].dropna().to_numpy() >= steps).all()
    assert_close(
        frame["Evaluation (s)"].dropna().tolist(), truth["evaluation"], "Evaluation", 0.05, 0.5e-3
    )
    assert run_json(out)["status"] == "completed"


def test_a_plain_ignite_engine(tmp_path: Path) -> None:
    """No MONAI events: the process function is in the Training loop only; the batch
    size is read from the tuple batches."""
    code = f"""
import time
from ignite.engine import Engine
from markers.integrations.monai import MonitorHandler

def step(engine, batch):
    time.sleep(0.01)

trainer = Engine(step)
MonitorHandler(out_dir={str(tmp_path / "maps")!r}, warmup_iterations=1).attach(trainer)
trainer.run([([0.0] * 4, [1] * 4)] * 3, max_epochs=2)
"""
    subprocess.run([sys.executable, "-c", code], env=env(), check=True, timeout=120)
    frame = read_tsv(split_dir(tmp_path / "maps") / "logs" / "computational.tsv")
    assert frame["Training loop (s)"].count() == 5 and frame["Epoch (s)"].count() == 2
    assert (frame["Training loop (s)"].dropna() >= 0.01).all()
    assert frame["Forward (s)"].count() == 0  # nothing tells the forward pass apart
    phases = read_tsv(split_dir(tmp_path / "maps") / "logs" / "phases.tsv")
    assert set(phases.query("phase == 'Training loop'")["batch size"]) == {4}
