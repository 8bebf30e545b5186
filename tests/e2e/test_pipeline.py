"""End to end: markers in this process, a real sidecar process, real files (docs/contract.md,
Markers API to Semantics)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

import markers
from sidecar.sinks.summary import TITLE_LINE
from tests.support.contract import STANDARD_COLUMNS
from tests.support.helpers import Sidecar, env, read_tsv


class Truth:
    """What the test itself measured around each injected sleep, per phase, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def sleep(self, phase: str, seconds: float) -> None:
        """Sleep and record how long it really took (sleeps overshoot on busy machines)."""
        start = time.perf_counter()
        if seconds:
            time.sleep(seconds)
        self.seconds[phase].append(time.perf_counter() - start)

    def loader(self, phase: str, batches: int, seconds: float, size: int = 4) -> Iterator[list]:
        """A data loader whose every batch takes ``seconds`` to arrive."""
        for _ in range(batches):
            self.sleep(phase, seconds)
            yield [0] * size


def train(
    run: markers.Run,
    epochs: int,
    train_batches: int,
    val_batches: int,
    truth: Truth | None = None,
    sleeps: dict[str, float] | None = None,
    custom: str | None = None,
    sizes: tuple[int, int] = (4, 4),
) -> Truth:
    """A scripted training loop with every phase; ``sleeps`` injects known durations;
    ``sizes``: the samples of a training and of a validation batch."""
    truth = truth or Truth()
    sleeps = sleeps or {}
    for _ in range(epochs):
        with run.epoch():
            loader = truth.loader(
                "train loading", train_batches, sleeps.get("train loading", 0), sizes[0]
            )
            for _batch in run.train_batches(loader):
                for phase in ("forward", "backward", "optimization"):
                    with run.phase(phase):
                        truth.sleep(phase, sleeps.get(phase, 0))
                if custom:
                    with run.phase(custom):
                        truth.sleep(custom, sleeps.get(custom, 0))
            with run.validation():
                loader = truth.loader(
                    "val loading", val_batches, sleeps.get("val loading", 0), sizes[1]
                )
                for _batch in run.val_batches(loader):
                    for phase in ("evaluation", "metrics"):
                        with run.phase(phase):
                            truth.sleep(phase, sleeps.get(phase, 0))
    return truth


def test_computational_tsv_has_exactly_the_reference_header(sidecar: Sidecar) -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        train(run, epochs=1, train_batches=3, val_batches=2)
    tsv = sidecar.split_dir() / "logs" / "computational.tsv"
    header = tsv.read_text().splitlines()[0].split("\t")
    assert header == STANDARD_COLUMNS
    frame = read_tsv(tsv)
    assert frame["Forward GPU (s)"].isna().all()  # CPU-only: GPU columns empty


def test_counts_follow_warmup_at_iteration_boundaries_and_caps(sidecar: Sidecar) -> None:
    # Warmup counts training and validation batches: epoch 0 measures 7 of 10 training
    # iterations (gates 0..9 against warmup 3) and all 5 validation ones (gates 10..14);
    # epoch 1 measures everything. 17 training and 10 validation iterations measured,
    # 8 of each stored.
    with markers.start_run(
        out_dir="maps",
        warmup_iterations=3,
        num_measurements=8,
        train_batch_size=4,
        val_batch_size=4,
    ) as run:
        train(run, epochs=2, train_batches=10, val_batches=5)
    logs = sidecar.split_dir() / "logs"
    frame = read_tsv(logs / "computational.tsv")
    counts = frame.notna().sum()
    expected = {"Training (s)": 1, "Epoch (s)": 2, "Validation (s)": 2}
    for column in (
        "Training loop (s)",
        "Training data loading (s)",
        "Forward (s)",
        "Backward (s)",
        "Optimization (s)",
        "Validation loop (s)",
        "Validation data loading (s)",
        "Evaluation (s)",
        "Metrics computation (s)",
    ):
        expected[column] = 8
    for column, count in counts.items():
        assert count == expected.get(column, 0), column
    assert len(frame) == 8

    phases = read_tsv(logs / "phases.tsv")
    per_phase = phases.groupby("phase").size().to_dict()
    assert per_phase == {
        "Training loop": 8,
        "Training data loading": 8,
        "Forward": 8,
        "Backward": 8,
        "Optimization": 8,
        "Validation loop": 8,
        "Validation data loading": 8,
        "Evaluation": 8,
        "Metrics computation": 8,
        "Epoch": 2,
        "Validation": 2,
    }
    # The first stored training iteration is the first after warmup, in every phase.
    first = (
        phases[phases["phase"].isin(["Forward", "Backward", "Optimization", "Training loop"])]
        .groupby("phase")["iteration"]
        .min()
    )
    assert set(first) == {3}
    assert set(phases[phases["phase"] == "Forward"]["batch"]) == set(range(3, 10)) | {15}

    summary = (sidecar.split_dir() / "summary.log").read_text()
    assert re.search(r"^   Forward +\| \S+ ± \S+ \[8\]", summary, re.M)
    assert re.search(r"^   Forward +\| \S+ ± \S+ \[17\]", summary, re.M)  # streaming
    assert re.search(r"^  Evaluation +\| \S+ ± \S+ \[10\]", summary, re.M)


def _assert_close(measured: list[float], truth: list[float], what: str) -> None:
    """Each row holds the script's own clock around the same work (the marker's clock
    reads outside it: never below it, less the clocks' granularity) and little more: a
    descheduling between the two clocks on a busy 2-core machine (seen: 0.25 ms) is
    allowed, a row filled from another phase (0.5 ms apart or more) is not."""
    assert len(measured) == len(truth), what
    for got, real in zip(measured, truth, strict=True):
        assert real - 5e-5 <= got <= real + max(0.05 * real, 0.0004), f"{what}: {got} vs {real}"


def test_injected_sleeps_are_recovered_in_the_right_columns(sidecar: Sidecar) -> None:
    # Each phase sleeps a different time; training and validation data loading differ,
    # so a column filled from the wrong phase (the reference copies Validation loop into
    # Validation data loading) is caught.
    sleeps = {
        "train loading": 0.006,
        "forward": 0.002,
        "backward": 0.004,
        "optimization": 0.001,
        "val loading": 0.003,
        "evaluation": 0.005,
        "metrics": 0.0015,
    }
    with markers.start_run(out_dir="maps", warmup_iterations=0, num_measurements=50) as run:
        truth = train(run, epochs=1, train_batches=6, val_batches=4, sleeps=sleeps)
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    pairs = {
        "Training data loading (s)": "train loading",
        "Forward (s)": "forward",
        "Backward (s)": "backward",
        "Optimization (s)": "optimization",
        "Validation data loading (s)": "val loading",
        "Evaluation (s)": "evaluation",
        "Metrics computation (s)": "metrics",
    }
    for column, phase in pairs.items():
        _assert_close(list(frame[column].dropna()), truth.seconds[phase], column)
    # A loop iteration holds its data loading and its phases (plus the markers' own cost).
    loop = list(frame["Training loop (s)"].dropna())
    parts = [
        sum(t)
        for t in zip(
            *(truth.seconds[p] for p in ("train loading", "forward", "backward", "optimization")),
            strict=True,
        )
    ]
    # The slack covers the loop's own unmarked code and a descheduling on a busy 2-core
    # machine (seen: 3.6 ms); a loop that took in another phase's time (validation here
    # takes ~38 ms a pass) is still far outside.
    for got, inner in zip(loop, parts, strict=True):
        assert inner <= got <= inner + max(0.05 * inner, 0.010)
    epoch = frame["Epoch (s)"].dropna().iloc[0]
    assert epoch >= sum(loop)


def test_accumulation_sums_batches_into_one_step(sidecar: Sidecar) -> None:
    sleeps = {"forward": 0.002}
    with markers.start_run(
        out_dir="maps",
        warmup_iterations=0,
        accumulation_steps=4,
        train_batch_size=2,
        val_batch_size=2,
    ) as run:
        truth = train(run, epochs=1, train_batches=10, val_batches=2, sleeps=sleeps, sizes=(2, 2))
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    # 10 batches at 4 per step: steps of 4, 4 and the epoch's last 2.
    assert frame["Training loop (s)"].notna().sum() == 3
    assert frame["Optimization (s)"].notna().sum() == 3
    forward = truth.seconds["forward"]
    per_step = [sum(forward[0:4]), sum(forward[4:8]), sum(forward[8:10])]
    _assert_close(list(frame["Forward (s)"].dropna()), per_step, "Forward per step")
    # Throughput counts the samples each step really held: 10 batches of 2, not 3 × 4 × 2.
    summary = (sidecar.split_dir() / "summary.log").read_text()
    loop_s = frame["Training loop (s)"].dropna().sum()
    assert f"Throughput: {2 * 10 / loop_s:.2f} images/s" in summary


def test_throughput_is_batch_size_over_mean_training_loop(sidecar: Sidecar) -> None:
    with markers.start_run(
        out_dir="maps",
        warmup_iterations=2,
        num_measurements=5,
        train_batch_size=32,
        val_batch_size=16,
    ) as run:
        train(
            run,
            epochs=1,
            train_batches=12,
            val_batches=6,
            sleeps={"forward": 0.001},
            sizes=(32, 16),  # the batches hold what start_run was told
        )
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    lines = [
        line
        for line in (sidecar.split_dir() / "summary.log").read_text().splitlines()
        if line.startswith("Throughput:")
    ]
    train_mean = statistics.fmean(frame["Training loop (s)"].dropna())
    val_mean = statistics.fmean(frame["Validation loop (s)"].dropna())
    assert lines == [
        f"Throughput: {32 / train_mean:.2f} images/s",
        f"Throughput: {16 / val_mean:.2f} images/s",
    ]


def test_batch_size_is_read_from_the_batches_when_not_given(sidecar: Sidecar) -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        train(run, epochs=1, train_batches=3, val_batches=2)  # batches are lists of 4
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    summary = (sidecar.split_dir() / "summary.log").read_text()
    mean = statistics.fmean(frame["Training loop (s)"].dropna())
    assert f"Throughput: {4 / mean:.2f} images/s" in summary


def test_custom_phases_get_their_own_columns(sidecar: Sidecar) -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=1, num_measurements=3) as run:
        save = run.phase("checkpoint saving")
        for _ in range(3):
            train(
                run,
                epochs=1,
                train_batches=4,
                val_batches=1,
                custom="augmentation",
                sleeps={"augmentation": 0.001},
            )
            with save:
                time.sleep(0.002)
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    standard = len(STANDARD_COLUMNS)
    assert list(frame.columns[:standard]) == STANDARD_COLUMNS
    # Custom columns follow the standard ones in the order the phases were first named.
    assert list(frame.columns[standard:]) == ["checkpoint saving (s)", "augmentation (s)"]
    # Inside iterations a custom phase follows the iteration's warmup and cap; outside,
    # its own occurrences: 3 saves, 1 of warmup -> 2 stored.
    assert frame["augmentation (s)"].notna().sum() == 3
    assert frame["checkpoint saving (s)"].notna().sum() == 2
    assert (frame["checkpoint saving (s)"].dropna() >= 0.002).all()
    summary = (sidecar.split_dir() / "summary.log").read_text()
    assert re.search(r"^checkpoint saving +\| \S+ ± \S+ \[2\]", summary, re.M)


def test_phase_works_as_a_decorator(sidecar: Sidecar) -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:

        @run.phase("forward")
        def forward() -> None:
            time.sleep(0.001)

        for _batch in run.train_batches([[1], [2]]):
            forward()
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Forward (s)"].notna().sum() == 2
    assert (frame["Forward (s)"].dropna() >= 0.001).all()


def test_two_splits_in_one_process_are_independent(sidecar: Sidecar) -> None:
    for split, batches in ((0, 4), (1, 6)):
        with markers.start_run(out_dir="maps", split=split, warmup_iterations=0) as run:
            train(run, epochs=1, train_batches=batches, val_batches=1)
    for split, batches in ((0, 4), (1, 6)):
        frame = read_tsv(sidecar.split_dir(split=split) / "logs" / "computational.tsv")
        assert frame["Training loop (s)"].notna().sum() == batches
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert set(document["splits"]) == {"0", "1"}
    assert document["status"] == "completed"


def test_rerun_replaces_our_files_and_keeps_text_of_others(sidecar: Sidecar) -> None:
    summary_path = sidecar.split_dir() / "summary.log"
    summary_path.parent.mkdir(parents=True)
    summary_path.write_text("Model accuracy: 0.93 (written by the user's framework)\n")
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        train(run, epochs=1, train_batches=6, val_batches=1)
    with summary_path.open("a") as handle:
        handle.write("Trailer written after our block\n")
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        train(run, epochs=1, train_batches=3, val_batches=1)
    text = summary_path.read_text()
    assert text.count(TITLE_LINE) == 1
    assert text.startswith("Model accuracy: 0.93")
    assert text.rstrip().endswith("Trailer written after our block")
    assert "[6]" not in text  # the first run's block is gone
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Training loop (s)"].notna().sum() == 3
    leftovers = [p.name for p in sidecar.split_dir().rglob(".*.tmp")]
    assert leftovers == []


def test_exception_in_the_loop_writes_files_marked_failed(sidecar: Sidecar) -> None:
    with pytest.raises(RuntimeError), markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        train(run, epochs=1, train_batches=3, val_batches=1)
        raise RuntimeError("loss is NaN")
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert document["status"] == "failed"
    assert "loss is NaN" in document["cause"]
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Training loop (s)"].notna().sum() == 3


def test_summary_block_is_laid_out_like_the_reference(sidecar: Sidecar) -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=4) as run:
        train(run, epochs=2, train_batches=3, val_batches=2)
    lines = (sidecar.split_dir() / "summary.log").read_text().splitlines()
    assert lines[0] == TITLE_LINE and len(lines[0]) == 106
    header = next(line for line in lines if line.lstrip().startswith("Phase"))
    assert header == (
        "        Phase          |         Time (s)          |       GPU Time (s)"
        "        |    GPU Max Memory (MB)   "
    )  # padded to 106, as the reference writes it
    rows = [line.split("|")[0].rstrip() for line in lines if "|" in line][1:]  # under Phase
    expected = [
        "Training",
        " Epoch",
        "  Iteration",
        "   Data loading",
        "   Forward",
        "   Backward",
        "   Optimization",
        "Validation",
        " Iteration",
        "  Data loading",
        "  Evaluation",
        "  Metrics computation",
    ]
    assert rows[: len(expected)] == expected
    training = next(line for line in lines if line.startswith("Training "))
    assert re.fullmatch(r"Training {15}\| \d\.\d\de[+-]\d\d \[1\] +\| +\| +", training)
    assert all(len(line) <= 106 for line in lines)
    # CPU-only run: no GPU name line, no GPU throughput; the resources block says why.
    assert not any(line.startswith(("GPU:", "GPU throughput")) for line in lines)
    assert any(line.startswith("GPU sampling: off (") for line in lines)
    assert "Host: job processes" in "\n".join(lines)


def test_without_endpoint_a_private_sidecar_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SIDECAR_ENDPOINT", raising=False)
    monkeypatch.chdir(tmp_path)
    with markers.start_run(out_dir="private", warmup_iterations=0) as run:
        assert run.monitored
        assert run.out_dir == (tmp_path / "private").resolve()
        train(run, epochs=1, train_batches=2, val_batches=1)
    logs = tmp_path / "private" / "training" / "split-0" / "logs"
    assert read_tsv(logs / "computational.tsv")["Training loop (s)"].notna().sum() == 2


@pytest.mark.parametrize(
    ("command", "status"),
    [
        (["-c", "import sys; sys.exit(3)"], 3),
        (["-c", "pass"], 0),
    ],
)
def test_sidecar_run_passes_the_exit_status_through(
    tmp_path: Path, command: list[str], status: int
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--quiet", "--", sys.executable, *command],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == status, result.stderr


def test_sidecar_run_of_a_missing_command_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "run",
            "--quiet",
            "--",
            str(tmp_path / "no-such-program"),
        ],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 127
    assert "cannot start" in result.stderr


def test_sidecar_run_of_a_file_without_execute_permission_exits_126(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("#!/usr/bin/env python3\nprint('never runs')\n")
    script.chmod(0o644)
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--quiet", "--", f"./{script.name}"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 126, result.stderr  # the shell's "found, not executable"
    assert "cannot start" in result.stderr
    assert "Permission denied" in result.stderr


def test_ranks_write_their_own_files_and_the_summary_compares_them(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = []
    for rank in (0, 1):  # two ranks of one job sharing the node's sidecar
        monkeypatch.setenv("RANK", str(rank))
        runs.append(markers.start_run(out_dir="maps", warmup_iterations=0))
    for rank, run in enumerate(runs):
        with run:
            train(run, epochs=1, train_batches=3 + rank, val_batches=1)
    logs = sidecar.split_dir() / "logs"
    assert read_tsv(logs / "computational.tsv")["Training loop (s)"].notna().sum() == 3
    assert read_tsv(logs / "computational-rank1.tsv")["Training loop (s)"].notna().sum() == 4
    assert set(read_tsv(logs / "phases-rank1.tsv")["rank"]) == {1}
    summary = (sidecar.split_dir() / "summary.log").read_text()
    assert "Ranks (stored rows, mean s):" in summary
    assert re.search(r"^ +0 \| +3 \|", summary, re.M)
    assert re.search(r"^ +1 \| +4 \|", summary, re.M)
    assert json.loads((sidecar.root / "maps" / "run.json").read_text())["splits"]["0"]["ranks"] == [
        0,
        1,
    ]


def _busy(ns: int) -> int:
    """Spin for about ``ns`` nanoseconds; returns how long it really took (the loop's own
    clock)."""
    start = time.perf_counter_ns()
    while time.perf_counter_ns() - start < ns:
        pass
    return time.perf_counter_ns() - start


def test_a_fast_loop_is_counted_and_timed_whole(sidecar: Sidecar) -> None:
    """30 000 short iterations at full speed, with a validation inside a training
    iteration now and then: the sidecar takes them in reads of many messages (the array
    path); every measured iteration is counted and the streaming mean over all of them
    matches the loop's own clock."""
    iterations, warmup, cap = 30_000, 5, 50
    forward_ns: list[int] = []
    evaluation_ns: list[int] = []
    with markers.start_run(
        out_dir="maps",
        warmup_iterations=warmup,
        num_measurements=cap,
        train_batch_size=2,
        val_batch_size=2,
    ) as run:
        for i, _batch in enumerate(run.train_batches(range(iterations))):
            with run.phase("forward"):
                forward_ns.append(_busy(10_000 * (1 + i % 3)))
            if i % 5000 == 4999:
                with run.validation():
                    for _ in run.val_batches(range(20)):
                        with run.phase("evaluation"):
                            evaluation_ns.append(_busy(5_000))
    summary = (sidecar.split_dir() / "summary.log").read_text()
    streaming = summary.split("All post-warmup measurements")[1]

    def mean_and_count(label: str) -> tuple[float, int]:
        match = re.search(rf"^ +{label} +\| (\S+) ± \S+ \[(\d+)\]", streaming, re.M)
        assert match, label
        return float(match[1]), int(match[2])

    # Warmup counts every batch through the network: validation batches too.
    measured = forward_ns[warmup:]
    mean_s, count = mean_and_count("Forward")
    assert count == len(measured)
    truth_s = statistics.fmean(measured) / 1e9
    assert abs(mean_s - truth_s) <= max(0.05 * truth_s, 3e-6), (mean_s, truth_s)
    mean_s, count = mean_and_count("Evaluation")
    assert count == len(evaluation_ns)
    assert abs(mean_s - statistics.fmean(evaluation_ns) / 1e9) <= 3e-6
    mean_s, count = mean_and_count("Iteration")
    assert count == len(measured)
    assert f"received {iterations * 3 + len(evaluation_ns) * 3 + 6 * 2}," in summary
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Forward (s)"].notna().sum() == cap
