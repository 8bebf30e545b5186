"""The report of a split served by several nodes (docs/multi-node.md): every node's
resources table counts, rank 0's ``resources.tsv`` and each ``resources-<node-id>.tsv``:
energy and CPU added up over the nodes, the memory peak the largest node's, a GPU seen by
two nodes once, and the job's hosts listed; from Prometheus, the runs of one job (one per
node's sidecar) in one row."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sidecar.report import figures, from_prometheus, jobs
from sidecar.report.read import RunFolder, SplitFiles
from sidecar.resources import fields
from sidecar.sinks.summary import TITLE_LINE

HEADER = fields.columns()
SUMMARY = f"{TITLE_LINE}\nThroughput: 10.00 images/s\nRecords: received 9, dropped 0\n"


def _table(uuids: list[str], energy_j: list[float], cpu_pct: float, rss_mib: float) -> bytes:
    """Three sampling rounds 1 s apart: one row per GPU, the GPU's energy counter at
    ``energy_j`` + 0, 100, 200 J (200 J over the table), the host columns each round."""
    lines = []
    for t in range(3):
        for index, (uuid, base) in enumerate(zip(uuids, energy_j, strict=True)):
            row = dict.fromkeys(HEADER, "")
            row |= {
                "time (s)": f"{t}.0",
                "session": "0",
                "gpu index": str(index),
                "gpu name": "NVIDIA Fake",
                "gpu uuid": uuid,
                "utilization (%)": "50",
                "memory used (MB)": str(1000 + 100 * t),
                "memory total (MB)": "8000",
                "power (W)": "100",
                "energy (J)": str(base + 100 * t),
                "host cpu (%)": str(cpu_pct),
                "job memory rss (MB)": str(rss_mib + t),
            }
            lines.append("\t".join(row[c] for c in HEADER))
    return ("\n".join(lines) + "\n").encode()


def _run(tmp_path: Path, rank0: bytes, others: list[bytes]) -> RunFolder:
    split = SplitFiles(
        0,
        10.0,
        b"",
        1,
        rank0,
        HEADER,
        SUMMARY,
        "",
        tuple((body, HEADER) for body in others),
    )
    meta = {
        "run_id": "r",
        "host": "b",  # the last writer's: the hosts below are the job's
        "start_unix": 0.0,
        "end_unix": 3600.0,
        "status": "completed",
        "gpus": [],
        "splits": {"0": {"hosts": {"b": [2, 3], "a": [0, 1]}}},
    }
    return RunFolder(tmp_path, meta, [split])


def _job(run: RunFolder) -> tuple[pd.Series, pd.DataFrame]:
    job_table, gpu_table = jobs.tables([run], figures.compute(run.splits))
    return job_table.iloc[0], gpu_table


def test_energy_cpu_and_memory_come_from_every_node(tmp_path: Path) -> None:
    rank0 = _table(["GPU-a0", "GPU-a1"], [5000.0, 7000.0], cpu_pct=150.0, rss_mib=2000.0)
    other = _table(["GPU-b0", "GPU-b1"], [1000.0, 3000.0], cpu_pct=250.0, rss_mib=3000.0)
    row, gpus = _job(_run(tmp_path, rank0, [other]))
    assert row["GPUs"] == 4 and sorted(gpus["uuid"]) == ["GPU-a0", "GPU-a1", "GPU-b0", "GPU-b1"]
    assert row["energy (kWh)"] == pytest.approx(4 * 200.0 / jobs.J_PER_KWH)
    assert row["power mean (W)"] == pytest.approx(400.0)
    assert row["CPU mean (%)"] == pytest.approx(400.0)  # 1.5 cores + 2.5 cores
    assert row["memory peak (MB)"] == 3002.0  # the fuller node's peak, not a sum
    assert row["GPU-hours"] == pytest.approx(4.0)
    assert row["host"] == "a,b"


def test_a_gpu_two_nodes_sampled_counts_once(tmp_path: Path) -> None:
    """Two sidecars on one host that both sample the host's GPU: its energy once."""
    rank0 = _table(["GPU-a0"], [5000.0], cpu_pct=100.0, rss_mib=10.0)
    other = _table(["GPU-a0"], [5000.0], cpu_pct=100.0, rss_mib=10.0)
    row, gpus = _job(_run(tmp_path, rank0, [other]))
    assert len(gpus) == 1 and row["GPUs"] == 1
    assert row["energy (kWh)"] == pytest.approx(200.0 / jobs.J_PER_KWH)


def test_the_plot_shows_rank_0_nodes_gpus(tmp_path: Path) -> None:
    rank0 = _table(["GPU-a0"], [0.0], cpu_pct=100.0, rss_mib=10.0)
    other = _table(["GPU-b0"], [0.0], cpu_pct=100.0, rss_mib=10.0)
    samples = figures.compute(_run(tmp_path, rank0, [other]).splits).utilization
    assert samples["split"].tolist() == [0, 0, 0] and samples["gpu"].tolist() == [0, 0, 0]


def _prometheus_runs(*rows: tuple[str, str, str, set[int], str, float, float]) -> pd.DataFrame:
    """Runs as ``from_prometheus`` reads them: run, host, job, ranks, status, start, end."""
    return pd.DataFrame(
        [
            {
                "run": run,
                "user": "ada",
                "host": host,
                "slurm_job_id": "",
                "folder": job,
                "job": job,
                "rank": min(ranks),
                "ranks": frozenset(ranks),
                "training_s": 10.0,
                "start_unix": start,
                "end_unix": end,
                "status": status,
            }
            for run, host, job, ranks, status, start, end in rows
        ]
    )


def test_a_job_from_prometheus_has_its_nodes_runs_in_one_row() -> None:
    runs = _prometheus_runs(
        ("r2", "b", "j", {2, 3}, "failed", 5.0, 50.0),
        ("r0", "a", "j", {0, 1}, "completed", 7.0, 40.0),
        ("other", "c", "other", {0}, "running", 1.0, float("nan")),
    )
    found = from_prometheus._jobs(from_prometheus._current(runs))
    assert found["run"].tolist() == ["other", "r0"]  # by start; the lowest rank's run id
    job = found.set_index("run").loc["r0"]
    assert (job["host"], job["status"]) == ("a,b", "failed")
    assert (job["start_unix"], job["end_unix"]) == (5.0, 50.0)
    running = _prometheus_runs(
        ("r0", "a", "j", {0, 1}, "completed", 7.0, 40.0),
        ("r2", "b", "j", {2, 3}, "running", 5.0, float("nan")),
    )
    assert pd.isna(from_prometheus._jobs(running)["end_unix"].iloc[0])  # none while one runs


def test_a_run_label_a_sidecar_replaced_is_not_counted_twice() -> None:
    """Rank 1 said hello before rank 0: its sidecar exported the split under rank 1's run
    id, then under rank 0's; the first series stopped while running."""
    runs = _prometheus_runs(
        ("early", "a", "j", {1}, "ended", 7.0, 8.0),
        ("r0", "a", "j", {0, 1}, "completed", 7.0, 40.0),
        ("lost", "b", "j", {2, 3}, "ended", 7.0, 20.0),  # a node that died: kept
    )
    assert from_prometheus._current(runs)["run"].tolist() == ["r0", "lost"]
