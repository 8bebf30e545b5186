"""Every loop shape of docs/iteration-model.md through ``sidecar run`` and a real training
process (``tests/support/jobs/shapes_job.py``): every stored row against the loop's own
``perf_counter`` clock, and Forward/Backward/Optimization/Training loop rows aligned.

A phase row must lie between what the loop measured just inside and just outside the
marker (exact on any machine, however loaded); an iteration's loop row between the sum
of its parts and the loop's window around it plus 5 % or 0.2 ms (the driver stamps the
end just after the body, where a busy machine may preempt it). Durations are sleeps of
tens of milliseconds, a few batches per shape.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tests.support.contract import STANDARD_COLUMNS
from tests.support.helpers import REPO, env, read_tsv, split_dir, under_sidecar_run, wait_for

JOB = REPO / "tests" / "support" / "jobs" / "shapes_job.py"
SLACK_S = 0.0002  # or 5 %: the driver's own steps after a body, on the loop's clock
EDGE_S = 2e-6  # perf_counter vs perf_counter_ns rounding
STEP = ("Forward", "Backward", "Optimization")


@dataclass
class Result:
    """What one shape left: the job's clock, both tables, the summary, its exit."""

    truth: dict[str, list[dict[str, float]]]
    frame: pd.DataFrame
    phases: pd.DataFrame
    summary: str
    returncode: int
    stderr: str

    def column(self, label: str) -> list[float]:
        return list(self.frame[f"{label} (s)"].dropna())

    def flagged(self, flag: str) -> pd.DataFrame:
        return self.phases[self.phases["flag"] == flag]

    def measured(self, phase: str) -> pd.DataFrame:
        return self.phases[(self.phases["phase"] == phase) & self.phases["flag"].isna()]


def run_shape(folder: Path, shape: str, *args: str) -> Result:
    """``sidecar run -- python shapes_job.py SHAPE`` in ``folder``; its files read back."""
    truth = folder / "truth.json"
    process = subprocess.run(
        under_sidecar_run(JOB, shape, str(truth), *args),
        cwd=folder,
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    logs = split_dir(folder / "maps") / "logs"
    return Result(
        json.loads(truth.read_text()),
        read_tsv(logs / "computational.tsv"),
        read_tsv(logs / "phases.tsv"),
        (split_dir(folder / "maps") / "summary.log").read_text(),
        process.returncode,
        process.stderr,
    )


def slack(outer_s: float) -> float:
    """What a row stamped by the driver just after the loop's own clock may add."""
    return max(0.05 * outer_s, SLACK_S)


def assert_phase(rows: list[float], truth: list[dict[str, float]], what: str) -> None:
    """Each row between the loop's clock just inside and just outside its marker."""
    assert len(rows) == len(truth), f"{what}: {len(rows)} rows, the loop timed {len(truth)}"
    for got, seen in zip(rows, truth, strict=True):
        inner = seen.get("inner", 0.0)
        assert inner - EDGE_S <= got <= seen["outer"] + EDGE_S, f"{what}: {got} vs {seen}"


def assert_loops(
    rows: list[float], parts: list[float], windows: list[float], what: str = "Training loop"
) -> None:
    """Each loop row holds its parts and fits the loop's window around it."""
    assert len(rows) == len(parts) == len(windows), what
    for got, inner, outer in zip(rows, parts, windows, strict=True):
        assert inner - EDGE_S <= got <= outer + slack(outer), (
            f"{what}: {got} not in [{inner}, {outer}]"
        )


def inner(truth: list[dict[str, float]]) -> list[float]:
    return [t["inner"] for t in truth]


def assert_aligned(result: Result, labels: tuple[str, ...] = STEP) -> None:
    """Row i of each label and of Training loop is the same iteration (phases.tsv)."""
    loops = list(result.measured("Training loop")["iteration"])
    for label in labels:
        assert list(result.measured(label)["iteration"]) == loops, label
        assert len(result.column(label)) == len(loops), label
    assert len(result.column("Training loop")) == len(loops)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path


def test_plain_loop(folder: Path) -> None:
    result = run_shape(folder, "plain")
    assert result.returncode == 0, result.stderr
    truth = result.truth
    for label in ("Training data loading", *STEP):
        assert_phase(result.column(label), truth[label], label)
    parts = [
        sum(t[i]["inner"] for t in (truth["Training data loading"], *(truth[p] for p in STEP)))
        for i in range(3)
    ]
    assert_loops(
        result.column("Training loop"), parts, [t["outer"] for t in truth["Training loop"]]
    )
    assert_aligned(result)
    assert result.phases["flag"].isna().all()
    assert list(result.measured("Training loop")["batches"]) == [1, 1, 1]


def test_break_ends_its_iteration_there(folder: Path) -> None:
    result = run_shape(folder, "break")
    assert result.returncode == 0, result.stderr
    truth = result.truth
    # 3 iterations, then 2 (the 3rd batch was fetched, never used), then 4: nothing of a
    # left iteration moved into the next epoch's first one (its own durations show it).
    assert_aligned(result)
    assert list(result.measured("Training loop")["epoch"]) == [0] * 3 + [1] * 2 + [2] * 4
    for label in STEP:
        assert_phase(result.column(label), truth[label], label)
    loading = result.column("Training data loading")
    used = [t for i, t in enumerate(truth["Training data loading"]) if i != 5]  # 6th: unused
    assert_phase(loading, used, "Training data loading")
    parts = [sum(x) for x in zip(inner(used), *(inner(truth[p]) for p in STEP), strict=True)]
    assert_loops(
        result.column("Training loop"), parts, [t["outer"] for t in truth["Training loop"]]
    )
    # The iteration left before its batch was used: kept in phases.tsv, flagged, alone.
    cut = result.flagged("incomplete")
    assert sorted(cut["phase"]) == ["Training data loading", "Training loop"]
    assert set(cut["epoch"]) == {1} and set(cut["batches"]) == {0}
    (left,) = truth["left"]
    assert cut[cut["phase"] == "Training loop"]["wall (s)"].iloc[0] <= left["outer"] + slack(
        left["outer"]
    )
    assert len(result.column("Epoch")) == 3


def test_validation_inside_the_training_loop_is_its_own_measurement(folder: Path) -> None:
    result = run_shape(folder, "validation")
    assert result.returncode == 0, result.stderr
    truth = result.truth
    # Every training iteration keeps its rows; the two passes are Validation rows.
    assert_aligned(result)
    for label in (
        "Training data loading",
        *STEP,
        "Validation data loading",
        "Evaluation",
        "Validation",
    ):
        assert_phase(result.column(label), truth[label], label)
    parts = [
        sum(x)
        for x in zip(
            inner(truth["Training data loading"]), *(inner(truth[p]) for p in STEP), strict=True
        )
    ]
    # Its loop time excludes the pass: at most the window less the pass the loop timed.
    windows = [t["outer"] - t["away"] for t in truth["Training loop"]]
    assert_loops(result.column("Training loop"), parts, windows)
    val_parts = [
        a + b
        for a, b in zip(
            inner(truth["Validation data loading"]), inner(truth["Evaluation"]), strict=True
        )
    ]
    assert_loops(
        result.column("Validation loop"),
        val_parts,
        [t["outer"] for t in truth["Validation loop"]],
        "Validation loop",
    )
    assert result.phases["flag"].isna().all()
    throughput = re.search(r"^Throughput: (\S+) images/s", result.summary, re.M)
    assert float(throughput[1]) == pytest.approx(
        4 * 4 / sum(result.column("Training loop")), rel=1e-3
    )


def test_custom_names_of_standard_labels_are_refused_once(folder: Path) -> None:
    result = run_shape(folder, "names")
    assert result.returncode == 0, result.stderr
    for name in ("Forward", "training LOOP", "EPOCH", "Forward GPU"):
        assert result.stderr.count(f"phase {name!r} refused") == 1, result.stderr
    # Nothing shadowed a standard column; the tab and newline became spaces.
    assert list(result.frame.columns[len(STANDARD_COLUMNS) :]) == ["my phase name (s)"]
    assert_phase(result.column("my phase name"), result.truth["my phase name"], "custom")
    for label in STEP:
        assert_phase(result.column(label), result.truth[label], label)
    assert len(result.column("Epoch")) == 1 and len(result.column("Training loop")) == 3
    assert_aligned(result)


def test_custom_phases_keep_their_identity_across_a_resume(folder: Path) -> None:
    first = run_shape(folder, "resume")
    assert first.returncode == 0, first.stderr
    second = run_shape(folder, "resume", "--resume")
    assert second.returncode == 0, second.stderr
    for name in ("a", "b"):
        assert_phase(second.column(name), first.truth[name] + second.truth[name], name)
    assert list(second.frame.columns[len(STANDARD_COLUMNS) :]) == ["a (s)", "b (s)"]
    assert list(second.measured("a")["session"]) == [0] * 3 + [1] * 3


def test_loader_phases_belong_to_the_batch_they_load(folder: Path) -> None:
    result = run_shape(folder, "loader")
    assert result.returncode == 0, result.stderr
    truth = result.truth
    # The generator's "augment" and the Dataset's "decode" (2 per batch of 2): one row per
    # iteration, inside that iteration's data loading.
    assert_phase(result.column("augment"), truth["augment"], "augment")
    decode = result.column("decode")
    assert len(decode) == 2
    for got, pair in zip(decode, (truth["decode"][0:2], truth["decode"][2:4]), strict=True):
        assert sum(inner(pair)) - EDGE_S <= got <= sum(t["outer"] for t in pair) + EDGE_S
    loops = result.measured("Training loop")
    assert list(result.measured("augment")["iteration"]) == list(loops["iteration"])[:3]
    assert list(result.measured("decode")["iteration"]) == list(loops["iteration"])[3:5]
    loading = result.column("Training data loading")
    for got, seen in zip(loading[:3], truth["augment"], strict=True):
        assert got >= seen["inner"]
    assert result.flagged("outside").empty
    # Phases inside DataLoader worker processes cannot be measured: said once, with N.
    lines = re.findall(
        r"^(\d+) phases inside DataLoader workers were not measured", result.summary, re.M
    )
    assert lines == ["4"]
    assert result.stderr.count("phases inside DataLoader workers were not measured") == 1


def test_a_phase_entered_inside_itself_is_one_measurement(folder: Path) -> None:
    result = run_shape(folder, "nested")
    assert result.returncode == 0, result.stderr
    assert_phase(result.column("Forward"), result.truth["Forward"], "Forward (outer only)")
    assert_aligned(result, ("Forward", "Backward"))


def test_a_phase_outside_any_iteration_is_flagged_and_kept_out(folder: Path) -> None:
    result = run_shape(folder, "probe")
    assert result.returncode == 0, result.stderr
    assert_aligned(result)
    assert_phase(result.column("Forward"), result.truth["Forward"], "Forward")
    outside = result.flagged("outside")
    assert list(outside["phase"]) == ["Forward"]
    assert_phase(list(outside["wall (s)"]), result.truth["probe"], "probe")
    assert list(outside["iteration"]) == [-1]


@pytest.mark.parametrize("how", ["exception", "sigint"])
def test_an_epoch_cut_by_an_exception_or_ctrl_c_is_kept_flagged(folder: Path, how: str) -> None:
    result = run_shape(folder, how)
    assert result.returncode != 0
    truth = result.truth
    # Epoch 0 whole; epoch 1 cut in its 2nd iteration: that iteration and the epoch are
    # flagged incomplete in phases.tsv, not measurements.
    assert len(result.column("Epoch")) == 1
    assert_phase(result.column("Epoch"), truth["Epoch"], "Epoch")
    assert_aligned(result, ("Forward", "Backward"))
    assert len(result.column("Training loop")) == 4
    cut = result.flagged("incomplete")
    assert sorted(cut["phase"]) == ["Epoch", "Forward", "Training data loading", "Training loop"]
    assert set(cut["epoch"]) == {1}
    forward = cut[cut["phase"] == "Forward"]["wall (s)"].iloc[0]
    assert_phase([forward], truth["Forward"][-1:], "the cut iteration's Forward")
    assert_phase(result.column("Forward"), truth["Forward"][:-1], "Forward")


def test_an_epoch_cut_by_sigkill_is_kept_flagged(folder: Path) -> None:
    truth_path = folder / "truth.json"
    process = subprocess.Popen(
        under_sidecar_run(JOB, "killed", str(truth_path)),
        cwd=folder,
        env=env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == -signal.SIGKILL or process.returncode == 128 + 9, stderr
    logs = split_dir(folder / "maps") / "logs"
    wait_for(lambda: (logs / "phases.tsv").exists(), 10, "phases.tsv")
    phases = read_tsv(logs / "phases.tsv")
    frame = read_tsv(logs / "computational.tsv")
    assert frame["Epoch (s)"].notna().sum() == 1
    cut = phases[phases["flag"] == "incomplete"]
    assert "Epoch" in set(cut["phase"]) and set(cut["epoch"]) == {1}
    assert "Training loop" not in set(cut["phase"])  # its loop record never came
    truth: dict[str, Any] = json.loads(truth_path.read_text())
    epoch_cut = cut[cut["phase"] == "Epoch"]["wall (s)"].iloc[0]
    assert epoch_cut >= sum(inner(truth["Forward"][3:]))
    assert frame["Training loop (s)"].notna().sum() == 4


def test_accumulation_with_a_short_last_step_counts_its_own_batches(folder: Path) -> None:
    result = run_shape(folder, "accumulation")
    assert result.returncode == 0, result.stderr
    truth = result.truth
    steps = [(0, 3), (3, 6), (6, 7)]
    for label in ("Forward", "Backward", "Training data loading"):
        rows = result.column(label)
        assert len(rows) == 3, label
        for got, (a, b) in zip(rows, steps, strict=True):
            part = truth[label][a:b]
            outer = sum(t["outer"] for t in part)
            assert sum(inner(part)) - EDGE_S <= got <= outer + EDGE_S, label
    assert_phase(result.column("Optimization"), truth["Optimization"], "Optimization")
    assert list(result.measured("Training loop")["batches"]) == [3, 3, 1]
    assert_aligned(result)
    loop_s = sum(result.column("Training loop"))
    assert f"Throughput: {4 * 7 / loop_s:.2f} images/s" in result.summary


@pytest.mark.parametrize("shape", ["short_batch", "short_given"])
def test_a_short_batch_inside_a_step_counts_the_samples_it_holds(folder: Path, shape: str) -> None:
    # Sizes read from the batches, 4 a step; the loader's last batch (10 of 64) is the
    # second of the last step: that step held 74 samples, not 2 x 64. With
    # train_batch_size=64 given too, the size the batch itself tells wins.
    result = run_shape(folder, shape)
    assert result.returncode == 0, result.stderr
    loops = result.measured("Training loop")
    assert list(loops["batches"]) == [4, 4, 2]
    assert list(loops["batch size"]) == [64, 64, 64]  # of each step's first batch
    samples = sum(t["count"] for t in result.truth["samples"])  # what the loop got: 586
    throughput = re.search(r"^Throughput: (\S+) images/s", result.summary, re.M)
    assert throughput is not None, result.summary
    assert float(throughput[1]) == pytest.approx(
        samples / sum(result.column("Training loop")), rel=1e-3
    )


def test_custom_phases_survive_a_sidecar_takeover_and_a_full_queue(serve, short_tmp: Path) -> None:
    first = serve()
    out, state = short_tmp / "root" / "taken", short_tmp
    job = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "support" / "jobs" / "takeover_job.py"),
            str(out),
            str(state),
        ],
        cwd=short_tmp,
        env=env(SIDECAR_ENDPOINT=first.endpoint),
        stdin=subprocess.DEVNULL,
    )
    wait_for(
        lambda: (state / "checkpointed").exists() or job.poll() is not None,
        60,
        "the first checkpoint",
    )
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    (state / "go").touch()
    # 1000 declarations and their records while no sidecar listens: the queue overflows.
    wait_for(
        lambda: (state / "declared").exists() or job.poll() is not None, 60, "the names to be used"
    )
    second = serve()  # same endpoint: it learns the run, and every name, from the hello
    wait_for(
        lambda: (v := second.status()) and v["runs"] and v["runs"][0]["records"] > 2000,
        60,
        "the new sidecar to take the run over",
    )
    (state / "stop").touch()
    assert job.wait(60) == 0
    frame = read_tsv(split_dir(out) / "logs" / "computational.tsv")
    custom = [c[:-4] for c in frame.columns[len(STANDARD_COLUMNS) :]]
    assert sorted(custom) == sorted(["early", *(f"name {i:04d}" for i in range(1000))])
    assert frame["early (s)"].notna().sum() > 3  # before and after the takeover, one column
    summary = (split_dir(out) / "summary.log").read_text()
    rejected = re.search(r"Records: .*rejected (\d+)", summary)
    assert rejected is not None and rejected[1] == "0", summary
    dropped = re.search(r"Records: received \d+, dropped (\d+)", summary)
    assert dropped is not None and int(dropped[1]) > 0  # the queue did overflow
