"""``/metrics`` scraped by a real Prometheus server (Debian's ``prometheus``, on loopback,
temporary storage, a 1 s scrape interval) while a real marked loop runs under
``sidecar run --metrics-port``; then ``sidecar report --prometheus`` against that server,
compared with the report built from the run folder.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.helpers import env, read_tsv, wait_for

LOOP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import markers

    stop = Path(sys.argv[2])

    def loader():
        while not stop.exists():
            time.sleep(0.003)  # input
            yield [0] * 8

    with markers.start_run(out_dir=sys.argv[1], warmup_iterations=2,
                           num_measurements=100000, train_batch_size=8) as run:
        with run.epoch():
            for batch in run.train_batches(loader()):
                with run.phase("forward"):
                    time.sleep(0.004)
                with run.phase("backward"):
                    time.sleep(0.001)
""")


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def promql(server: str, query: str) -> list[dict]:
    reply = json.loads(http(f"{server}/api/v1/query?"
                            + urllib.parse.urlencode({"query": query})))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus server scraping 127.0.0.1:<port> every second: (its URL, port)."""
    with start_prometheus(tmp_path) as server:
        yield server


@contextlib.contextmanager
def start_prometheus(tmp_path: Path, rule_file: Path | None = None
                     ) -> Iterator[tuple[str, int]]:
    """A Prometheus server scraping 127.0.0.1:<port> every second, evaluating
    ``rule_file``'s rules every second when given: (its URL, port)."""
    assert shutil.which("prometheus"), "prometheus is needed (Debian package; .ci/run)"
    target, web = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    rules = f"rule_files: [{json.dumps(str(rule_file))}]" if rule_file else ""
    config.write_text(textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        {rules}
        scrape_configs:
          - job_name: trainmon
            static_configs: [{{targets: ["127.0.0.1:{target}"]}}]
    """))
    log = (tmp_path / "prometheus.log").open("wb")
    server = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"], stdout=log, stderr=log,
        stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{web}"

    def ready() -> bool:
        try:
            return "Ready" in http(f"{url}/-/ready")
        except OSError:
            return False

    try:
        wait_for(ready, 60, "prometheus to be ready", interval_s=0.2)
        yield url, target
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def start_loop_job(tmp_path: Path, port: int) -> tuple[subprocess.Popen[str], Path]:
    """``LOOP`` into ``tmp_path/runs/job`` under ``sidecar run --metrics-port port`` with
    the two stand-in GPUs; the job ends once the returned stop file exists."""
    (tmp_path / "loop.py").write_text(LOOP)
    stop = tmp_path / "stop"
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.support.launcher", "--fake-nvml", "two_busy_gpus",
         "--", "run", "--metrics-port", str(port), "--interval", "0.2", "--",
         sys.executable, "loop.py", "runs/job", str(stop)], cwd=tmp_path, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return job, stop


def test_prometheus_scrapes_the_phase_times_and_reports_like_the_files(
        prometheus: tuple[str, int], tmp_path: Path) -> None:
    url, port = prometheus
    job, stop = start_loop_job(tmp_path, port)
    try:
        # enough scrapes of a running loop for a rate over 10 s
        wait_for(lambda: promql(url, 'count_over_time(trainmon_phase_duration_seconds_count'
                                '{phase="forward"}[1m]) >= 10'), 90, "10 scrapes", 0.5)
        scrape = http(f"http://127.0.0.1:{port}/metrics")
        listening = [c.laddr for c in psutil.Process(job.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        rate = promql(url, 'rate(trainmon_phase_duration_seconds_sum{phase="forward"}[10s]) '
                      '/ rate(trainmon_phase_duration_seconds_count{phase="forward"}[10s])')
    finally:
        stop.touch()
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr
    assert [a.ip for a in listening] == ["127.0.0.1"]  # loopback unless --metrics-addr
    check = subprocess.run(["promtool", "check", "metrics"], input=scrape, text=True,
                           capture_output=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    table = read_tsv(tmp_path / "runs" / "job" / "training" / "split-0" / "logs"
                     / "computational.tsv")
    forward_s = table["Forward (s)"].mean()
    assert len(rate) == 1
    assert abs(float(rate[0]["value"][1]) - forward_s) <= 0.1 * forward_s

    files = subprocess.run([sys.executable, "-m", "sidecar", "report", "runs", "--out",
                            "from-files"], cwd=tmp_path, env=env(), capture_output=True,
                           text=True, timeout=120)
    series = subprocess.run([sys.executable, "-m", "sidecar", "report", "--prometheus", url,
                             "--since", "5m", "--out", "from-prometheus"], cwd=tmp_path,
                            env=env(), capture_output=True, text=True, timeout=120)
    assert files.returncode == 0 and series.returncode == 0, files.stderr + series.stderr
    by_files = read_tsv(tmp_path / "from-files" / "jobs.tsv").iloc[0]
    by_series = read_tsv(tmp_path / "from-prometheus" / "jobs.tsv")
    assert len(by_series) == 1
    by_series = by_series.iloc[0]
    assert by_series["run_id"] == by_files["run_id"]
    for column in ("train throughput (samples/s)", "data loading share (%)", "wall (s)"):
        assert abs(by_series[column] - by_files[column]) <= 0.1 * by_files[column], column
    assert by_series["GPUs"] == by_files["GPUs"] == 2
    # the goodput gauges as last scraped, the files at the end: start-up was over by then
    assert by_files["goodput (%)"] > 0
    assert abs(by_series["goodput (%)"] - by_files["goodput (%)"]) <= 10
    startup = by_files["badput startup (s)"] + by_files["badput sidecar_start (s)"]
    assert abs(by_series["badput startup (s)"] + by_series["badput sidecar_start (s)"]
               - startup) <= 0.1 * startup + 0.05
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
            [sys.executable, "-m", "sidecar", "run", "--metrics-port", str(port), "--",
             sys.executable, "loop.py", "runs/job", "stop"], cwd=tmp_path, env=env(),
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "metrics" in line]
    assert len(lines) == 1 and f"cannot serve on 127.0.0.1:{port}" in lines[0], lines
    assert (tmp_path / "runs" / "job" / "run.json").exists()
    assert time.monotonic() - began < 60
