"""``/metrics`` scraped by a real Prometheus server (Debian's ``prometheus``, on loopback,
temporary storage, a 1 s scrape interval) while a real marked loop runs under
``sidecar run --metrics-port``; then ``sidecar report --prometheus`` against that server,
compared with the report built from the run folder. A run that ended under a daemon
that goes on exporting it is reported with its status and end.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.support.helpers import Sidecar, env, read_tsv, report_jobs, run_json, wait_for
from tests.support.prometheus import (
    free_port,
    http,
    marked_loop,
    prometheus,
    prometheus_server,
    promql,
    start_loop_job,
)
from tests.support.tools import require_tool

__all__ = ["prometheus"]  # the fixture, used by name

LOOP = marked_loop(input_s=0.003)


# Its series agree with the files to 10 % at one scrape a second: the other tests' load
# beside it delays scrapes past that.
@pytest.mark.alone
def test_prometheus_scrapes_the_phase_times_and_reports_like_the_files(
    prometheus: tuple[str, int], tmp_path: Path
) -> None:
    require_tool("promtool")
    url, port = prometheus
    job, stop = start_loop_job(tmp_path, port)
    try:
        # enough scrapes of a running loop for a rate over 10 s
        wait_for(
            lambda: promql(
                url,
                'count_over_time(trainmon_phase_duration_seconds_count{phase="forward"}[1m]) >= 10',
            ),
            90,
            "10 scrapes",
            0.5,
        )
        scrape = http(f"http://127.0.0.1:{port}/metrics")
        listening = [
            c.laddr
            for c in psutil.Process(job.pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        rate = promql(
            url,
            'rate(trainmon_phase_duration_seconds_sum{phase="forward"}[10s]) '
            '/ rate(trainmon_phase_duration_seconds_count{phase="forward"}[10s])',
        )
    finally:
        stop.touch()
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr
    assert [a.ip for a in listening] == ["127.0.0.1"]  # loopback unless --metrics-addr
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=scrape, text=True, capture_output=True, timeout=60
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    table = read_tsv(
        tmp_path / "runs" / "job" / "training" / "split-0" / "logs" / "computational.tsv"
    )
    forward_s = table["Forward (s)"].mean()
    assert len(rate) == 1
    assert abs(float(rate[0]["value"][1]) - forward_s) <= 0.1 * forward_s

    by_files = report_jobs(tmp_path, "runs", out="from-files").iloc[0]
    by_series = report_jobs(tmp_path, "--prometheus", url, "--since", "5m", out="from-prometheus")
    assert len(by_series) == 1
    by_series = by_series.iloc[0]
    assert by_series["run_id"] == by_files["run_id"]
    for column in ("train throughput (samples/s)", "data loading share (%)", "wall (s)"):
        assert abs(by_series[column] - by_files[column]) <= 0.1 * by_files[column], column
    assert by_series["GPUs"] == by_files["GPUs"] == 2
    # the stand-in GPUs alternate 10 % and 90 % every 0.5 s: 1 s scrapes alias, so only
    # the range is checked here
    assert 10 <= by_series["GPU utilization mean (%)"] <= 90
    assert (tmp_path / "from-prometheus" / "report.html").stat().st_size > 50_000


def test_a_taken_metrics_port_is_said_once_and_the_run_goes_on(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "loop.py").write_text(LOOP)
        (tmp_path / "stop").touch()  # the loop ends at once
        began = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                "run",
                "--metrics-port",
                str(port),
                "--",
                sys.executable,
                "loop.py",
                "runs/job",
                "stop",
            ],
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "metrics" in line]
    assert len(lines) == 1 and f"cannot serve on 127.0.0.1:{port}" in lines[0], lines
    assert (tmp_path / "runs" / "job" / "run.json").exists()
    assert time.monotonic() - began < 60


FINITE = textwrap.dedent("""
    import sys, time
    import markers

    with markers.start_run(out_dir=sys.argv[1], warmup_iterations=2,
                           train_batch_size=8) as run:
        with run.epoch():
            for batch in run.train_batches([[0] * 8] * 40):
                with run.phase("forward"):
                    time.sleep(0.01)
""")


def test_a_run_that_ended_is_reported_with_its_status_and_end_while_still_exported(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    target = free_port()
    sidecar = serve(args=["--metrics-port", str(target)])
    with prometheus_server(
        short_tmp,
        textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        scrape_configs:
          - job_name: trainmon
            static_configs: [{{targets: ["127.0.0.1:{target}"]}}]
    """),
    ) as url:
        (short_tmp / "finite.py").write_text(FINITE)
        job = subprocess.run(
            [sys.executable, "finite.py", "maps"],
            cwd=short_tmp,
            env=env(SIDECAR_ENDPOINT=sidecar.endpoint),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert job.returncode == 0, job.stderr
        wait_for(
            lambda: run_json(sidecar.root / "maps").get("end_unix"),
            60,
            "run.json with the run's end",
        )
        meta = run_json(sidecar.root / "maps")
        # the daemon goes on exporting the ended run; a scrape after its end has it
        wait_for(
            lambda: promql(url, 'trainmon_run_status{status="completed"} == 1'),
            60,
            "a scrape of the completed run",
            0.5,
        )
        assert promql(url, 'trainmon_phase_duration_seconds_sum{phase="training"}')
        rows = report_jobs(short_tmp, "--prometheus", url, "--since", "5m", out="out")
    assert len(rows) == 1
    row = rows.iloc[0]
    assert (row["run_id"], row["status"]) == (meta["run_id"], "completed")
    assert abs(pd.Timestamp(row["end"]).timestamp() - meta["end_unix"]) <= 1.0
    assert abs(pd.Timestamp(row["start"]).timestamp() - meta["start_unix"]) <= 1.0
    assert abs(row["wall (s)"] - (meta["end_unix"] - meta["start_unix"])) <= 1e-3
