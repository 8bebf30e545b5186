"""Each alert of deploy/prometheus/trainmon.rules.yml fires on a real Prometheus scraping a
real job made to show it: two ranks under ``sidecar run`` (a slow loader, one rank slower
in Forward, so the other waits at the barrier), a GPU from the NVML stand-in that is idle
and nearly full, and a pause before finishing in which nothing is sent. The rules are
loaded with their windows shortened to seconds and their ``for`` durations to none (the
timing itself is what ``promtool test rules`` checks); the expressions are the file's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support.helpers import env
from tests.support.prometheus import http, scraping

RULES = Path(__file__).parents[2] / "deploy" / "prometheus" / "trainmon.rules.yml"
JOB = Path(__file__).parents[1] / "support" / "jobs" / "goodput_job.py"
ALERTS = {
    "TrainmonIdleGPU",
    "TrainmonInputBound",
    "TrainmonRunStoppedSending",
    "TrainmonStraggler",
    "TrainmonGPUMemoryNearFull",
    "TrainmonLowGoodput",
}


def _fast_rules(tmp_path: Path) -> Path:
    """The rules with windows of 5 s, no ``for`` and no 30-minute wall threshold."""
    text = RULES.read_text()
    text = re.sub(r"for: \d+m", "for: 0s", text)
    text = re.sub(r"\[(5|10)m\]", "[5s]", text)
    text = text.replace("trainmon_goodput_wall_seconds > 1800", "trainmon_goodput_wall_seconds > 0")
    path = tmp_path / "fast.rules.yml"
    path.write_text(text)
    return path


def test_each_alert_fires_on_a_real_job(tmp_path: Path) -> None:
    with scraping(tmp_path, _fast_rules(tmp_path)) as (url, port):
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.launcher",
                "--fake-nvml",
                "idle_full_gpu",
                "--",
                "run",
                "--metrics-port",
                str(port),
                "--interval",
                "0.2",
                "--",
                sys.executable,
                str(JOB),
                "--out-dir",
                "runs/job",
                "--clock",
                "clock",
                "--ranks",
                "2",
                "--slow-s",
                "0.04",
                "--data-s",
                "0.06",
                "--step-s",
                "0.02",
                "--iters",
                "60",
                "--epochs",
                "2",
                "--warmup",
                "2",
                "--pause-s",
                "15",
            ],
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        fired: set[str] = set()
        try:
            deadline = time.monotonic() + 240
            while fired != ALERTS and time.monotonic() < deadline and job.poll() is None:
                reply = json.loads(http(f"{url}/api/v1/alerts"))
                fired |= {
                    a["labels"]["alertname"]
                    for a in reply["data"]["alerts"]
                    if a["state"] == "firing"
                }
                time.sleep(0.5)
        finally:
            _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr
    assert fired == ALERTS, f"never fired: {sorted(ALERTS - fired)}"
