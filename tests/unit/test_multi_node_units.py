"""The pieces of one split served by several sidecars (docs/multi-node.md): rank figures
through a node file and back, which ranks a final node file covers, the run.json entry
merged over nodes, and the report's waiting GPU-hours."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from sidecar.model.aggregator import Settings
from sidecar.model.merge import RankFigures, merged
from sidecar.model.split import Split
from sidecar.report.read import RunFolder, SplitFiles
from sidecar.report.stragglers import straggler_frame
from sidecar.sinks import nodes, writer


def _figures(rank: int, loading_s: float, iterations: int = 10) -> RankFigures:
    keys = [[0, i] for i in range(iterations)]
    return RankFigures(
        rank,
        f"host{rank // 2}",
        f"node{rank // 2}",
        "completed",
        None,
        iterations,
        iterations,
        8 * iterations,
        {"Forward": 0.01},
        {"Forward": [iterations, 0.01, 0.0]},
        keys,
        [[loading_s, 0.01, 0.02, 0.001] for _ in keys],
        [loading_s + 0.031] * iterations,
    )


def test_rank_figures_survive_a_node_file_and_name_the_straggler() -> None:
    read = [
        RankFigures.from_json(json.loads(json.dumps(f.to_json())))
        for f in (_figures(2, 0.001), _figures(3, 0.05))
    ]
    view = merged([_figures(0, 0.001), _figures(1, 0.001)], read, world_size=5)
    assert [f.rank for f in view.ranks] == [0, 1, 2, 3]
    assert view.missing == [4]
    assert view.stragglers is not None
    verdict = view.stragglers.verdict
    assert (verdict.rank, verdict.host, verdict.phase) == (3, "host1", "data loading")
    assert verdict.over_median_s == pytest.approx(0.049)


def _node(node_id: str, final: bool, written_unix: float, ranks: list[int]) -> nodes.NodeFile:
    return nodes.NodeFile(
        node_id, "h", final, "completed", None, written_unix, [_figures(r, 0.0) for r in ranks], []
    )


def test_only_final_node_files_of_this_session_cover_their_ranks() -> None:
    found = [_node("old", True, 100.0, [2, 3]), _node("new", False, 200.0, [2, 3])]
    assert nodes.uncovered(range(4), {0, 1}, found, since_unix=150.0) == [2, 3]
    found.append(_node("newer", True, 210.0, [2]))
    assert nodes.uncovered(range(4), {0, 1}, found, since_unix=150.0) == [3]


def test_run_json_keeps_every_node_and_the_worst_status_wins(tmp_path: Path) -> None:
    split = Split(tmp_path, 0, Settings(), {"world_size": 4})
    for rank in (0, 1):
        split.rank(rank).begin_session(1000.0, 0, "r")
    split.status = "completed"
    other = {
        "node_id": "elsewhere",
        "node_host": "b",
        "ranks": [2, 3],
        "status": "incomplete",
        "cause": "its sidecar stopped",
        "start_unix": 999.0,
        "end_unix": 1010.0,
        "hosts": {"b": [2, 3]},
        "gpus": [{"uuid": "GPU-b", "name": "B"}],
    }
    replaced = {"node_id": "restarted", "node_host": "a", "ranks": [1], "status": "running"}
    text = writer.run_json(split, json.dumps({"splits": {"0": {"nodes": [other, replaced]}}}))
    entry = json.loads(text)["splits"]["0"]
    assert entry["ranks"] == [0, 1, 2, 3]
    assert (entry["status"], entry["cause"]) == ("incomplete", "its sidecar stopped")
    assert [n["node_id"] for n in entry["nodes"]] == [nodes.NODE_ID, "elsewhere"]
    assert entry["hosts"]["b"] == [2, 3] and entry["start_unix"] == 999.0
    assert entry["gpus"] == [{"uuid": "GPU-b", "name": "B"}]


def test_the_report_counts_the_gpu_hours_spent_waiting(tmp_path: Path) -> None:
    ranks = (
        "rank\thost\titerations\tmeasured\twaited (s)\n"
        "0\ta\t10\t100\t36\n1\ta\t10\t100\t0\n2\tb\t10\t100\t36\n3\tb\t10\t100\t0\n"
    )
    summary = "Straggler: rank 3 on b, data loading, +1.0e-02 s over the median before the sync\n"
    run = RunFolder(tmp_path, {}, [SplitFiles(0, 1.0, b"", 1, b"", (), summary, ranks)])
    frame = straggler_frame([run], pd.Series([8]))
    row = frame.iloc[0]
    assert (row["straggler rank"], row["straggler host"], row["straggler phase"]) == (
        "3",
        "b",
        "data loading",
    )
    # 2 ranks × 36 s × 10 (measured / stored) × 2 GPUs per rank / 3600
    assert row["waiting GPU-hours"] == pytest.approx(0.4)
