"""MonitorCallback for the Hugging Face Trainer: real Trainer runs on CPU, offline (a tiny
BERT from a config; a model with known costs), evaluation every eval_steps inside
training, and resume_from_checkpoint in a second process with a second sidecar."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from tests.support.helpers import REPO, Sidecar, env, read_tsv, split_dir
from tests.support.spin import assert_close

pytest.importorskip("transformers")
JOB = REPO / "tests" / "support" / "jobs" / "transformers_job.py"
TRAINING = [
    "Training loop (s)",
    "Training data loading (s)",
    "Forward (s)",
    "Backward (s)",
    "Optimization (s)",
]
BATCH = 4  # per_device_train_batch_size of the job


def train(
    sidecar: Sidecar, *args: str, killed: bool = False
) -> tuple[dict[str, list[float]], Path]:
    """Run the Trainer job with its output_dir (the run folder) under the sidecar's root;
    its truth (empty when ``killed``: the job SIGKILLs itself) and output_dir."""
    out = sidecar.root / "hf"
    truth = sidecar.root / f"truth-{len(list(sidecar.root.glob('truth-*')))}.json"
    result = subprocess.run(
        [sys.executable, str(JOB), "--truth", str(truth), "--out", str(out), *args],
        cwd=sidecar.root,
        capture_output=True,
        text=True,
        timeout=300,
        env=env(SIDECAR_ENDPOINT=sidecar.endpoint, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
    )
    if killed:
        assert result.returncode == -9, result.stderr[-3000:]
        return {}, out
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(truth.read_text()), out


def computational(out: Path) -> pd.DataFrame:
    """The run's computational.tsv."""
    return read_tsv(split_dir(out) / "logs" / "computational.tsv")


def sums(values: list[float], group: int) -> list[float]:
    """Consecutive groups of ``group`` values summed."""
    return [sum(values[i : i + group]) for i in range(0, len(values), group)]


def step_loading(samples: list[float], batches: int, accumulation: int) -> list[float]:
    """Seconds of sample loading inside each step's data loading window. accelerate's
    DataLoaderShard fetches one batch ahead: an epoch's first step also fetches the next
    step's first batch, its last step fetches one batch fewer."""
    per_batch = sums(samples, BATCH)
    windows = []
    for epoch in range(0, len(per_batch), batches):
        loads = per_batch[epoch : epoch + batches]
        for step in range(0, batches, accumulation):
            first = 0 if step == 0 else step + 1
            windows.append(sum(loads[first : step + accumulation + 1]))
    return windows


def test_tiny_bert_with_accumulation_and_evaluation_inside_training(sidecar: Sidecar) -> None:
    # 16 samples, batches of 4, accumulation 2: 2 steps per epoch, 2 epochs; evaluation
    # (2 batches) every 2 steps. The first step is warmup.
    _truth, out = train(sidecar, "--model", "bert", "--accumulation", "2", "--eval-steps", "2")
    frame = computational(out)
    counts = frame.notna().sum()
    for name in TRAINING:
        assert counts[name] == 3, name
    for name in ("Validation loop (s)", "Validation data loading (s)", "Evaluation (s)"):
        assert counts[name] == 4, name
    assert counts["Validation (s)"] == 2
    assert counts["Epoch (s)"] == 2
    summary = (split_dir(out) / "summary.log").read_text()
    assert "Throughput: " in summary and "unknown" not in summary.split("Throughput: ")[1][:20]


def test_evaluation_at_epoch_ends_lies_inside_its_epoch(sidecar: Sidecar) -> None:
    _truth, out = train(sidecar, "--model", "bert", "--eval-epochs")
    logs = split_dir(out) / "logs"
    counts = computational(out).notna().sum()
    assert counts["Validation (s)"] == 2 and counts["Epoch (s)"] == 2
    assert counts["Training loop (s)"] == 7  # 4 steps per epoch, the first is warmup
    phases = read_tsv(logs / "phases.tsv")
    epochs = phases[phases["phase"] == "Epoch"].sort_values("epoch")
    passes = phases[phases["phase"] == "Validation"].sort_values("start (s)")
    for (_, epoch), (_, validation) in zip(epochs.iterrows(), passes.iterrows(), strict=True):
        assert epoch["start (s)"] <= validation["start (s)"]
        assert (
            validation["start (s)"] + validation["wall (s)"]
            <= epoch["start (s)"] + epoch["wall (s)"] + 1e-6
        )


def test_rows_against_known_costs(sidecar: Sidecar) -> None:
    # 32 samples, batches of 4, accumulation 2: 4 steps per epoch, 2 epochs, 7 rows after
    # warmup (enough that a step descheduled on this busy machine is not a third of them).
    truth, out = train(
        sidecar, "--model", "spin", "--accumulation", "2", "--samples", "32", "--eval-steps", "4"
    )
    frame = computational(out)

    def column(name: str) -> list[float]:
        return frame[name].dropna().tolist()

    assert_close(column("Forward (s)"), sums(truth["forward"], 2)[1:], "Forward")
    assert_close(column("Backward (s)"), sums(truth["backward"], 2)[1:], "Backward")
    assert_close(column("Optimization (s)"), truth["optimization"][1:], "Optimization")
    assert_close(
        column("Training data loading (s)"),
        step_loading(truth["loading"], batches=8, accumulation=2)[1:],
        "Data loading",
    )
    assert_close(column("Evaluation (s)"), truth["evaluation"], "Evaluation")


def test_resume_from_checkpoint_continues_the_split(serve: Callable[..., Sidecar]) -> None:
    # 32 samples, batches of 4: 8 steps per epoch. The first process stops at step 4 with a
    # checkpoint; the second, with a new sidecar, resumes from it to step 8.
    first = serve()
    _truth, out = train(
        first, "--model", "bert", "--samples", "32", "--max-steps", "4", "--save-steps", "4"
    )
    assert (out / "checkpoint-4" / "trainmon-state.json").is_file()
    first.stop()
    second = serve()
    train(
        second,
        "--model",
        "bert",
        "--samples",
        "32",
        "--max-steps",
        "8",
        "--save-steps",
        "4",
        "--resume",
    )
    frame = computational(out)
    assert frame["Training loop (s)"].notna().sum() == 6  # 3 + 3: warmup in each process
    phases = read_tsv(split_dir(out) / "logs" / "phases.tsv")
    assert sorted(set(phases["session"])) == [0, 1]
    assert json.loads((out / "run.json").read_text())["status"] == "completed"


def test_an_epoch_open_at_the_checkpoint_is_kept_as_two_parts(
    serve: Callable[..., Sidecar],
) -> None:
    # 8 steps an epoch, a checkpoint every 4: the first process is killed at step 6, the
    # second resumes from checkpoint-4 inside epoch 0.
    first = serve()
    args = ("--model", "spin", "--samples", "32", "--save-steps", "4")
    _truth, out = train(first, *args, "--kill-at-step", "6", killed=True)
    first.stop()
    second = serve()
    train(second, *args, "--resume")
    phases = read_tsv(split_dir(out) / "logs" / "phases.tsv")
    epochs = phases[phases["phase"] == "Epoch"]
    flags = [flag if isinstance(flag, str) else "" for flag in epochs["flag"]]
    # Epoch 0, cut by the checkpoint, is one Epoch row: its two parts, the time between the
    # processes left out; both parts are kept.
    assert list(zip(epochs["epoch"], epochs["session"], flags, strict=True)) == [
        (0, 0, ""),
        (0, 0, "part"),
        (0, 1, "part"),
        (1, 1, ""),
    ]
    whole, first_part, second_part = (epochs.iloc[i] for i in range(3))
    assert whole["wall (s)"] == pytest.approx(
        first_part["wall (s)"] + second_part["wall (s)"], abs=2e-6
    )
    loops = phases[(phases["phase"] == "Training loop") & (phases["session"] == 0)]
    # The first part runs up to the checkpoint (after step 4), not past the kill.
    assert first_part["start (s)"] + first_part["wall (s)"] >= loops["start (s)"].max()
    assert computational(out)["Epoch (s)"].notna().sum() == 2
    # The saves are the checkpoint phase: the second process saves at steps 8, 12 and
    # 16, the first of them is warmup.
    saves = phases[phases["phase"] == "checkpoint"]
    assert list(saves["session"]) == [1, 1] and set(saves["flag"]) == {"outside"}


def test_an_epochs_short_last_step_counts_its_real_samples(sidecar: Sidecar) -> None:
    # 10 samples, batches of 4, accumulation 2: each epoch steps on 4+4 samples, then on
    # the last 2 alone (the Trainer steps at the epoch's end).
    _truth, out = train(sidecar, "--model", "spin", "--accumulation", "2", "--samples", "10")
    phases = read_tsv(split_dir(out) / "logs" / "phases.tsv")
    loops = phases[(phases["phase"] == "Training loop") & phases["flag"].isna()]
    assert list(loops["batch size"]) == [2, BATCH, 2]  # the first step is warmup


def test_a_private_sidecars_start_up_is_not_inside_train(tmp_path: Path) -> None:
    # No SIDECAR_ENDPOINT: the callback starts a private sidecar (about a second); that
    # happens while the Trainer is built, not inside train() (on_train_begin). Training
    # runs from there to on_train_end: summary.log names what of it lies outside
    # train()'s own clock (train_runtime), and with it accounts for Training.
    out, truth = tmp_path / "hf", tmp_path / "truth.json"
    environment = env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [
            sys.executable,
            str(JOB),
            "--truth",
            str(truth),
            "--out",
            str(out),
            "--model",
            "spin",
            "--epochs",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(truth.read_text())
    assert measured["on_train_begin"] < 0.3
    assert computational(out)["Training loop (s)"].notna().sum() == 3  # 4 steps, 1 warmup
    summary = (split_dir(out) / "summary.log").read_text()
    effective = float(re.search(r"Training time: effective (\S+) s", summary)[1])
    named = re.search(
        r"Training (\S+) s = the framework's own training loop (\S+) s .*\n"
        r" +\+ (\S+) s before that loop began .*\n +\+ (\S+) s after it ended",
        summary,
    )
    assert named is not None, summary
    training, loop, before, after = map(float, named.groups())
    assert training == effective and loop <= training
    # the named parts and train()'s own clock account for Training (figures of 0.01 s)
    outside_train_runtime = before + after
    assert outside_train_runtime + measured["train_runtime"] == pytest.approx(
        effective, rel=0.05, abs=0.015
    )
