"""``sidecar.report.trace`` on a small written split: flagged rows marked, ranks placed on
the wall clock by their own run starts, counter series cut to the cap."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from sidecar.report import split_rows, trace
from tests.support.trace_checks import assert_drawable

HEADER = (
    "phase\tepoch\titeration\tbatch\trank\tsession\tstart (s)\twall (s)\tGPU (s)\t"
    "GPU peak (MB)\tbatch size\tbatches\tflag"
)


def _split(folder: Path, samples: int) -> None:
    logs = folder / "training" / "split-0" / "logs"
    logs.mkdir(parents=True)
    (folder / "run.json").write_text(
        json.dumps(
            {
                "splits": {
                    "0": {
                        "start_unix": 1000.0,
                        "hosts": {"a": [0], "b": [1]},
                        "nodes": [
                            {
                                "node_id": "a-1",
                                "node_host": "a",
                                "ranks": [0],
                                "start_unix": 1000.0,
                            },
                            {
                                "node_id": "b-1",
                                "node_host": "b",
                                "ranks": [1],
                                "start_unix": 1002.5,
                            },
                        ],
                    }
                }
            }
        )
    )
    (logs / "phases.tsv").write_text(
        f"{HEADER}\nTraining loop\t0\t0\t0\t0\t0\t1.0\t0.5\t\t\t8\t1\t\n"
        "Forward\t0\t0\t0\t0\t0\t1.1\t0.2\t\t\t\t1\t\n"
        "Forward\t0\t1\t1\t0\t0\t1.6\t0.1\t\t\t\t1\tincomplete\n"
    )
    (logs / "phases-rank1.tsv").write_text(
        f"{HEADER}\nTraining loop\t0\t0\t0\t1\t0\t1.0\t0.5\t\t\t8\t1\t\n"
    )
    lines = ["time (s)\tsession\tgpu index\tutilization (%)\thost cpu (%)"]
    lines += [f"{t * 0.1:.1f}\t0\t0\t{t % 100}\t{t % 7}" for t in range(samples)]
    (logs / "resources.tsv").write_text("\n".join(lines) + "\n")


def test_flagged_rows_ranks_on_one_clock_and_capped_counters(tmp_path: Path) -> None:
    _split(tmp_path, samples=1000)
    rows = split_rows.read_split(*split_rows.locate(tmp_path, None))
    document = trace.build(rows, max_points=100)
    slices = [e for e in document["traceEvents"] if e["ph"] == "X"]
    details = [e for e in document["traceEvents"] if e["ph"] == "i"]
    assert all("args" not in e and isinstance(e["ts"], int) for e in slices)
    flagged = [e for e in details if e["cat"] == "flagged"]
    assert [(e["name"], e["args"]["flag"]) for e in flagged] == [("Forward", "incomplete")]
    assert [e["name"] for e in slices if e["cat"] == "flagged"] == ["Forward"]
    loops = {e["pid"]: e for e in slices if e["name"] == "Training loop"}
    # rank 1's node started 2.5 s later: the same "start (s)" lies 2.5 s later on the axis
    assert loops[1]["ts"] - loops[0]["ts"] == 2.5e6
    assert loops[0]["ts"] == 1.0e6 and loops[0]["dur"] == 0.5e6
    names = {
        e["pid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names[0] == "rank 0 on a" and names[1] == "rank 1 on b"
    utilization = [e for e in document["traceEvents"] if e["name"] == "GPU 0 utilization (%)"]
    assert len(utilization) == 100
    # neighbours averaged: the first point is the mean of the first ten samples (0..9)
    assert utilization[0]["args"]["value"] == 4.5 and utilization[0]["ts"] == 0.0


def _rows(folder: Path, lines: list[str]) -> dict:
    """The trace of a one-rank split whose phases.tsv holds ``lines``."""
    _split(folder, samples=1)
    logs = folder / "training" / "split-0" / "logs"
    (logs / "phases.tsv").write_text(HEADER + "\n" + "\n".join(lines) + "\n")
    (logs / "phases-rank1.tsv").unlink()
    return trace.build(split_rows.read_split(*split_rows.locate(folder, None)))


def _row(phase: str, iteration: int, start_s: float, wall_s: float) -> str:
    return f"{phase}\t0\t{iteration}\t{iteration}\t0\t0\t{start_s!r}\t{wall_s!r}\t\t\t8\t1\t"


def test_abutting_slices_never_pass_their_successor_and_nest(tmp_path: Path) -> None:
    # start + wall in floating point ends a hair after the next start (0.1 + 0.2 > 0.3)
    lines = []
    start_s = 0.1
    for iteration in range(50):
        wall_s = 0.2 + iteration * 1e-7
        lines.append(_row("Training loop", iteration, start_s, wall_s))
        lines.append(_row("Forward", iteration, start_s, wall_s / 2))
        lines.append(_row("Backward", iteration, start_s + wall_s / 2, wall_s / 2))
        start_s = start_s + wall_s
    slices = [e for e in _rows(tmp_path, lines)["traceEvents"] if e["ph"] == "X"]
    assert assert_drawable(slices) == 150
    loops = [e for e in slices if e["name"] == "Training loop"]
    for before, after in itertools.pairwise(loops):
        # an equal-named successor: 1 µs apart, or speedscope opens it inside this one
        assert before["ts"] + before["dur"] == after["ts"] - 1, (before, after)
    for loop in loops:
        inner = [
            e
            for e in slices
            if e["name"] != "Training loop" and loop["ts"] <= e["ts"] < loop["ts"] + loop["dur"]
        ]
        assert [e["name"] for e in inner] == ["Forward", "Backward"], loop
        forward, backward = inner
        assert forward["ts"] == loop["ts"]
        assert forward["ts"] + forward["dur"] <= backward["ts"]
        assert backward["ts"] + backward["dur"] <= loop["ts"] + loop["dur"]
        assert abs(loop["dur"] - 0.2e6) <= 10
