"""``sidecar report`` over real run folders: real marked loops run under ``sidecar run``
(a fast one on two stand-in GPUs, an input-bound one, a failed one) at different depths,
plus damaged folders. Every figure of jobs.tsv is checked against the folder's own files,
and report.html is opened in a real headless Chromium.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from sidecar.report.jobs import JOB_COLUMNS
from tests.support.helpers import JOB, env, read_tsv, report_jobs
from tests.support.tools import require_tool

CHROMIUM = "chromium-headless-shell"
INPUT_BOUND = textwrap.dedent("""
    import sys, time
    import markers

    def loader():
        for _ in range(30):
            time.sleep(0.02)  # a slow input pipeline
            yield [0] * 8

    with markers.start_run(out_dir=sys.argv[1], warmup_iterations=2,
                           train_batch_size=8) as run:
        with run.epoch():
            for batch in run.train_batches(loader()):
                with run.phase("forward"):
                    time.sleep(0.004)
""")
TWO_SPLITS = textwrap.dedent("""
    import sys, time
    import markers

    for split, (sleep_s, batch) in enumerate([(0.004, 8), (0.012, 8)]):
        with markers.start_run(out_dir=sys.argv[1], split=split, warmup_iterations=1,
                               train_batch_size=batch) as run:
            with run.epoch():
                for _ in run.train_batches([[0] * batch] * (40 - 20 * split)):
                    with run.phase("forward"):
                        time.sleep(sleep_s)
""")
FAST = (
    "cluster/alice/fast",
    [str(JOB), "--iters", "40", "--sleep", "0.005"],
    ["--fake-nvml", "two_busy_gpus"],
)
SLOW_INPUT = ("cluster/bob/2026/week1/input", ["input_bound.py"], [])
FAILED = ("cluster/failed", [str(JOB), "--raise-at-epoch", "1", "--iters", "10"], [])
SPLITS = ("cluster/carol/two-splits", ["two_splits.py"], [])


def _sidecar_run(root: Path, out_dir: str, args: list[str], seams: list[str]) -> int:
    """``sidecar run`` of a job (through the test launcher: ``seams`` are its options)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.launcher",
            *seams,
            "--",
            "run",
            "--quiet",
            "--interval",
            "0.2",
            "--",
            sys.executable,
            *args,
            *([] if args[0].endswith("s.py") or args[0] == "input_bound.py" else ["--out-dir"]),
            out_dir,
        ],
        cwd=root,
        env=env(),
        capture_output=True,
        timeout=120,
    ).returncode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run folders of three real jobs and two damaged folders under ``<root>/cluster``."""
    root = tmp_path_factory.mktemp("report")
    (root / "input_bound.py").write_text(INPUT_BOUND)
    (root / "two_splits.py").write_text(TWO_SPLITS)
    assert _sidecar_run(root, *FAST) == 0
    assert _sidecar_run(root, *SLOW_INPUT) == 0
    assert _sidecar_run(root, *FAILED) != 0
    assert _sidecar_run(root, *SPLITS) == 0
    # a copy whose computational.tsv was cut in the middle of a line (half-written)
    cut = root / "cluster" / "alice" / "cut"
    shutil.copytree(root / FAST[0], cut)
    table = cut / "training" / "split-0" / "logs" / "computational.tsv"
    table.write_bytes(table.read_bytes()[:-7])
    # a run.json cut short
    (root / "cluster" / "x" / "y" / "z").mkdir(parents=True)
    (root / "cluster" / "x" / "y" / "z" / "run.json").write_text('{"status": "runn')
    return root


@pytest.fixture(scope="module")
def report(cluster: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = cluster / "out"
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "cluster", "--out", str(out)],
        cwd=cluster,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out, result


def _summary_number(text: str, pattern: str) -> float:
    match = re.search(pattern, text, re.M)
    assert match is not None, pattern
    return float(match[1])


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _check_row(row: pd.Series, folder: Path) -> None:
    """Every figure of the jobs.tsv ``row`` against ``folder``'s own files."""
    meta = json.loads((folder / "run.json").read_text())
    split = folder / "training" / "split-0"
    summary = (split / "summary.log").read_text()
    comp = read_tsv(split / "logs" / "computational.tsv")
    assert row["run_id"] == meta["run_id"] and len(meta["run_id"]) == 32
    assert (row["host"], row["user"], row["status"]) == (meta["host"], meta["user"], meta["status"])
    assert row["start"] == meta["start"] and row["end"] == meta["end"]
    assert _close(row["wall (s)"], meta["end_unix"] - meta["start_unix"])
    assert (row["cause"] if isinstance(row["cause"], str) else None) == meta["cause"]
    share = comp["Training data loading (s)"].mean() / comp["Training loop (s)"].mean() * 100
    assert _close(row["data loading share (%)"], share)
    train = _summary_number(summary, r"^Throughput: ([0-9.]+) images/s")
    assert _close(row["train throughput (samples/s)"], train)
    vals = re.findall(r"^Throughput: ([0-9.]+) images/s", summary, re.M)
    if len(vals) == 2:
        assert _close(row["val throughput (samples/s)"], float(vals[1]))
    else:
        assert math.isnan(row["val throughput (samples/s)"])
    # summary.log prints these rounded: 0.1 % and whole MB
    assert (
        abs(row["CPU mean (%)"] - _summary_number(summary, r"CPU \(%\) +mean ([0-9.]+)")) <= 0.051
    )
    assert abs(row["memory peak (MB)"] - _summary_number(summary, r"RSS peak ([0-9]+)")) <= 0.51
    assert row["records dropped"] == _summary_number(summary, r"dropped ([0-9]+) \(not sent")
    gpus = re.findall(r"^GPU \d+: '[^']*' (\S+)", summary, re.M)
    assert row["GPUs"] == len(gpus)
    assert _close(row["GPU-hours"], len(gpus) * row["wall (s)"] / 3600)
    if gpus:
        utils = [float(u) for u in re.findall(r"Utilization \(%\) +mean ([0-9.]+)", summary)]
        assert abs(row["GPU utilization mean (%)"] - sum(utils) / len(utils)) <= 0.051
        power = [float(p) for p in re.findall(r"Power \(W\) +mean ([0-9.]+)", summary)]
        assert abs(row["power mean (W)"] - sum(power)) <= 0.051 * len(power)
        used = re.findall(r"Memory used \(MB\) +peak ([0-9]+) of ([0-9]+)", summary)
        assert abs(row["GPU memory peak (MB)"] - max(float(u) for u, _ in used)) <= 0.51
        assert _close(
            row["GPU memory peak (%)"], max(float(u) / float(t) * 100 for u, t in used), rel=1e-3
        )
        energy = [float(e) for e in re.findall(r"Energy \(J\) +([0-9.e+-]+)", summary)]
        assert _close(row["energy (kWh)"], sum(energy) / 3.6e6, rel=1e-3)
    else:
        assert math.isnan(row["GPU utilization mean (%)"]) and row["GPU-hours"] == 0
    expected = [
        name
        for name, on in (
            ("idle-gpu", gpus and row["GPU utilization mean (%)"] < 10),
            ("input-bound", share > 30),
            ("memory-pressure", gpus and row["GPU memory peak (%)"] > 90),
            ("failed", meta["status"] == "failed"),
            ("incomplete", meta["status"] == "incomplete"),
        )
        if on
    ]
    assert (row["flags"] if isinstance(row["flags"], str) else "") == ",".join(expected)


def test_jobs_tsv_figures_come_from_the_folders_own_files(
    cluster: Path, report: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    out, result = report
    jobs = read_tsv(out / "jobs.tsv")
    assert list(jobs.columns) == JOB_COLUMNS
    assert sorted(jobs["folder"]) == sorted(p[0] for p in (FAST, SLOW_INPUT, FAILED, SPLITS))
    for _, row in jobs[jobs["folder"] != SPLITS[0]].iterrows():
        _check_row(row, cluster / row["folder"])
    by_folder = jobs.set_index("folder")
    assert by_folder.loc[SLOW_INPUT[0], "flags"] == "input-bound"
    assert by_folder.loc[FAILED[0], "flags"] == "failed"
    assert by_folder.loc[FAST[0], "GPUs"] == 2
    assert by_folder.loc[FAST[0], "GPU model"] == "NVIDIA Fake 0, NVIDIA Fake 1"
    # the damaged folders: named with the reason, skipped
    assert "skipped cluster/alice/cut: computational.tsv: last line cut short" in result.stderr
    assert "skipped cluster/x/y/z: run.json is not valid JSON" in result.stderr
    assert "cluster/alice/cut" in (out / "report.md").read_text()
    assert "[#" not in result.stderr  # no progress bar on a pipe


def test_a_run_of_two_splits_weighs_them_by_training_time(
    cluster: Path, report: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    out, _ = report
    row = read_tsv(out / "jobs.tsv").set_index("folder").loc[SPLITS[0]]
    folder = cluster / SPLITS[0]
    meta = json.loads((folder / "run.json").read_text())
    weights, throughputs, shares = [], [], []
    for split in ("0", "1"):
        logs = folder / "training" / f"split-{split}"
        weights.append(meta["splits"][split]["training_s"])
        throughputs.append(
            _summary_number((logs / "summary.log").read_text(), r"^Throughput: ([0-9.]+) images/s")
        )
        comp = read_tsv(logs / "logs" / "computational.tsv")
        shares.append(
            comp["Training data loading (s)"].mean() / comp["Training loop (s)"].mean() * 100
        )
    assert throughputs[0] > 1.2 * throughputs[1]  # the splits differ: the weights matter
    total = sum(weights)
    assert _close(
        row["train throughput (samples/s)"],
        sum(w * t for w, t in zip(weights, throughputs, strict=True)) / total,
    )
    assert _close(
        row["data loading share (%)"],
        sum(w * s for w, s in zip(weights, shares, strict=True)) / total,
    )
    # run.json: from the earliest split's start to the latest split's end
    starts = [meta["splits"][k]["start_unix"] for k in ("0", "1")]
    ends = [meta["splits"][k]["end_unix"] for k in ("0", "1")]
    assert meta["start_unix"] == min(starts) and meta["end_unix"] == max(ends)
    assert _close(row["wall (s)"], max(ends) - min(starts))
    assert row["run_id"] == meta["splits"]["0"]["run_id"] != meta["splits"]["1"]["run_id"]


def test_gpus_and_summary_tables(report: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = report
    jobs = read_tsv(out / "jobs.tsv")
    gpus = read_tsv(out / "gpus.tsv")
    assert sorted(gpus["uuid"]) == ["GPU-0a0a0a0a", "GPU-1b1b1b1b"]
    assert _close(gpus["power mean (W)"].sum(), jobs["power mean (W)"].sum())
    summary = read_tsv(out / "summary.tsv").set_index(["by", "name"])
    user = summary.loc[("user", "root" if os.getuid() == 0 else jobs["user"][0])]
    assert user["jobs"] == 4 and user["failed"] == 1 and user["input-bound"] == 1
    assert _close(user["GPU-hours"], jobs["GPU-hours"].sum())
    model = summary.loc[("GPU model", "NVIDIA Fake 0, NVIDIA Fake 1")]
    assert model["jobs"] == 1
    assert _close(
        model["GPU utilization mean (%)"], jobs["GPU utilization mean (%)"].dropna().iloc[0]
    )


def test_progress_bar_on_a_terminal_only(cluster: Path, tmp_path: Path) -> None:
    leader, follower = os.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "sidecar", "report", "cluster", "--out", str(tmp_path)],
            cwd=cluster,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=follower,
            timeout=120,
        )
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert result.returncode == 0
    assert b"reading run folders [" + b"#" * 40 + b"] 6/6" in shown


def test_report_html_draws_offline_in_chromium(
    report: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, _ = report
    page = (out / "report.html").read_text()
    assert not re.search(r"""<(script|link|img)[^>]*\s(src|href)=""", page)
    require_tool(CHROMIUM)
    offline = [
        "--no-sandbox",
        "--headless",
        "--disable-gpu",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--virtual-time-budget=10000",
    ]
    dom = subprocess.run(
        [CHROMIUM, *offline, "--dump-dom", (out / "report.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'data-drawn="yes"' in dom  # our script ran to its end
    # GPU-hours per user and per model and the phase breakdown as bars, utilization (the
    # one job with GPUs) as a uPlot line plot
    assert dom.count('<div class="figure"') == 4
    assert len(re.findall(r'<div class="uplot[^"]*"[^>]*>', dom)) == 1
    assert dom.count('class="hbar-seg"') >= 1 + 1 + 4
    assert "Phase breakdown per job" in dom and "GPU 1" in dom
    assert 'data-overlaps="0" data-empty="0" data-cut="0"' in dom
    assert dom.count("<tr>") >= 1 + 3 + 1 + 2  # jobs, gpus, ... rows drawn from the data
    assert not re.search(r"""\s(src|href)="https?:""", dom)
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            CHROMIUM,
            *offline,
            f"--screenshot={shot}",
            "--window-size=1200,900",
            (out / "report.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_no_run_folder_gives_empty_tables_and_a_missing_path_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    run = [sys.executable, "-m", "sidecar", "report"]
    result = subprocess.run(
        [*run, "empty", "--out", "out"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "jobs.tsv").read_text().split("\n") == ["\t".join(JOB_COLUMNS), ""]
    missing = subprocess.run(
        [*run, "nowhere"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2
    assert missing.stderr.strip() == "sidecar report: no such folder: nowhere"


def test_a_split_without_samples_is_reported_without_resource_figures(
    cluster: Path, tmp_path: Path
) -> None:
    shutil.copytree(cluster / SLOW_INPUT[0], tmp_path / "runs" / "quick")
    (tmp_path / "runs" / "quick" / "training" / "split-0" / "logs" / "resources.tsv").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "runs", "--out", "out"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "skipped" not in result.stderr, result.stderr
    row = read_tsv(tmp_path / "out" / "jobs.tsv").iloc[0]
    assert math.isnan(row["CPU mean (%)"]) and math.isnan(row["memory peak (MB)"])
    assert row["flags"] == "input-bound" and row["train throughput (samples/s)"] > 0


def test_folders_of_older_and_newer_versions_are_read_not_skipped(
    cluster: Path, tmp_path: Path
) -> None:
    """Files of another version: an older resources.tsv without the session column and an
    older computational.tsv with its index column first (``measurement #``), a newer
    resources.tsv with a column appended. Both read, with the figures of the original."""
    for name in ("now", "older", "newer"):
        shutil.copytree(cluster / FAST[0], tmp_path / "runs" / name)
    logs = Path("training") / "split-0" / "logs" / "resources.tsv"
    older = read_tsv(tmp_path / "runs" / "older" / logs).drop(columns=["session"])
    older.to_csv(tmp_path / "runs" / "older" / logs, sep="\t", index=False)
    table = tmp_path / "runs" / "older" / logs.with_name("computational.tsv")
    read_tsv(table).rename_axis("measurement #").to_csv(table, sep="\t")
    assert table.read_text().startswith("measurement #\tTraining (s)\t")
    newer = read_tsv(tmp_path / "runs" / "newer" / logs)
    newer["pcie rx (MB/s)"] = 12.5
    newer.to_csv(tmp_path / "runs" / "newer" / logs, sep="\t", index=False)
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "runs", "--out", "out"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "skipped" not in result.stderr, result.stderr
    jobs = read_tsv(tmp_path / "out" / "jobs.tsv").set_index("folder")
    assert sorted(jobs.index) == ["runs/newer", "runs/now", "runs/older"]
    for column in (
        "power mean (W)",
        "GPU utilization mean (%)",
        "CPU mean (%)",
        "memory peak (MB)",
        "data loading share (%)",
    ):
        now = jobs.loc["runs/now", column]
        assert not math.isnan(now), column
        assert _close(jobs.loc["runs/older", column], now), column
        assert _close(jobs.loc["runs/newer", column], now), column


STATED = ("throughput", "records_dropped", "straggler")  # run.json's per split, for the report


def test_the_report_reads_run_json_and_an_older_folder_its_summary(
    cluster: Path, tmp_path: Path
) -> None:
    """run.json states per split what the summary prints (throughput, records dropped);
    the report takes them there, and from summary.log in a folder laid out as before
    run.json held them. A folder whose summary.log was removed gives the same row."""
    for name in ("now", "before", "stated", "nosummary"):
        shutil.copytree(cluster / FAST[0], tmp_path / "runs" / name)
    meta = json.loads((cluster / FAST[0] / "run.json").read_text())
    entry = meta["splits"]["0"]
    summary = (cluster / FAST[0] / "training" / "split-0" / "summary.log").read_text()
    train = _summary_number(summary, r"^Throughput: ([0-9.]+) images/s")
    assert entry["throughput"]["train"] == train
    assert entry["records_dropped"] == _summary_number(summary, r"dropped ([0-9]+) \(not sent")
    assert entry["straggler"] is None  # one rank: nothing compared
    before = {**meta, "splits": {"0": {k: v for k, v in entry.items() if k not in STATED}}}
    (tmp_path / "runs" / "before" / "run.json").write_text(json.dumps(before))
    # the report's figure is run.json's (summary.log left as it was)
    stated = {**meta, "splits": {"0": {**entry, "throughput": {"train": 12345.5, "val": None}}}}
    stated["splits"]["0"]["records_dropped"] = 7
    (tmp_path / "runs" / "stated" / "run.json").write_text(json.dumps(stated))
    (tmp_path / "runs" / "nosummary" / "training" / "split-0" / "summary.log").unlink()
    jobs = report_jobs(tmp_path, "runs").set_index("folder")
    assert sorted(jobs.index) == ["runs/before", "runs/nosummary", "runs/now", "runs/stated"]
    same = jobs.loc["runs/nosummary"].drop("folder", errors="ignore")
    now = jobs.loc["runs/now"].drop("folder", errors="ignore")
    assert same.equals(now), (same[same != now], now[same != now])
    for column in ("train throughput (samples/s)", "records dropped"):
        assert jobs.loc["runs/before", column] == jobs.loc["runs/now", column], column
    assert jobs.loc["runs/now", "train throughput (samples/s)"] == train
    assert jobs.loc["runs/stated", "train throughput (samples/s)"] == 12345.5
    assert math.isnan(jobs.loc["runs/stated", "val throughput (samples/s)"])
    assert jobs.loc["runs/stated", "records dropped"] == 7
