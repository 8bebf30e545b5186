"""A real Prometheus server for the tests (Debian's ``prometheus``, on loopback, its
storage in a temporary folder) and small helpers to ask it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import env, wait_for
from tests.support.tools import require_tool


def marked_loop(input_s: float) -> str:
    """A marked training loop (``python loop.py OUT_DIR STOP_FILE``) that runs until
    STOP_FILE exists: each iteration waits ``input_s`` for its batch of 8, then 4 ms of
    forward and 1 ms of backward; every measurement is stored."""
    return textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import markers

        stop = Path(sys.argv[2])

        def loader():
            while not stop.exists():
                time.sleep({input_s})  # input
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
    """The body of a GET of ``url`` (5 s timeout)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def promql(server: str, query: str) -> list[dict[str, Any]]:
    """The ``result`` list of an instant query; fails the test when the server refuses."""
    reply = json.loads(http(f"{server}/api/v1/query?" + urllib.parse.urlencode({"query": query})))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


@contextmanager
def prometheus_server(folder: Path, config: str) -> Iterator[str]:
    """A Prometheus server run with the configuration text ``config``, its storage and log
    under ``folder``; yields its URL once ready, stops it on exit."""
    require_tool("prometheus")
    web = free_port()
    (folder / "prometheus.yml").write_text(config)
    log = (folder / "prometheus.log").open("wb")
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{web}"

    def ready() -> bool:
        try:
            return "Ready" in http(f"{url}/-/ready")
        except OSError:
            return False

    try:
        wait_for(ready, 60, "prometheus to be ready", interval_s=0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)
        log.close()


@contextmanager
def scraping(folder: Path, rule_file: Path | None = None) -> Iterator[tuple[str, int]]:
    """A Prometheus server scraping 127.0.0.1:<port> every second, evaluating
    ``rule_file``'s rules every second when given: yields (its URL, the port)."""
    target = free_port()
    rules = f"rule_files: [{json.dumps(str(rule_file))}]" if rule_file else ""
    with prometheus_server(
        folder,
        textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        {rules}
        scrape_configs:
          - job_name: trainmon
            static_configs: [{{targets: ["127.0.0.1:{target}"]}}]
    """),
    ) as url:
        yield url, target


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus server scraping 127.0.0.1:<port> every second: (its URL, port)."""
    with scraping(tmp_path) as server:
        yield server


def start_loop_job(
    folder: Path,
    port: int,
    input_s: float = 0.003,
    script: str | None = None,
    gpus: str = "two_busy_gpus",
) -> tuple[subprocess.Popen[str], Path]:
    """``marked_loop(input_s)`` (or the source ``script``, run as ``loop.py OUT_DIR
    STOP_FILE``) into ``folder/runs/job`` under ``sidecar run --metrics-port port`` with
    the stand-in GPUs ``tests.support.fake_pynvml.<gpus>``; the job ends once the returned
    stop file exists."""
    (folder / "loop.py").write_text(marked_loop(input_s) if script is None else script)
    stop = folder / "stop"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.launcher",
            "--fake-nvml",
            gpus,
            "--",
            "run",
            "--metrics-port",
            str(port),
            "--interval",
            "0.2",
            "--",
            sys.executable,
            "loop.py",
            "runs/job",
            str(stop),
        ],
        cwd=folder,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return job, stop
