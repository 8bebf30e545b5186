"""MonitorCallback for Lightning: a real Trainer on CPU with known costs, its rows against
the parts' own clocks; resume from a Lightning checkpoint in a second process and a
second sidecar; DDP with two processes (gloo) writing the rank files."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.helpers import REPO, Sidecar, env, read_tsv, split_dir
from tests.support.spin import assert_between, assert_close

pytest.importorskip("lightning")
JOB = REPO / "tests" / "support" / "jobs" / "lightning_job.py"
TRAINING = [
    "Training loop (s)",
    "Training data loading (s)",
    "Forward (s)",
    "Backward (s)",
    "Optimization (s)",
]


def fit(sidecar: Sidecar, *args: str, killed: bool = False) -> tuple[dict[str, list[float]], Path]:
    """Run the Lightning job in ``<root>/job`` (its default_root_dir, so the run folder)
    against ``sidecar``; its truth (empty when ``killed``: the job SIGKILLs itself) and
    its run folder."""
    folder = sidecar.root / "job"
    folder.mkdir(exist_ok=True)
    truth = folder / f"truth-{len(list(folder.glob('truth-*')))}.json"
    result = subprocess.run(
        [sys.executable, str(JOB), "--truth", str(truth), *args],
        cwd=folder,
        env=env(SIDECAR_ENDPOINT=sidecar.endpoint, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    if killed:
        assert result.returncode == -9, result.stderr[-3000:]
        return {}, folder
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(truth.read_text()), folder


def sums(values: list[float], group: int) -> list[float]:
    """Consecutive groups of ``group`` values summed."""
    return [sum(values[i : i + group]) for i in range(0, len(values), group)]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_rows_follow_the_hooks_with_accumulation(sidecar: Sidecar, accumulation: int) -> None:
    truth, folder = fit(sidecar, "--accumulation", str(accumulation), "--batches", "8")
    frame = read_tsv(split_dir(folder) / "logs" / "computational.tsv")
    steps = 2 * 8 // accumulation
    for name in TRAINING:  # 2 epochs of 8 batches; the first step is warmup
        assert frame[name].notna().sum() == steps - 1, name
    assert frame["Epoch (s)"].notna().sum() == 2
    assert frame["Validation (s)"].notna().sum() == 2  # not the sanity check
    assert frame["Validation loop (s)"].notna().sum() == 4

    def column(name: str) -> list[float]:
        return frame[name].dropna().tolist()

    def between(name: str, part: str, group: int) -> None:
        # The part's own spin, and the script's clock from the hook that opens the window
        # to the one that closes it (Lightning's machinery between them included).
        assert_between(
            column(name),
            sums(truth[part], group)[1:],
            sums(truth[f"outer_{part}"], group)[1:],
            name,
        )

    between("Forward (s)", "forward", accumulation)
    between("Backward (s)", "backward", accumulation)
    between("Optimization (s)", "optimization", 1)
    between("Training data loading (s)", "loading", accumulation)
    # The sanity check's batch (the first) is not measured.
    assert_close(column("Evaluation (s)"), truth["evaluation"][1:], "Evaluation")
    assert_close(column("Validation data loading (s)"), truth["val"][1:], "Validation data loading")


def test_forward_is_the_training_step_itself(sidecar: Sidecar) -> None:
    # A cheap forward, three micro-batches a step: Lightning's own work before each
    # training_step (about as long as the step here) is in the iteration, not in Forward.
    truth, folder = fit(
        sidecar, "--accumulation", "3", "--batches", "9", "--epochs", "1", "--forward-s", "0.0005"
    )
    frame = read_tsv(split_dir(folder) / "logs" / "computational.tsv")
    steps = sums(truth["training_step"], 3)[1:]  # the first step is warmup
    assert_close(frame["Forward (s)"].dropna().tolist(), steps, "Forward", abs_s=0.1e-3)


def grouped(values: list[float], sizes: list[int]) -> list[float]:
    """``values`` summed in consecutive groups of the given sizes."""
    sums_, start = [], 0
    for size in sizes:
        sums_.append(sum(values[start : start + size]))
        start += size
    return sums_


def test_validation_inside_an_accumulation_window_and_checkpoint_saves(sidecar: Sidecar) -> None:
    # 8 batches an epoch, a step every 3 (3, 3, 2), a validation every 4 batches: the
    # first falls inside the second step's window. ModelCheckpoint saves after each.
    truth, folder = fit(
        sidecar,
        "--accumulation",
        "3",
        "--batches",
        "8",
        "--val-check-interval",
        "0.5",
        "--ckpt-dir",
        "ckpt",
    )
    frame = read_tsv(split_dir(folder) / "logs" / "computational.tsv")
    for name in TRAINING:  # 2 epochs of 3 steps; the first is warmup
        assert frame[name].notna().sum() == 5, name
    assert frame["Validation (s)"].notna().sum() == 4
    assert frame["Validation loop (s)"].notna().sum() == 8
    assert_close(frame["Evaluation (s)"].dropna().tolist(), truth["evaluation"][1:], "Evaluation")
    # Neither the validation nor the save (25-45 ms here) is any batch's data loading:
    # the script's clock starts each batch's loading after them; Lightning's own work
    # between batches is inside it.
    for name, part in (("Training data loading (s)", "loading"), ("Forward (s)", "forward")):
        assert_between(
            frame[name].dropna().tolist(),
            grouped(truth[part], [3, 3, 2] * 2)[1:],
            grouped(truth[f"outer_{part}"], [3, 3, 2] * 2)[1:],
            name,
        )
    # Each save is the checkpoint phase (the first is warmup): the monitor's wrapper
    # holds the job's, which times the save itself.
    phases = read_tsv(split_dir(folder) / "logs" / "phases.tsv")
    saves = phases[phases["phase"] == "checkpoint"]["wall (s)"].tolist()
    assert_between(saves, truth["save"][1:], truth["save"][1:], "checkpoint", slack_s=2e-3)


def test_a_run_resumed_from_a_lightning_checkpoint_continues_the_split(
    serve: Callable[..., Sidecar],
) -> None:
    first = serve()
    _truth, folder = fit(first, "--epochs", "1", "--ckpt-dir", "ckpt")
    first.stop()
    second = serve()  # a new sidecar: the state comes from the checkpoint only
    fit(second, "--epochs", "2", "--ckpt-dir", "ckpt", "--resume", "ckpt/last.ckpt")
    logs = split_dir(folder) / "logs"
    frame = read_tsv(logs / "computational.tsv")
    assert frame["Epoch (s)"].notna().sum() == 2
    # 6 steps per process, the first of each is warmup (a new process is a cold start).
    assert frame["Training loop (s)"].notna().sum() == 10
    phases = read_tsv(logs / "phases.tsv")
    epochs = phases[phases["phase"] == "Epoch"]
    assert sorted(epochs["epoch"]) == [0, 1]
    assert sorted(set(phases["session"])) == [0, 1]
    assert json.loads((folder / "run.json").read_text())["status"] == "completed"


def test_resume_keeps_the_epoch_open_at_the_checkpoint(serve: Callable[..., Sidecar]) -> None:
    # 6 batches an epoch, a validation every 3: ModelCheckpoint saves at the end of each,
    # the last one of epoch 1 (step 12) before the epoch ends. The job is killed inside
    # epoch 2; Lightning resumes from step 12 at epoch 2.
    first = serve()
    args = ("--epochs", "3", "--ckpt-dir", "ckpt", "--val-check-interval", "0.5")
    _truth, folder = fit(first, *args, "--kill-at-step", "14", killed=True)
    first.stop()
    second = serve()
    fit(second, *args, "--resume", "ckpt/epoch=1-step=12.ckpt")
    phases = read_tsv(split_dir(folder) / "logs" / "phases.tsv")
    epochs = phases[phases["phase"] == "Epoch"]
    flags = [flag if isinstance(flag, str) else "" for flag in epochs["flag"]]
    # Epoch 1, cut by the checkpoint, is one Epoch row (the resumed process went on with
    # epoch 2: its part up to the checkpoint is all of it), and its part is kept.
    assert list(zip(epochs["epoch"], epochs["session"], flags, strict=True)) == [
        (0, 0, ""),
        (1, 0, ""),
        (1, 0, "part"),
        (2, 1, ""),
    ]
    part = epochs.iloc[flags.index("part")]
    assert epochs.iloc[1]["wall (s)"] == part["wall (s)"]
    validations = phases[(phases["phase"] == "Validation") & (phases["epoch"] == 1)]
    # The part runs up to the checkpoint, taken at the end of epoch 1's last validation.
    assert part["start (s)"] + part["wall (s)"] >= validations["start (s)"].max()
    assert (
        read_tsv(split_dir(folder) / "logs" / "computational.tsv")["Epoch (s)"].notna().sum() == 3
    )


def test_ddp_on_two_cpu_processes_writes_the_rank_files(sidecar: Sidecar) -> None:
    _truth, folder = fit(sidecar, "--devices", "2", "--epochs", "1", "--batches", "4")
    logs = split_dir(folder) / "logs"
    for name in ("computational.tsv", "computational-rank1.tsv", "phases-rank1.tsv"):
        assert (logs / name).is_file(), name
    for name in ("computational.tsv", "computational-rank1.tsv"):
        # Each rank runs the 4 batches of its own loader (a plain iterable gets no
        # distributed sampler); the first step is warmup.
        assert read_tsv(logs / name)["Forward (s)"].notna().sum() == 3, name
    assert (folder / "truth-0.json.rank1").is_file()


def test_the_callback_never_raises_into_the_trainer(caplog: pytest.LogCaptureFixture) -> None:
    from markers.integrations.lightning import MonitorCallback

    callback = MonitorCallback(warmup_iterations=0)
    # A trainer without the attributes the callback reads: the error is logged once.
    assert callback.setup(object(), None, "fit") is None
    assert callback.on_train_epoch_start(object(), None) is None
    errors = [r for r in caplog.records if r.name == "markers.integrations"]
    assert len(errors) == 1 and "setup" in errors[0].getMessage()
    with pytest.raises(TypeError, match="unknown keyword arguments"):
        MonitorCallback(warmup=3)


def test_the_pytorch_lightning_namespace_accepts_the_callback() -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from markers.integrations.lightning import MonitorCallback

    callback = MonitorCallback()
    trainer = pytorch_lightning.Trainer(
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    assert callback in trainer.callbacks
