"""``sidecar trace`` on real runs (docs/views.md): the file is Trace Event JSON holding
every stored row of phases.tsv with its duration, nested as the phases are, with counter
tracks; speedscope (headless Chromium, offline) opens it and names the tracks; a split
served by two sidecars gives one track per rank, every rank on one wall clock; a run
past its stored rows is in it start to end through the whole-run sample.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from sidecar.model import whole_run
from tests.support import speedscope
from tests.support.helpers import SAME_PRIORITY, env, sidecar_command, split_dir
from tests.support.tools import require
from tests.support.trace_checks import assert_drawable

JOBS = Path(__file__).resolve().parents[1] / "support" / "jobs"
HOST = socket.gethostname()
NODE_DELAY_S = 3.0  # the second node starts this much later than the first


def _trace(cwd: Path, folder: str) -> dict[str, Any]:
    done = subprocess.run(
        sidecar_command("trace", folder, "--out", "trace.json"),
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads((cwd / "trace.json").read_text())
    for event in document["traceEvents"]:
        assert event["ph"] in ("X", "i", "C", "M") and isinstance(event["pid"], int), event
        if event["ph"] != "M":
            assert isinstance(event["ts"], float | int) and math.isfinite(event["ts"]), event
    return document


def _slices(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in document["traceEvents"] if e["ph"] == "X"]


def _process_names(document: dict[str, Any]) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def _inside(child: dict[str, Any], parents: list[dict[str, Any]]) -> bool:
    return any(
        p["ts"] <= child["ts"] and child["ts"] + child["dur"] <= p["ts"] + p["dur"] + 1e-3
        for p in parents
        if p["pid"] == child["pid"]
    )


def _traced_job(cwd: Path, job: str, *args: str) -> dict[str, Any]:
    """``sidecar run`` over ``job`` (tests/support/jobs) with ``args``, which name the run
    folder after ``--out-dir``; that folder's trace."""
    command = [*sidecar_command("run", "--quiet", *SAME_PRIORITY), "--", sys.executable]
    done = subprocess.run(
        [*command, str(JOBS / job), *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return _trace(cwd, args[args.index("--out-dir") + 1])


def test_every_stored_row_is_a_slice_and_speedscope_names_the_track(short_tmp: Path) -> None:
    document = _traced_job(
        short_tmp, "paced_job.py", "--out-dir", "run", "--iters", "20", "--validate"
    )
    slices = _slices(document)
    assert_drawable(document["traceEvents"])
    # each slice's row is in the args of the instant event that follows it
    details = [e for e in document["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], e["ts"]) for e in details] == [(e["name"], e["ts"]) for e in slices]
    rows = pd.read_csv(split_dir(short_tmp / "run") / "logs" / "phases.tsv", sep="\t")
    rows = rows.rename(columns={"start (s)": "start_s", "wall (s)": "wall_s"})
    assert len(slices) == len(rows)
    by_key = {
        (e["name"], d["args"]["epoch"], d["args"]["iteration"], d["args"]["batch"]): e
        for e, d in zip(slices, details, strict=True)
    }
    start_us = min(e["ts"] for e in slices) - rows["start_s"].min() * 1e6
    for row in rows.itertuples(index=False):
        event = by_key[(row.phase, row.epoch, row.iteration, row.batch)]
        # whole microseconds: within 1 µs of the row, 2 where a phase follows itself
        assert event["dur"] == pytest.approx(row.wall_s * 1e6, abs=2), (row, event)
        assert event["ts"] == pytest.approx(start_us + row.start_s * 1e6, abs=1), (row, event)
    # nested as the phases are
    loops = [e for e in slices if e["name"] == "Training loop"]
    epochs = [e for e in slices if e["name"] == "Epoch"]
    passes = [e for e in slices if e["name"] == "Validation"]
    for name, parents in (
        ("Forward", loops),
        ("Optimization", loops),
        ("Training loop", epochs),
        ("Validation loop", passes),
        ("Validation", epochs),
    ):
        children = [e for e in slices if e["name"] == name]
        assert children and all(_inside(c, parents) for c in children), name
    counters = {e["name"] for e in document["traceEvents"] if e["ph"] == "C"}
    assert {"job CPU (%)", "job memory RSS (MiB)"} <= counters, counters
    assert _process_names(document)[0] == f"rank 0 on {HOST}"
    require(speedscope.unavailable())
    names = speedscope.track_names(short_tmp / "trace.json", short_tmp)
    assert [n.startswith(f"rank 0 on {HOST} (pid 0)") for n in names] == [True], names
    # Left Heavy and Sandwich group frames by name: each phase is one row of the table
    symbols = [
        line.strip() for line in speedscope.sandwich_lines(short_tmp / "trace.json", short_tmp)
    ]
    phases = set(rows["phase"])
    assert sorted(s for s in symbols if s in phases) == sorted(phases), symbols
    assert not [s for s in symbols if s.startswith(tuple(phases)) and s not in phases], symbols


def _node(cwd: Path, ranks: str) -> subprocess.Popen[str]:
    """One node of a 4-rank job: ``sidecar run`` over ranks_job.py for ``ranks``."""
    return subprocess.Popen(
        [
            *sidecar_command("run", "--quiet", *SAME_PRIORITY),
            "--",
            sys.executable,
            str(JOBS / "ranks_job.py"),
            "--spawn",
            ranks,
            "--world",
            "4",
            "--truth",
            str(cwd),
            "--iters",
            "30",
            "--forward-s",
            "0.01",
        ],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_nodes_give_one_track_per_rank_on_one_clock(short_tmp: Path) -> None:
    launched = [time.time()]
    first = _node(short_tmp, "0,1")
    time.sleep(NODE_DELAY_S)
    launched.append(time.time())
    second = _node(short_tmp, "2,3")
    outputs = [node.communicate(timeout=240)[0] for node in (first, second)]
    ended = time.time()
    assert [first.returncode, second.returncode] == [0, 0], outputs
    document = _trace(short_tmp, "maps")
    names = _process_names(document)
    tracks = {pid: name for pid, name in names.items() if not name.startswith("resources on")}
    assert tracks == {r: f"rank {r} on {HOST}" for r in range(4)}, names
    assert len(names) > len(tracks), names  # the resources of the nodes
    start_unix = document["otherData"]["start_unix"]
    slices = _slices(document)
    assert assert_drawable(document["traceEvents"]) == len(slices) > 0
    first_epoch = {
        rank: min(e["ts"] for e in slices if e["pid"] == rank and e["name"] == "Epoch") / 1e6
        for rank in range(4)
    }
    # on one wall clock: every slice inside the test's own span of the job, and the later
    # node's ranks later by the delay the test made (their own clocks would start at ~0)
    for event in slices:
        begin = start_unix + event["ts"] / 1e6
        assert launched[0] <= begin and begin + event["dur"] / 1e6 <= ended, event
    later_s = min(first_epoch[2], first_epoch[3]) - max(first_epoch[0], first_epoch[1])
    print(f"ranks 2-3 began {later_s:.2f} s after ranks 0-1 (launched {NODE_DELAY_S} s later)")
    # not sooner than launched; later by the second node's start-up on a loaded machine
    assert launched[1] - launched[0] - 0.5 < later_s < launched[1] - launched[0] + 15, first_epoch
    require(speedscope.unavailable())
    names = speedscope.track_names(short_tmp / "trace.json", short_tmp)
    assert [n.split(" (pid")[0] for n in names] == [f"rank {r} on {HOST}" for r in range(4)]


def _loop_iterations(document: dict[str, Any], pid: int = 0) -> list[int]:
    """The iteration of each Training loop slice of rank ``pid``, from its details."""
    return sorted(
        e["args"]["iteration"]
        for e in document["traceEvents"]
        if e["ph"] == "i" and e["name"] == "Training loop" and e["pid"] == pid
    )


def test_a_long_run_with_tiny_phases_nests_on_whole_microseconds(short_tmp: Path) -> None:
    # 20 000 abutting sub-millisecond steps: where floating start + duration used to pass
    # the next slice's start; past the 2000 stored, the whole-run sample's
    steps, stored = 20_000, 2000
    document = _traced_job(
        short_tmp,
        "loop_job.py",
        *("--out-dir", "long", "--epochs", "4", "--iters", str(steps // 4), "--sleep", "0"),
        *("--cap", str(stored), "--warmup", "2"),
    )
    slices = _slices(document)
    assert assert_drawable(document["traceEvents"]) == len(slices) > 4000, len(slices)
    iterations = _loop_iterations(document)
    assert iterations[:stored] == list(range(2, 2 + stored))  # the stored ones, all
    sampled = iterations[stored:]
    # the sample's bound, kept at least half full: every k-th step (k a power of two)
    assert whole_run.ITERATIONS // 2 <= len(sampled) <= whole_run.ITERATIONS, len(sampled)
    strides = {b - a for a, b in pairwise(sampled)}
    assert len(strides) == 1 and strides.pop() in (32, 64), sampled[:5]
    for tenth in (0, 5, 9):  # the first, middle and last tenth of the run
        low, high = tenth * steps // 10, (tenth + 1) * steps // 10
        assert sum(low <= it < high for it in iterations) >= 20, (tenth, iterations[-5:])


def test_two_ranks_past_the_cap_nest_with_their_samples(short_tmp: Path) -> None:
    """A 2-rank run longer than its stored rows: each rank's track holds its stored and
    sampled iterations, and no slice ends after its successor starts on any track."""
    iters = 1500
    document = _traced_job(
        short_tmp,
        "ranks_job.py",
        *("--out-dir", "two", "--spawn", "0,1", "--world", "2", "--truth", str(short_tmp)),
        *("--iters", str(iters), "--cap", "100", "--forward-s", "0", "--warmup", "0"),
    )
    slices = _slices(document)
    assert assert_drawable(document["traceEvents"]) == len(slices)
    for rank in (0, 1):
        iterations = _loop_iterations(document, rank)
        assert iterations[:100] == list(range(100)), rank
        assert iterations[-1] >= iters - 64 and len(iterations) > 100 + 300, (rank, iterations)
