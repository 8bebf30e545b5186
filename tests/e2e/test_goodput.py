"""The goodput account on real jobs made to have each kind of badput: the parts add up to
the wall time, and each part matches the job's own clock (``goodput_job.py``) within 5 %
(or a few hundredths of a second for a small part, on a loaded machine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from sidecar.model.goodput import CAUSES
from tests.support.helpers import env, read_tsv, run_json, split_dir, wait_for

JOB = Path(__file__).parents[1] / "support" / "jobs" / "goodput_job.py"
SHARE, ABSOLUTE_S = 0.05, 0.03


def _close(measured: float, expected: float, what: str) -> None:
    assert abs(measured - expected) <= max(SHARE * expected, ABSOLUTE_S), (
        f"{what}: the account says {measured:.4f} s, the job's clock {expected:.4f} s"
    )


def start_job(endpoint: str, cwd: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``goodput_job.py`` with ``args``, talking to the sidecar at ``endpoint``."""
    return subprocess.Popen(
        [sys.executable, str(JOB), *args],
        cwd=cwd,
        env=env(SIDECAR_ENDPOINT=endpoint),
        stdin=subprocess.DEVNULL,
    )


def _clock(prefix: Path, rank: int = 0, suffix: str = "") -> dict[str, Any]:
    return json.loads(Path(f"{prefix}.{rank}.json{suffix}").read_text())


def _account(out: Path, rank: int = 0) -> dict[str, Any]:
    return run_json(out)["splits"]["0"]["goodput"]["ranks"][str(rank)]


def _adds_up(account: dict[str, Any]) -> None:
    parts = account["productive_s"] + sum(account["badput_s"][c] for c in CAUSES)
    assert abs(parts - account["wall_s"]) < 1e-6, account
    assert account["badput_s"]["other"] >= -1e-6, account


def test_each_part_matches_the_jobs_clock(short_tmp: Path) -> None:
    """A private sidecar (its start told apart), a slow loader, validation passes inside
    the training loop, big checkpoint saves, warmup and the script's own start-up."""
    clock = short_tmp / "clock"
    environment = {k: v for k, v in env().items() if k != "SIDECAR_ENDPOINT"}
    subprocess.run(
        [
            sys.executable,
            str(JOB),
            "--clock",
            str(clock),
            "--out-dir",
            "maps",
            "--epochs",
            "2",
            "--iters",
            "25",
            "--warmup",
            "4",
            "--data-s",
            "0.03",
            "--step-s",
            "0.02",
            "--val-every",
            "7",
            "--val-iters",
            "4",
            "--val-s",
            "0.03",
            "--checkpoint-s",
            "0.6",
            "--startup-s",
            "0.8",
        ],
        cwd=short_tmp,
        env=environment,
        check=True,
        timeout=300,
    )
    out = short_tmp / "maps"
    account, mine = _account(out), _clock(clock)
    _adds_up(account)
    badput = account["badput_s"]
    _close(
        badput["startup"] + badput["sidecar_start"],
        mine["first_iteration_unix"] - mine["process_start_unix"],
        "start-up",
    )
    assert badput["sidecar_start"] > 0.05, badput  # a python -m sidecar start: not nothing
    assert badput["startup"] >= 0.8 - ABSOLUTE_S, badput  # the script's own sleep
    for cause in ("data_stall", "validation", "checkpoint", "warmup"):
        _close(badput[cause], mine[cause], cause)
    _close(account["productive_s"], mine["productive"], "productive")
    assert account["iterations"] == mine["iterations"] == 2 * 25 - 4
    assert badput["redone"] == badput["downtime"] == badput["straggler"] == 0.0
    _close(account["wall_s"], mine["end_unix"] - mine["process_start_unix"], "wall")
    summary = (split_dir(out) / "summary.log").read_text()
    block = summary[summary.index(" Goodput: where the wall time went ") :]
    assert f"Wall time {account['wall_s']:.2f} s from the process start" in block
    assert f"| {account['productive_s']:>12.2f} |" in block
    assert (
        summary.index("Computational Summary")
        < summary.index(" Goodput: ")
        < summary.index("\nResources\n")
    )
    whole = run_json(out)["goodput"]
    assert abs(whole["wall_s"] - account["wall_s"]) < 1e-6


def test_kill_and_resume_redone_work_and_downtime(serve, short_tmp: Path) -> None:
    """SIGKILL some iterations after a checkpoint, a pause, a resume: the work since the
    checkpoint is redone, the pause is downtime, the second process's start is start-up;
    the parts before the checkpoint are those of the first process's clock then."""
    sidecar = serve()
    out = short_tmp / "root" / "resumed"
    common = [
        "--out-dir",
        str(out),
        "--iters",
        "50",
        "--warmup",
        "3",
        "--data-s",
        "0.01",
        "--step-s",
        "0.02",
        "--checkpoint-s",
        "0.3",
        "--gpu",
        "GPU-aa:NVIDIA Fake",
    ]
    first = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--clock",
        str(short_tmp / "one"),
        "--epochs",
        "3",
        "--checkpoint-at",
        "0",
        "--die-after",
        "40",
    )
    first.wait(120)
    wait_for(lambda: run_json(out).get("status") == "incomplete", 30, "the death noticed")
    second = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--clock",
        str(short_tmp / "two"),
        "--epochs",
        "1",
        "--resume",
        "--startup-s",
        "0.5",
    )
    assert second.wait(120) == 0
    wait_for(lambda: run_json(out).get("status") == "completed", 30, "the resumed run")
    account = _account(out)
    _adds_up(account)
    one, death, two = (
        _clock(short_tmp / "one"),
        _clock(short_tmp / "one", suffix=".death"),
        _clock(short_tmp / "two"),
    )
    badput = account["badput_s"]
    _close(badput["redone"], death["death_unix"] - one["checkpoint_unix"], "redone")
    _close(badput["downtime"], two["process_start_unix"] - death["death_unix"], "downtime")
    _close(
        badput["startup"] + badput["sidecar_start"],
        one["first_iteration_unix"]
        - one["process_start_unix"]
        + two["first_iteration_unix"]
        - two["process_start_unix"],
        "start-up",
    )
    for cause in ("data_stall", "checkpoint", "warmup"):
        _close(badput[cause], one[cause] + two[cause], cause)
    _close(account["productive_s"], one["productive"] + two["productive"], "productive")
    _close(account["wall_s"], two["end_unix"] - one["process_start_unix"], "wall")
    _report_shows(short_tmp, run_json(out)["goodput"])
    _one_wall_everywhere(short_tmp, out, account)


def _one_wall_everywhere(root: Path, out: Path, account: dict[str, Any]) -> None:
    """One wall time and one downtime in every block of summary.log, in run.json, jobs.tsv
    and ``sidecar report --job``: the goodput account's (one rank, one split)."""
    wall, badput = account["wall_s"], account["badput_s"]
    summary = (split_dir(out) / "summary.log").read_text()
    match = re.search(
        r"; wall (\S+) s\n +including downtime (\S+) s and redone work (\S+) s .*\n"
        r" +and the processes' time before start_run (\S+) s",
        summary,
    )
    assert match, summary
    assert float(match[1]) == pytest.approx(wall, abs=0.006)
    assert float(match[2]) == pytest.approx(badput["downtime"], abs=0.006)
    assert float(match[3]) == pytest.approx(badput["redone"], abs=0.006)
    assert f"Wall time {wall:.2f} s from the process start" in summary
    assert re.search(rf"^downtime between sessions +\| +{badput['downtime']:.2f} \|", summary, re.M)
    document = run_json(out)
    entry = document["splits"]["0"]
    for where in (document, entry):
        assert where["end_unix"] - where["start_unix"] == pytest.approx(wall, abs=1e-3)
    assert entry["wall_s"] == pytest.approx(wall, abs=1e-6)
    jobs = read_tsv(root / "report" / "jobs.tsv")
    assert jobs["wall (s)"][0] == pytest.approx(wall, abs=1e-3)
    parts = jobs[[f"badput {cause} (s)" for cause in CAUSES]].sum(axis=1)[0]
    assert parts + document["goodput"]["productive_s"] == pytest.approx(wall, abs=2e-3)
    shown = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "--job", str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    header = re.search(r"^Wall (\S+) ", shown.stdout, re.M)
    went = re.search(r"^Goodput: where (\S+) went", shown.stdout, re.M)
    assert header and went and header[1] == went[1], shown.stdout


def _report_shows(root: Path, whole: dict[str, Any]) -> None:
    """``sidecar report`` of the folder: jobs.tsv has the run's goodput, summary.tsv the
    GPU-hours lost per cause (one GPU)."""
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "root", "--out", str(root / "report")],
        cwd=root,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    jobs = read_tsv(root / "report" / "jobs.tsv")
    assert len(jobs) == 1 and jobs["GPUs"][0] == 1
    assert jobs["goodput (%)"][0] == pytest.approx(
        whole["productive_s"] / whole["wall_s"] * 100, abs=0.01
    )
    summary = read_tsv(root / "report" / "summary.tsv").set_index(["by", "name"])
    for cause in CAUSES:
        assert jobs[f"badput {cause} (s)"][0] == pytest.approx(whole["badput_s"][cause], abs=1e-3)
        assert summary.loc[
            ("GPU model", "NVIDIA Fake"), f"GPU-hours lost {cause}"
        ] == pytest.approx(whole["badput_s"][cause] / 3600, abs=1e-6)
    page = (root / "report" / "report.html").read_text()
    tables = _tables(page[page.index('id="goodput"') :])
    [user] = tables[0][1:]  # the header, then one user
    lost_h = sum(whole["badput_s"].values()) / 3600
    assert user[0] == jobs["user"][0] and user[2] == f"{lost_h:.2f}"
    [job] = tables[1][1:]
    largest = max(CAUSES, key=lambda cause: whole["badput_s"][cause])
    assert job[0].endswith("resumed") and job[4] == f"{lost_h:.2f}" and job[5] == largest


def _tables(page: str) -> list[list[list[str]]]:
    """The cells of the first two HTML tables of ``page``, row by row."""

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tables: list[list[list[str]]] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "table":
                self.tables.append([])
            elif tag == "tr":
                self.tables[-1].append([])
            elif tag in ("td", "th"):
                self.tables[-1][-1].append("")

        def handle_data(self, data: str) -> None:
            if self.tables and self.tables[-1] and self.tables[-1][-1]:
                self.tables[-1][-1][-1] += data

    parser = Cells()
    parser.feed(page)
    return parser.tables[:2]


def test_waiting_for_a_slow_rank(serve, short_tmp: Path) -> None:
    """Two ranks under one sidecar meet at a barrier in Backward; rank 1 is slower in
    Forward: rank 0's wait is its straggler part, taken off its productive time."""
    sidecar = serve()
    out = short_tmp / "root" / "ranks"
    clock = short_tmp / "clock"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        "--out-dir",
        str(out),
        "--clock",
        str(clock),
        "--ranks",
        "2",
        "--slow-s",
        "0.04",
        "--epochs",
        "1",
        "--iters",
        "40",
        "--warmup",
        "2",
        "--step-s",
        "0.02",
    )
    assert job.wait(120) == 0
    wait_for(lambda: run_json(out).get("status") == "completed", 30, "both ranks done")
    fast, slow = _account(out, 0), _account(out, 1)
    for account in (fast, slow):
        _adds_up(account)
    mine = _clock(clock, 0)
    _close(fast["badput_s"]["straggler"], mine["straggler"], "rank 0's wait")
    _close(fast["productive_s"], mine["productive"], "rank 0's productive")
    assert slow["badput_s"]["straggler"] < ABSOLUTE_S, slow
    block = (split_dir(out) / "summary.log").read_text()
    assert "(mean over 2 ranks)" in block and "rank 0: productive" in block
    assert os.path.exists(out / "run.json")


LOADER_JOB = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import markers

data = TensorDataset(torch.zeros(16, 3))
run = markers.start_run(out_dir="maps", warmup_iterations=0)
with run:
    for _ in run.train_batches(DataLoader(data, batch_size=4, num_workers=2,
                                          pin_memory=False)):
        pass
    for _ in run.val_batches(DataLoader(data, batch_size=8)):
        pass
"""


def test_dataloader_settings_reach_run_json(serve, short_tmp: Path) -> None:
    """The loop drivers read num_workers and pin_memory from a real DataLoader."""
    sidecar = serve()
    (short_tmp / "root" / "job.py").write_text(LOADER_JOB)
    subprocess.run(
        [sys.executable, "job.py"],
        cwd=short_tmp / "root",
        check=True,
        env=env(SIDECAR_ENDPOINT=sidecar.endpoint),
        timeout=300,
    )
    out = short_tmp / "root" / "maps"
    wait_for(lambda: run_json(out).get("status") == "completed", 30, "the run")
    assert run_json(out)["splits"]["0"]["loaders"] == {
        "train": {"num_workers": 2, "pin_memory": False},
        "validation": {"num_workers": 0, "pin_memory": False},
    }


def test_mfu_estimate_from_the_given_flops(serve, short_tmp: Path) -> None:
    """start_run(flops_per_batch=...) on a run whose GPU is named 'NVIDIA H200': the MFU
    line and run.json's estimate, from the stored steps of computational.tsv."""
    sidecar = serve()
    out = short_tmp / "root" / "mfu"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        "--out-dir",
        str(out),
        "--clock",
        str(short_tmp / "clock"),
        "--epochs",
        "1",
        "--iters",
        "20",
        "--gpu",
        "GPU-h:NVIDIA H200",
        "--flops",
        "4e12",
    )
    assert job.wait(120) == 0
    wait_for(lambda: run_json(out).get("status") == "completed", 30, "the run")
    mfu = run_json(out)["splits"]["0"]["mfu"]
    table = read_tsv(split_dir(out) / "logs" / "computational.tsv")
    rate = len(table["Training loop (s)"].dropna()) / table["Training loop (s)"].sum()
    assert mfu["estimate"] is True and mfu["peak_tflops"] == 989.4
    assert mfu["batches_per_s"] == pytest.approx(rate, rel=1e-3)
    assert mfu["mfu"] == pytest.approx(4e12 * rate / 1e12 / 989.4, rel=1e-3)
    summary = (split_dir(out) / "summary.log").read_text()
    assert f"MFU (estimate): {mfu['mfu'] * 100:.1f} % = 4.000e+12 FLOPs per batch" in summary
    assert "('NVIDIA H200', bf16 dense peak)" in summary
    report = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "--job", str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert f"MFU (estimate, split 0): {mfu['mfu'] * 100:.1f} % — 4.00e+12 FLOPs/batch" in " ".join(
        report.stdout.split()
    )


def test_kfold_splits_in_one_process_each_start_at_their_own_start_run(
    serve, short_tmp: Path
) -> None:
    """Three splits one after the other in one process: split 0's account starts at the
    process's start, split k's at its own ``start_run`` (not at the process's start, which
    would count splits 0 … k − 1 as its start-up); the folder's wall is within the
    process's life."""
    sidecar = serve()
    out = short_tmp / "root" / "kfold"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        *("--clock", str(short_tmp / "clock"), "--out-dir", str(out), "--splits", "3"),
        *("--epochs", "1", "--iters", "15", "--warmup", "2", "--step-s", "0.02"),
        *("--startup-s", "0.4", "--between-s", "0.3"),
    )
    assert job.wait(120) == 0
    wait_for(
        lambda: (
            [run_json(out)["splits"].get(str(k), {}).get("status") for k in range(3)]
            == ["completed"] * 3
        ),
        30,
        "the three splits written",
    )
    splits = run_json(out)["splits"]
    for k in range(3):
        account = splits[str(k)]["goodput"]["ranks"]["0"]
        mine = json.loads(
            Path(f"{short_tmp / 'clock'}{f'.split{k}' if k else ''}.0.json").read_text()
        )
        _adds_up(account)
        badput = account["badput_s"]
        _close(
            badput["startup"] + badput["sidecar_start"],
            mine["first_iteration_unix"] - mine["process_start_unix"],
            f"split {k} start-up",
        )
        _close(account["wall_s"], mine["end_unix"] - mine["process_start_unix"], f"split {k} wall")
    first = json.loads((short_tmp / "clock.0.json").read_text())
    last = json.loads((short_tmp / "clock.split2.0.json").read_text())
    assert run_json(out)["goodput"]["wall_s"] < last["end_unix"] - first["process_start_unix"]
