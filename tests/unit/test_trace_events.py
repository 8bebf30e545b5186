"""``sidecar.report.trace`` on a small written split: flagged rows marked, ranks placed on
the wall clock by their own run starts, counter series cut to the cap."""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.report import split_rows, trace

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
    flagged = [e for e in slices if e["cat"] == "flagged"]
    assert [(e["name"], e["args"]["flag"]) for e in flagged] == [
        ("Forward (incomplete)", "incomplete")
    ]
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
