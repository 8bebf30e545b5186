"""``sidecar report --job``: one real job run under ``sidecar run`` (GPUs from the NVML
stand-in, a real torch DataLoader made slow), found by its Slurm job id or its folder;
every figure checked against the files and ``jobs.tsv``, no line wider than 80 columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import env, read_tsv

JOB = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import markers

class Slow(Dataset):
    def __len__(self):
        return 48
    def __getitem__(self, index):
        time.sleep(0.004)  # a batch of 4 waits 16 ms: most of each step
        return torch.zeros(3)

run = markers.start_run(out_dir=sys.argv[1], warmup_iterations=2, train_batch_size=4)
with run:
    for epoch in range(2):
        with run.epoch():
            for batch in run.train_batches(DataLoader(Slow(), batch_size=4)):
                with run.phase("forward"):
                    time.sleep(0.004)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the run folder ``runs/job`` of Slurm job 4242."""
    root = tmp_path_factory.mktemp("job")
    (root / "job.py").write_text(JOB)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.launcher",
            "--fake-nvml",
            "two_busy_gpus",
            "--",
            "run",
            "--interval",
            "0.2",
            "--",
            sys.executable,
            "job.py",
            "runs/job",
        ],
        cwd=root,
        env=env(SLURM_JOB_ID="4242"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return root


def _report(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", *args],
        cwd=root,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_figures_match_the_files(job: Path) -> None:
    _report(job, "runs", "--out", "all")
    row = read_tsv(job / "all" / "jobs.tsv").iloc[0]
    figures = json.loads(_report(job, "--job", "4242", "runs", "--json").stdout)
    meta = json.loads((job / "runs" / "job" / "run.json").read_text())
    assert figures["folder"] == str(Path("runs") / "job") and figures["job_id"] == "4242"
    assert figures["user"] == meta["user"] and figures["hosts"] == [meta["host"]]
    assert figures["gpus"] == row["GPUs"] == 2
    for key, column in (
        ("gpu_utilization_pct", "GPU utilization mean (%)"),
        ("gpu_memory_peak_pct", "GPU memory peak (%)"),
        ("cpu_mean_pct", "CPU mean (%)"),
        ("wall_s", "wall (s)"),
        ("data_loading_share_pct", "data loading share (%)"),
    ):
        assert figures[key] == pytest.approx(row[column], rel=1e-6), key
    assert figures["goodput"] == meta["goodput"]
    assert figures["loaders"] == {"train": {"num_workers": 0, "pin_memory": False}}
    system = read_tsv(job / "runs" / "job" / "training" / "split-0" / "logs" / "resources.tsv")[
        "system memory used (%)"
    ].max()
    assert figures["system_memory_peak_pct"] == pytest.approx(system)


def test_terminal_lines_fit_and_give_advice(job: Path) -> None:
    figures = json.loads(_report(job, "--job", "runs/job", "--json").stdout)
    lines = _report(job, "--job", "runs/job", "--into-folder").stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert (job / "runs" / "job" / "efficiency.txt").read_text() == text + "\n"
    assert "User " + figures["user"] in text and "GPUs 2 × NVIDIA Fake 0, NVIDIA Fake 1" in text
    utilization = next(line for line in lines if line.startswith("GPU utilization"))
    assert f"{figures['gpu_utilization_pct']:.0f} % mean" in utilization
    goodput = figures["goodput"]
    share = goodput["productive_s"] / goodput["wall_s"] * 100
    productive = next(line for line in lines if line.startswith("  productive"))
    assert f"{share:4.1f} %" in productive
    share = figures["data_loading_share_pct"]
    assert share > 30
    flat = " ".join(text.split())  # advice lines wrap at 80 columns
    assert (
        f"- input-bound: {share:.0f} % of each step waits for data — raise DataLoader "
        "num_workers (now 0) or pin_memory"
    ) in flat


def test_an_unknown_job_is_said(job: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "--job", "999", "runs"],
        cwd=job,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "no run folder of job 999" in result.stderr


def test_the_slurm_epilog_writes_it_into_the_jobs_folder(job: Path) -> None:
    """epilog.sh with SIDECAR_JOB_REPORT_ROOTS: efficiency.txt in the run folder (no
    sidecar socket on this machine: the finish step is skipped)."""
    written = job / "runs" / "job" / "efficiency.txt"
    written.unlink(missing_ok=True)
    wrapper = job / "sidecar.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m sidecar "$@"\n')
    wrapper.chmod(0o755)
    epilog = Path(__file__).parents[2] / "systemd" / "slurm" / "epilog.sh"
    result = subprocess.run(
        ["sh", str(epilog)],
        cwd=job,
        capture_output=True,
        text=True,
        timeout=120,
        env=env(
            SIDECAR=str(wrapper), SLURM_JOB_ID="4242", SIDECAR_JOB_REPORT_ROOTS=str(job / "runs")
        ),
    )
    assert result.returncode == 0, result.stderr
    expected = _report(job, "--job", "4242", str(job / "runs")).stdout
    assert written.read_text() == expected
