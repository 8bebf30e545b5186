"""summary.log against the reference's own formula: the reference's block is rebuilt here
from the run's ``computational.tsv`` exactly as the reference computes and lays it out
(pandas mean and ``Series.std()`` per column, ``%.2e`` cells, 106 characters wide, labels
left-aligned in 22 characters indented 0-3 spaces; docs/contract.md, Files) and compared line by
line with the summary.log of a real run through ``sidecar run``. Our additions and the
resources block must follow the reference's closing star line, in blocks of their own.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from tests.support.helpers import env, read_tsv, split_dir, under_sidecar_run

# The marked loop, run by ``sidecar run``. Known sleeps per phase; ``--fake-gpu`` times the
# phases on the fake CUDA backend in the job (no GPU here), with varying GPU times.
LOOP = textwrap.dedent("""
    import argparse
    import time

    import markers

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--train", type=int)
    parser.add_argument("--val", type=int)
    parser.add_argument("--fake-gpu", action="store_true")
    args = parser.parse_args()
    if args.fake_gpu:
        import torch  # noqa: F401  - the markers look for CUDA only once torch is imported

        import markers.gpu
        from tests.support.fake_cuda import FakeBackend

        class VaryingBackend(FakeBackend):
            def record(self, event):
                super().record(event)
                self.clock_ms += 0.25 * (1 + self.recorded % 5)  # this phase's GPU time
                self.mem[0] = self.mem[1] = (200 + 10 * (self.recorded % 7)) * 1024 * 1024
                self.done = self.recorded

        markers.gpu.open_gpu_timer = lambda **_: markers.gpu.GpuTimer(VaryingBackend(), 64)

    SLEEPS_S = {"forward": 0.002, "backward": 0.003, "optimization": 0.001,
                "augmentation": 0.001, "evaluation": 0.002, "metrics": 0.001}


    def loader(batches, seconds):
        for _ in range(batches):
            time.sleep(seconds)
            yield [0] * 4


    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=4,
                           val_batch_size=4) as run:
        for _ in range(args.epochs):
            with run.epoch():
                for _batch in run.train_batches(loader(args.train, 0.001)):
                    for phase in ("forward", "backward", "optimization", "augmentation"):
                        with run.phase(phase):
                            time.sleep(SLEEPS_S[phase])
                if args.val:
                    with run.validation():
                        for _batch in run.val_batches(loader(args.val, 0.0015)):
                            for phase in ("evaluation", "metrics"):
                                with run.phase(phase):
                                    time.sleep(SLEEPS_S[phase])
""")

BATCH_SIZE = 4
# The reference's rows: label, indent, the computational.tsv column of the phase, and
# whether the phase has GPU columns.
TRAIN_ROWS = [
    ("Training", 0, "Training", False),
    ("Epoch", 1, "Epoch", False),
    ("Iteration", 2, "Training loop", False),
    ("Data loading", 3, "Training data loading", False),
    ("Forward", 3, "Forward", True),
    ("Backward", 3, "Backward", True),
    ("Optimization", 3, "Optimization", True),
]
VAL_ROWS = [
    ("Validation", 0, "Validation", False),
    ("Iteration", 1, "Validation loop", False),
    ("Data loading", 2, "Validation data loading", False),
    ("Evaluation", 2, "Evaluation", True),
    ("Metrics computation", 2, "Metrics computation", True),
]


def reference_cell(column: pd.Series) -> str:
    """The reference's cell: pandas mean and sample std of the column's values."""
    n = int(column.count())
    if n == 0:
        return ""
    if n == 1:
        return f"{column.mean():.2e} [1]"
    return f"{column.mean():.2e} ± {column.std():.2e} [{n}]"


def reference_line(label: str, cells: list[str]) -> str:
    """A row of the reference's table: 22-character label, three 25-character cells, not
    stripped (106 characters, as the reference writes it)."""
    return " | ".join([f"{label:<22}", *(f"{c:<25}" for c in cells)])


def reference_throughput(
    frame: pd.DataFrame, loop: str, gpu_phases: list[str], on_gpu: bool
) -> list[str]:
    """Images per second over the stored loop rows (every batch here is full), and over
    the summed GPU time of ``gpu_phases`` on a GPU."""
    rows = frame[f"{loop} (s)"].dropna()
    if rows.empty:  # the reference would print 'nan images/s'; the contract: no measurement
        return ["Throughput: no measurement"]
    lines = [f"Throughput: {BATCH_SIZE * len(rows) / rows.sum():.2f} images/s"]
    if on_gpu:
        gpu_s = sum(frame[f"{phase} GPU (s)"].mean() for phase in gpu_phases)
        lines.append(f"GPU throughput: {BATCH_SIZE / gpu_s:.2f} images/s")
    return lines


def reference_block(frame: pd.DataFrame, gpu_names: list[str]) -> list[str]:
    """The reference's Computational Summary block for ``frame`` (computational.tsv)."""
    title = " Computational Summary (mean ± std [n measurements]) "
    stars_left = (106 - len(title) + 1) // 2
    lines = ["*" * stars_left + title + "*" * (106 - len(title) - stars_left), ""]
    if gpu_names:
        lines += ["GPU: " + " then ".join(f"'{name}'" for name in gpu_names), ""]
    lines += [
        reference_line(
            f"{'Phase':^22}",
            [f"{'Time (s)':^25}", f"{'GPU Time (s)':^25}", f"{'GPU Max Memory (MB)':^25}"],
        ),
        "-" * 106,
    ]
    for rows, loop, gpu_phases, closing in (
        (TRAIN_ROWS, "Training loop", ["Forward", "Backward", "Optimization"], "-" * 106),
        (VAL_ROWS, "Validation loop", ["Evaluation"], "*" * 106),
    ):
        for label, indent, phase, has_gpu in rows:
            cells = [reference_cell(frame[f"{phase} (s)"])]
            cells += (
                [
                    reference_cell(frame[f"{phase} GPU (s)"]),
                    reference_cell(frame[f"{phase} GPU max memory (MB)"]),
                ]
                if has_gpu and gpu_names
                else ["", ""]
            )
            lines.append(reference_line(" " * indent + label, cells))
        lines += ["", *reference_throughput(frame, loop, gpu_phases, bool(gpu_names)), closing]
    return lines


def run_loop(tmp_path: Path, *args: str) -> tuple[pd.DataFrame, list[str]]:
    """Run the loop through ``sidecar run``; its computational.tsv and summary.log lines."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    result = subprocess.run(
        under_sidecar_run(script, *args),
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    split = split_dir(tmp_path / "maps")
    frame = read_tsv(split / "logs" / "computational.tsv")
    return frame, (split / "summary.log").read_text().splitlines()


def assert_reference_block_then_ours(
    frame: pd.DataFrame, lines: list[str], gpu_names: list[str]
) -> None:
    """summary.log starts with the reference's block line for line, then our additions,
    the Goodput block and the resources block follow, each closed by a star line."""
    expected = reference_block(frame, gpu_names)
    for number, (got, want) in enumerate(zip(lines, expected, strict=False)):
        assert got == want, f"line {number}:\n{got!r}\n{want!r}"
    assert len(lines) > len(expected)
    rest = lines[len(expected) :]
    assert rest[0] == ""
    assert rest[1].startswith("*") and " Beyond the reference: " in rest[1]
    assert len(rest[1]) == 106
    assert rest[2].startswith("Training time: effective ")
    goodput = next(
        i for i, line in enumerate(rest) if " Goodput: where the wall time went " in line
    )
    assert rest[goodput - 2 : goodput] == ["*" * 106, ""] and len(rest[goodput]) == 106
    resources = rest.index("Resources")
    assert goodput < resources and rest[resources - 2 : resources] == ["*" * 106, ""]
    assert rest[-1] == "*" * 106 and rest.count("*" * 106) == 3
    assert "Resources" not in lines[: len(expected)]


def streaming_cell(lines: list[str], label: str) -> str:
    """The Time cell of ``label`` in our streaming table."""
    start = next(i for i, line in enumerate(lines) if line.startswith("All post-warmup"))
    row = next(line for line in lines[start:] if line.startswith(f"{label} "))
    return row.split("|")[1].strip()


def test_block_is_the_references_line_for_line(tmp_path: Path) -> None:
    frame, lines = run_loop(tmp_path, "--epochs", "3", "--train", "4", "--val", "3")
    assert frame["Forward (s)"].count() == 12 and frame["Validation loop (s)"].count() == 9
    assert (frame["Forward (s)"].dropna() >= 0.002).all()
    assert frame["augmentation (s)"].count() == 12  # a custom column, not in the block
    assert_reference_block_then_ours(frame, lines, [])
    # The streaming figures (nothing capped here, so the same values) use n - 1 too.
    assert streaming_cell(lines, "   Forward") == reference_cell(frame["Forward (s)"])
    assert streaming_cell(lines, " Epoch") == reference_cell(frame["Epoch (s)"])
    assert any(line.startswith("augmentation ") for line in lines)


def test_block_with_one_measurement_per_phase(tmp_path: Path) -> None:
    frame, lines = run_loop(tmp_path, "--epochs", "1", "--train", "1", "--val", "1")
    assert frame.count().max() == 1
    assert_reference_block_then_ours(frame, lines, [])
    table = lines[4:11] + lines[14:19]
    assert all(line.split("|")[1].strip().endswith(" [1]") for line in table), table
    assert "±" not in "\n".join(lines[1:20])  # the title says "mean ± std"; no cell does
    assert streaming_cell(lines, "   Forward").endswith(" [1]")


def test_block_with_empty_columns(tmp_path: Path) -> None:
    frame, lines = run_loop(tmp_path, "--epochs", "2", "--train", "3", "--val", "0")
    assert frame["Validation (s)"].count() == 0 and frame["Evaluation (s)"].count() == 0
    assert_reference_block_then_ours(frame, lines, [])
    empty = f"{'Validation':<22} | {'':<25} | {'':<25} | {'':<25}"
    assert empty in lines and len(empty) == 106  # padded as the reference pads it


def test_block_on_a_gpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    frame, lines = run_loop(tmp_path, "--epochs", "2", "--train", "3", "--val", "2", "--fake-gpu")
    assert frame["Forward GPU (s)"].count() == 6
    assert frame["Forward GPU (s)"].nunique() > 1  # a std that is not zero
    assert_reference_block_then_ours(frame, lines, ["Fake GPU"])
    assert lines[2] == "GPU: 'Fake GPU'"
    assert sum(line.startswith("GPU throughput: ") for line in lines) == 2
