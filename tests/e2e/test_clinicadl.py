"""MonitorCallback for clinicadl 2.0: a real ``Trainer`` on a synthetic BIDS folder (8x8x8
NIfTI volumes), the model's steps sleeping known times. Against clinicadl's own monitor on
the same data and settings; each ending (accumulation with an odd batch count, a crash
then ``from_maps(...).resume``, Ctrl-C, two splits on one Trainer, ours passed alone).
Each job starts its own private sidecar, as a clinicadl user's script does."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tests.support.contract import STANDARD_COLUMNS
from tests.support.helpers import REPO, env, read_tsv, run_json, split_dir
from tests.support.spin import assert_between

pytest.importorskip("clinicadl")
pytest.importorskip("nibabel")
JOB = REPO / "tests" / "support" / "jobs" / "clinicadl_job.py"
TRAINING = ["Training loop (s)", "Training data loading (s)", "Forward (s)", "Backward (s)"]
VALIDATION = ["Validation loop (s)", "Validation data loading (s)", "Evaluation (s)"]
# Phases both monitors open and close at the same two events: the model's part, and the
# events that open and close the window.
ALIKE = {
    "Forward (s)": ("forward", "on_forward_step_start", "on_backward_step_start"),
    "Backward (s)": ("backward", "on_backward_step_start", "on_backward_step_end"),
    "Optimization (s)": (
        "optimization",
        "on_optimization_step_start",
        "on_optimization_step_end",
    ),
    "Evaluation (s)": ("evaluation", "on_evaluation_step_start", "on_metrics_computation_start"),
}
WARMUP = 2  # the job's default


def train(root: Path, *args: str, code: int = 0) -> dict[str, Any]:
    """Run the clinicadl job in ``root`` (its MAPS folder is ``root/maps``); its truth."""
    root.mkdir(parents=True, exist_ok=True)
    truth = root / f"truth-{len(list(root.glob('truth-*')))}.json"
    result = subprocess.run(
        [sys.executable, str(JOB), str(root), str(truth), *args],
        cwd=root,
        env=env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == code, result.stderr[-3000:]
    return json.loads(truth.read_text())


def windows(truth: dict[str, Any], opening: str, closing: str) -> list[float]:
    """The script's clock from just before markers' callback at ``opening`` to just after
    it at ``closing``, each time: a window that holds the monitor's row."""
    return [
        end - start
        for start, end in zip(truth["open"][opening], truth["close"][closing], strict=True)
    ]


def summary(maps: Path, split: int = 0) -> str:
    return (split_dir(maps, split) / "summary.log").read_text()


def computational(maps: Path, split: int = 0) -> pd.DataFrame:
    return read_tsv(split_dir(maps, split) / "logs" / "computational.tsv")


def throughput(text: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith("Throughput: "))
    return float(line.split()[1])  # "nan" parses too: the caller checks it is a number


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The stock monitor's run, ours, and both on the same batches (the stock one's table
    saved beside), on the same data and settings: 3 epochs of 4 training batches and 2
    validation batches, warmup 2."""
    root = tmp_path_factory.mktemp("clinicadl")
    return {
        monitor: (root / monitor / "maps", train(root / monitor, "--monitor", monitor))
        for monitor in ("stock", "ours", "both")
    }


def test_same_paths_and_columns_as_the_stock_monitor(both: dict) -> None:
    for monitor in ("stock", "ours"):
        maps = both[monitor][0]
        table = split_dir(maps) / "logs" / "computational.tsv"
        header = table.read_text().splitlines()[0].split("\t")
        assert header == STANDARD_COLUMNS, monitor  # the 22 columns, no index column
        assert summary(maps).count("Computational Summary") == 1, monitor
    ours = both["ours"][0]
    assert (split_dir(ours) / "logs" / "phases.tsv").exists()  # ours beside its table
    assert run_json(ours.parent / "maps")["status"] == "completed"
    callbacks = json.loads((ours / "callbacks.json").read_text())["callbacks"]
    assert "markers.integrations.clinicadl.MonitorCallback(num_measurements=100, " in str(callbacks)


def test_counts_agree_with_the_stock_monitor_where_it_is_right(both: dict) -> None:
    stock, ours = (computational(both[m][0]).notna().sum() for m in ("stock", "ours"))
    # 12 training batches, the first 2 warmup; 6 validation batches, none warmup (ours:
    # warmup is of training iterations).
    for name in [*TRAINING, "Optimization (s)"]:
        assert ours[name] == 10, name
    for name in [*VALIDATION, "Metrics computation (s)"]:
        assert ours[name] == 6, name
    assert (ours["Epoch (s)"], ours["Validation (s)"], ours["Training (s)"]) == (3, 3, 1)
    # The reference switches its warmup on at the end of a backward pass: the Optimization
    # of that batch is measured, its Forward and Backward are not. Everything else counts
    # alike.
    assert stock["Optimization (s)"] == ours["Optimization (s)"] + 1
    for name in STANDARD_COLUMNS:
        if name != "Optimization (s)":
            assert stock[name] == ours[name], name


def test_means_agree_with_the_stock_monitor_and_rows_with_the_clock(both: dict) -> None:
    maps, truth = both["both"]
    stock = read_tsv(maps.parent / "stock.tsv")  # the same batches, measured by both
    ours = computational(maps)
    for name, (part, opening, closing) in ALIKE.items():
        assert abs(ours[name].mean() - stock[name].mean()) <= 0.15 * stock[name].mean(), name
        # Ours row by row: within 5 % or 0.5 ms of the script's clock, between the model's
        # own step and the window from the event before ours to the event after it.
        skip = 0 if part == "evaluation" else WARMUP
        assert_between(
            ours[name].dropna().tolist(),
            truth[part][skip:],
            windows(truth, opening, closing)[skip:],
            name,
            0.05,
            0.5e-3,
        )
    epochs = windows(truth, "on_epoch_start", "on_epoch_end")
    assert_between(ours["Epoch (s)"].dropna().tolist(), epochs, epochs, "Epoch", 0.05, 0.5e-3)
    # Its validation data loading is its own, not a copy of the loop (the reference's).
    loading, loop = (stock[f"Validation {x} (s)"].dropna() for x in ("data loading", "loop"))
    assert loading.tolist() == loop.tolist()
    loading, loop = (ours[f"Validation {x} (s)"].dropna() for x in ("data loading", "loop"))
    assert len(loading) == len(loop) and (loading < loop).all()
    assert ours["Training (s)"].iloc[0] <= truth["train_s"][0]


def test_accumulation_with_an_odd_batch_count_and_ours_passed_alone(tmp_path: Path) -> None:
    """7 batches of 1, accumulation 2: steps after batches 2, 4 and 6; the epoch's last
    batch never steps (clinicadl carries its gradients into the next epoch): an incomplete
    iteration, flagged, no row. Every Optimization cell sits on its own step's row, each
    against the script's clock. Ours passed alone switches the stock default off, with one
    warning."""
    truth = train(
        tmp_path,
        *("--monitor", "alone", "--train", "7", "--batch", "1", "--accumulation", "2"),
        *("--epochs", "2", "--warmup", "1"),
    )
    assert len(truth["warnings"]) == 1 and "switched off" in truth["warnings"][0]
    maps = tmp_path / "maps"
    assert summary(maps).count("Computational Summary") == 1
    frame = computational(maps)
    # 2 epochs x 3 whole steps of 2 batches, the first one warmup: 5 rows, each with all
    # of its training cells (the Optimization cell on the row of its own step).
    stepped = frame["Training loop (s)"].notna()
    assert stepped.sum() == 5
    for name in [*TRAINING, "Optimization (s)"]:
        assert frame[name].notna().tolist() == stepped.tolist(), name
    phases = read_tsv(split_dir(maps) / "logs" / "phases.tsv")
    loop = phases.query("phase == 'Training loop'")
    whole, cut = loop[loop["flag"].isna()], loop[loop["flag"].notna()]
    assert whole["batches"].tolist() == [2] * 5  # the warmup step is not stored
    assert cut["batches"].tolist() == [1, 1]  # the lone batches, kept flagged
    assert (cut["flag"] == "incomplete").all()
    # Forward of a step: its batches' Forward summed; the lone batches (7th, 14th) in none.
    ends = [2, 4, 6, 9, 11, 13]  # steps' ends, in batches (2 epochs of 7)
    starts = [end - 2 for end in ends]

    def per_step(values: list[float]) -> list[float]:
        return [sum(values[a:b]) for a, b in zip(starts, ends, strict=True)][1:]

    _part, opening, closing = ALIKE["Forward (s)"]
    assert_between(
        frame["Forward (s)"].dropna().tolist(),
        per_step(truth["forward"]),
        per_step(windows(truth, opening, closing)),
        "Forward",
        0.05,
        0.5e-3,
    )
    _part, opening, closing = ALIKE["Optimization (s)"]
    assert len(truth["optimization"]) == 6
    assert_between(
        frame["Optimization (s)"].dropna().tolist(),
        truth["optimization"][1:],
        windows(truth, opening, closing)[1:],
        "Optimization",
        0.05,
        0.5e-3,
    )
    assert throughput(summary(maps)) > 0


def test_a_crash_then_resume_from_the_checkpoint(tmp_path: Path) -> None:
    """A callback raises at epoch 3 (checkpoints after every epoch): the files are written
    marked failed; ``from_maps(...).resume(0)`` in a new process continues the split."""
    first = train(tmp_path, "--raise-at-epoch", "3", "--epochs", "4", code=1)
    maps = tmp_path / "maps"
    document = run_json(maps)
    assert document["status"] == "failed" and "boom at epoch 3" in document["cause"]
    assert computational(maps)["Epoch (s)"].notna().sum() == 2
    second = train(tmp_path, "--resume")
    document = run_json(maps)
    assert document["status"] == "completed"
    frame = computational(maps)
    assert frame["Epoch (s)"].notna().sum() == 4  # epochs 1-2, then 3-4 after the resume
    # Training adds up both sessions, each within its own Trainer call.
    training_s = frame["Training (s)"].iloc[0]
    assert training_s <= first["train_s"][0] + second["train_s"][0]
    # A resumed run starts at its first epoch (after clinicadl's checkpoint has loaded),
    # so the script's window of that epoch also holds the start of our sidecar: Training
    # holds the stored epochs, the first session's whole windows too.
    assert training_s >= frame["Epoch (s)"].sum()
    assert training_s >= sum(windows(first, "on_epoch_start", "on_epoch_end"))
    value = throughput(summary(maps))
    assert value == value and value > 0  # a number, never nan
    phases = read_tsv(split_dir(maps) / "logs" / "phases.tsv")
    assert set(phases["session"]) == {0, 1}


def files(maps: Path) -> dict[str, bytes]:
    """Every file of the MAPS folder, by path inside it, with its bytes."""
    return {str(p.relative_to(maps)): p.read_bytes() for p in maps.rglob("*") if p.is_file()}


def test_a_refused_resume_leaves_the_maps_as_it_was(tmp_path: Path) -> None:
    """A MAPS trained with the stock monitor (a crash at epoch 3), resumed with ours added:
    clinicadl refuses (no checkpoint of ours among its callbacks' files). Ours starts and
    writes nothing; resumed again with the stock list, clinicadl trains to the end and
    writes the final model (the stock monitor finds no table of ours in its way)."""
    train(tmp_path, "--monitor", "stock", "--raise-at-epoch", "3", code=1)
    maps = tmp_path / "maps"
    before = files(maps)
    train(tmp_path, "--monitor", "ours", "--resume", code=1)
    after = files(maps)
    assert not (maps / "run.json").exists()
    # Only clinicadl's own traces of the refused call: its exec logs, and the line its
    # logger appends to summary.log.
    assert all(name.startswith("exec/") for name in set(after) - set(before))
    summary_log = "training/split-0/summary.log"
    changed = {name for name in before if after.get(name) != before[name]}
    assert changed <= {summary_log}
    assert after[summary_log].startswith(before[summary_log])
    assert b"Computational Summary" not in after[summary_log][len(before[summary_log]) :]
    train(tmp_path, "--monitor", "stock", "--resume")
    assert (split_dir(maps) / "models" / "final" / "model.pt").exists()
    assert computational(maps)["Epoch (s)"].notna().sum() == 3
    assert summary(maps).count("Computational Summary") == 1


def test_a_stock_only_resume_after_a_crash_of_ours_costs_nothing(tmp_path: Path) -> None:
    """A split ours measured crashes at epoch 3 (our table stays, written at every
    checkpoint). Resumed with the stock monitor alone, clinicadl refuses at once: its
    monitor cannot resume from the state it saved switched off (its checkpoint has no
    running clock), so it never reaches our table, and the MAPS stays as it was. Resumed
    with ours, the split ends with its final model."""
    train(tmp_path, "--monitor", "ours", "--raise-at-epoch", "3", code=1)
    maps = tmp_path / "maps"
    before = files(maps)
    train(tmp_path, "--monitor", "stock", "--resume", code=1)
    after = files(maps)
    assert all(name.startswith("exec/") for name in set(after) - set(before))
    summary_log = "training/split-0/summary.log"
    assert {name for name in before if after.get(name) != before[name]} <= {summary_log}
    train(tmp_path, "--monitor", "ours", "--resume")
    assert (split_dir(maps) / "models" / "final" / "model.pt").exists()
    assert computational(maps)["Epoch (s)"].notna().sum() == 3
    assert run_json(maps)["status"] == "completed"


def test_ctrl_c_writes_the_split_incomplete(tmp_path: Path) -> None:
    train(tmp_path, "--interrupt-at-epoch", "2", code=-signal.SIGINT)
    maps = tmp_path / "maps"
    document = run_json(maps)
    assert (document["status"], document["cause"]) == ("incomplete", "KeyboardInterrupt")
    assert computational(maps)["Epoch (s)"].notna().sum() == 1


def test_two_splits_on_one_trainer(tmp_path: Path) -> None:
    train(tmp_path, "--splits", "2", "--epochs", "2")
    maps = tmp_path / "maps"
    document = run_json(maps)
    assert document["status"] == "completed"
    assert sorted(document["splits"]) == ["0", "1"]
    for split in (0, 1):
        assert document["splits"][str(split)]["status"] == "completed"
        assert computational(maps, split)["Epoch (s)"].notna().sum() == 2
        assert summary(maps, split).count("Computational Summary") == 1


def _block_layout(text: str) -> list[tuple[int, str, list[int]]]:
    """Each line of the Computational Summary table, from its title to the validation
    throughput: its length, its label and where its column bars stand (the values,
    measured by each monitor, differ)."""
    lines = text[text.index("***") :].splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("Throughput:") and i > 12)
    return [
        (len(line), line.split("|")[0], [i for i, c in enumerate(line) if c == "|"])
        for line in lines[: end + 1]
        if not line.startswith(("Throughput:", "GPU throughput:"))
    ]


def test_the_block_is_laid_out_as_the_stock_monitor_lays_it_out(both: dict) -> None:
    """Line for line, the stock's block and ours: the same widths (106, padded, not
    stripped), labels and column bars, so a diff shows the figures only."""
    stock, ours = (_block_layout(summary(both[m][0])) for m in ("stock", "ours"))
    assert ours == stock
    assert sum(length == 106 for length, _, _ in ours) >= 14


def test_ours_disabled_alone_means_no_monitoring(tmp_path: Path) -> None:
    """Ours passed alone with enabled=False: no monitor measures (the stock default that
    clinicadl adds in its place is switched off too, as the stock's enabled=False is), no
    file of ours, no Computational Summary, no warning; the model is trained."""
    truth = train(tmp_path, "--monitor", "off", "--epochs", "1")
    assert truth["warnings"] == []
    maps = tmp_path / "maps"
    assert "Computational Summary" not in summary(maps)
    logs = split_dir(maps) / "logs"
    assert not (logs / "computational.tsv").exists() and not (logs / "phases.tsv").exists()
    assert not (maps / "run.json").exists()
    assert list(split_dir(maps).glob("best-*")) or list(maps.rglob("*.pt"))
