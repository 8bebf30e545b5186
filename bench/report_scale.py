"""How long ``sidecar report`` takes over many run folders (docs/contract.md, Cluster
report: 10 000 in under a minute on one core).

Generates ``--folders`` run folders (default 10 000) under a temporary folder, nested two
levels deep, each with run.json, summary.log, computational.tsv (the cap's 100 rows, 22
columns) and resources.tsv (``--gpus`` GPUs × ``--rounds`` sampling rounds), with the
columns and layout the sidecar writes; a few templates of random figures are reused, so
generating stays quick. Then runs ``python -m sidecar report`` on them pinned to one core
(``taskset -c 0``), page cache warm (the files were just written), and records wall and
CPU time in the section "## Report scale" of bench/RESULTS.md: the best of ``--repeats``
runs (other work on a shared machine only adds to a run's wall time) and the load average
when they began.

Run from the repository root: ``python bench/report_scale.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import machine_line, write_section  # noqa: E402
from sidecar.resources.fields import columns  # noqa: E402
from sidecar.sinks.summary import STARS, TITLE_LINE  # noqa: E402
from sidecar.sinks.tables import COLUMNS, to_tsv  # noqa: E402

TEMPLATES = 8
ROWS = 100


def _computational(rng: np.random.Generator) -> str:
    frame = pd.DataFrame(
        rng.gamma(2.0, 0.01, (ROWS, len(COLUMNS))), columns=[label for label, _, _ in COLUMNS]
    )
    return to_tsv(frame, index=False)


def _resources(rng: np.random.Generator, gpus: int, rounds: int) -> str:
    t = np.repeat(np.arange(rounds, dtype=float), gpus) + 0.0123
    n = len(t)
    frame = pd.DataFrame(
        {
            "time (s)": t,
            "session": 0,
            "gpu index": np.tile(np.arange(gpus), rounds),
            "gpu name": "NVIDIA H100 80GB HBM3",
            "gpu uuid": [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(gpus)] * rounds,
            "utilization (%)": rng.integers(0, 101, n).astype(float),
            "memory utilization (%)": rng.integers(0, 101, n).astype(float),
            "memory used (MB)": rng.uniform(1000, 80000, n),
            "memory total (MB)": 81559.0,
            "power (W)": rng.uniform(80, 700, n),
            "power source": "instant",
            "energy (J)": np.cumsum(rng.uniform(80, 700, n)),
            "temperature (C)": 60.0,
            "sm clock (MHz)": 1980.0,
            "throttle reasons": 0,
            "sm activity (%)": np.nan,
            "job gpu memory (MB)": rng.uniform(1000, 80000, n),
            "job sm utilization (%)": np.nan,
            "host cpu (%)": rng.uniform(50, 400, n),
            "job memory rss (MB)": rng.uniform(1e3, 3e4, n),
            "job memory uss (MB)": rng.uniform(1e3, 3e4, n),
            "system memory used (%)": 40.0,
        }
    )
    return to_tsv(frame[list(columns())], index=False)


def _summary(rng: np.random.Generator) -> str:
    lines = [
        TITLE_LINE,
        "",
        "GPU: 'NVIDIA H100 80GB HBM3'",
        "",
        *(f"{'phase':<22} | 1.00e-01 ± 1.00e-02 [100]" for _ in range(12)),
        f"Throughput: {rng.uniform(100, 5000):.2f} images/s",
        "-" * 106,
        f"Throughput: {rng.uniform(100, 5000):.2f} images/s",
        STARS,
        "",
        "Resources",
        *("  resource line" for _ in range(20)),
        "Records: received 123456, dropped 0 (not sent), lost 0 (sent, never received), rejected 0",
        STARS,
    ]
    return "\n".join(lines) + "\n"


def generate(root: Path, folders: int, gpus: int, rounds: int) -> None:
    """``folders`` run folders under ``root/<user>/<job>``."""
    rng = np.random.default_rng(0)
    templates = [
        (
            _computational(rng).encode(),
            _resources(rng, gpus, rounds).encode(),
            _summary(rng).encode(),
        )
        for _ in range(TEMPLATES)
    ]
    start = 1.8e9
    for i in range(folders):
        computational, resources, summary = templates[i % TEMPLATES]
        folder = root / f"user{i % 37}" / f"job{i:05d}"
        logs = folder / "training" / "split-0" / "logs"
        logs.mkdir(parents=True)
        (logs / "computational.tsv").write_bytes(computational)
        (logs / "resources.tsv").write_bytes(resources)
        (folder / "training" / "split-0" / "summary.log").write_bytes(summary)
        meta = {
            "run_id": f"{i:032x}",
            "host": f"node{i % 64:03d}",
            "user": f"user{i % 37}",
            "job_id": str(100000 + i),
            "command": ["python", "train.py"],
            "start": "2027-01-15T08:00:00+00:00",
            "end": "2027-01-15T09:00:00+00:00",
            "start_unix": start,
            "end_unix": start + rounds,
            "status": "completed",
            "cause": None,
            "gpus": [],
            "splits": {"0": {"status": "completed", "training_s": float(rounds)}},
        }
        (folder / "run.json").write_text(json.dumps(meta))


def _timed(work: Path, folders: int) -> tuple[float, float]:
    """Wall and CPU seconds of one ``sidecar report`` over ``work/runs``, pinned to CPU 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    result = subprocess.run(
        [
            "taskset",
            "-c",
            "0",
            sys.executable,
            "-m",
            "sidecar",
            "report",
            str(work / "runs"),
            "--out",
            str(work / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    jobs = pd.read_csv(work / "out" / "jobs.tsv", sep="\t")
    assert len(jobs) == folders, len(jobs)
    return wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folders", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, leave RESULTS.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="report-scale-"))
    try:
        began = time.perf_counter()
        generate(work / "runs", args.folders, args.gpus, args.rounds)
        generated_s = time.perf_counter() - began
        size_mb = sum(p.stat().st_size for p in (work / "runs").rglob("*") if p.is_file()) / 1e6
        load = os.getloadavg()[0]
        runs = [_timed(work, args.folders) for _ in range(args.repeats)]
        wall_s, cpu_s = min(runs)
        html_mb = (work / "out" / "report.html").stat().st_size / 1e6
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(
        [
            "## Report scale",
            "",
            machine_line("python bench/report_scale.py"),
            "",
            f"`sidecar report` over {args.folders} generated run folders ({size_mb:.0f} MB: "
            f"computational.tsv of {ROWS} rows, resources.tsv of {args.gpus} GPUs × "
            f"{args.rounds} rounds, run.json, summary.log), one core (`taskset -c 0`), page "
            f"cache warm; best of {args.repeats} runs, load average {load:.1f} when they began:",
            "",
            "| folders | wall (s) | CPU (s) | report.html (MB) |",
            "|---|---|---|---|",
            f"| {args.folders} | {wall_s:.1f} | {cpu_s:.1f} | {html_mb:.1f} |",
            "",
            f"Generating the folders took {generated_s:.0f} s (not counted). Budget "
            "(docs/contract.md, Cluster report): under 60 s.",
            "",
        ]
    )
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
