"""A job on two nodes seen by a real Prometheus server as one job (docs/multi-node.md,
docs/report.md): two node daemons (``sidecar serve --metrics-port``), each with its own
hostname (a UTS namespace) and its own two stand-in GPUs, serve ranks 0-1 and 2-3 of one
split; Prometheus scrapes both. ``sidecar report --prometheus`` must show one job with
both hosts, the four GPUs and the energy of both nodes, as the report from the shared
run folder does, and that report must add up every node's resources table.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.helpers import (
    SAME_PRIORITY,
    env,
    read_tsv,
    report_jobs,
    run_json,
    sidecar_command,
    wait_for,
)
from tests.support.prometheus import free_port, prometheus_server, promql

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "ranks_job.py"
# own hostnames need a UTS namespace (root and unshare); else both nodes share this host's
OWN_HOSTNAMES = os.geteuid() == 0 and shutil.which("unshare") is not None
NODES = (("nodeA", "two_busy_gpus", "0,1"), ("nodeB", "two_busy_gpus_elsewhere", "2,3"))


def _on(host: str, command: Sequence[str]) -> list[str]:
    """``command`` run under the hostname ``host`` when this machine can give it one."""
    if not OWN_HOSTNAMES:
        return list(command)
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *command]


def _hosts() -> list[str]:
    return sorted(h for h, _, _ in NODES) if OWN_HOSTNAMES else [socket.gethostname()]


def _node(folder: Path, host: str, fake: str, ranks: str, port: int) -> subprocess.Popen[bytes]:
    """``sidecar run --metrics-port PORT`` on ``host`` with its stand-in GPUs, around
    ranks ``ranks`` of the 4-rank job; the job lingers after its ranks ended until
    ``folder/stop`` exists, so its sidecar goes on exporting the ended split."""
    job = [sys.executable, str(JOB), "--spawn", ranks, "--truth", str(folder / "truth")]
    job += ["--world", "4", "--iters", "60", "--forward-s", "0.01"]
    linger = f'"$@" && until [ -e {folder / "stop"} ]; do sleep 0.1; done'
    sidecar = ["run", "--metrics-port", str(port), "--interval", "0.2", *SAME_PRIORITY]
    command = sidecar_command(
        *sidecar, "--", "sh", "-c", linger, "sh", *job, seams=["--fake-nvml", fake]
    )
    return subprocess.Popen(
        _on(host, command),
        cwd=folder,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _energy_of_every_table(split: Path) -> float:
    """kWh: each GPU's energy counter, last − first, in every node's resources table."""
    joules = 0.0
    for path in sorted((split / "logs").glob("resources*.tsv")):
        table = read_tsv(path)
        for _, rows in table.groupby("gpu uuid"):
            joules += rows["energy (J)"].iloc[-1] - rows["energy (J)"].iloc[0]
    return joules / 3.6e6


def test_a_job_on_two_nodes_is_one_job_from_prometheus_and_from_folders(
    short_tmp: Path,
) -> None:
    (short_tmp / "truth").mkdir()
    ports = [free_port() for _ in NODES]
    targets = ", ".join(f'"127.0.0.1:{port}"' for port in ports)
    config = textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        scrape_configs:
          - job_name: trainmon
            static_configs: [{{targets: [{targets}]}}]
    """)
    folder = short_tmp / "maps"
    with prometheus_server(short_tmp, config) as url:
        nodes = [
            _node(short_tmp, host, fake, ranks, port)
            for (host, fake, ranks), port in zip(NODES, ports, strict=True)
        ]
        try:
            # each node's sidecar still exports the ended split: a scrape of each after it
            wait_for(
                lambda: (
                    len(promql(url, 'trainmon_run_status{status="completed"} == 1')) == 2
                    or any(node.poll() is not None for node in nodes)
                ),
                120,
                "a scrape of each node's completed run",
                0.5,
            )
            runs = {r["metric"]["run"] for r in promql(url, "trainmon_run_info")}
            by_series = report_jobs(short_tmp, "--prometheus", url, "--since", "5m")
        finally:
            (short_tmp / "stop").touch()
            outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert len(runs) == 2  # each node's sidecar exports its own run id
    by_files = report_jobs(short_tmp, str(folder))
    meta = run_json(folder)
    assert len(by_series) == len(by_files) == 1, (by_series, by_files)
    series, files = by_series.iloc[0], by_files.iloc[0]
    hosts = ",".join(_hosts())
    assert series["run_id"] == files["run_id"] == meta["run_id"]
    assert series["host"] == files["host"] == hosts
    assert series["folder"] == str(folder)
    assert series["status"] == files["status"] == "completed"
    assert series["GPUs"] == files["GPUs"] == 4
    assert abs(series["wall (s)"] - files["wall (s)"]) <= 1e-3
    assert series["GPU-hours"] == pytest.approx(files["GPU-hours"], rel=1e-3)
    # the folders: every node's table adds up; Prometheus: each GPU's last counter value
    kwh = _energy_of_every_table(folder / "training" / "split-0")
    assert files["energy (kWh)"] == pytest.approx(kwh, rel=1e-6)
    assert series["energy (kWh)"] == pytest.approx(kwh, rel=0.1)
    # both nodes' power: four GPUs at 80-300 W each
    assert 4 * 80 <= series["power mean (W)"] <= 4 * 300
    assert 4 * 80 <= files["power mean (W)"] <= 4 * 300
    for column in ("train throughput (samples/s)", "data loading share (%)"):
        assert series[column] == pytest.approx(files[column], rel=0.1), column
    gpus = read_tsv(short_tmp / "report-0" / "gpus.tsv")
    assert sorted(gpus["uuid"]) == sorted(
        ["GPU-0a0a0a0a", "GPU-1b1b1b1b", "GPU-7a7a7a7a", "GPU-8b8b8b8b"]
    )
