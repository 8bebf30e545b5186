"""The last scrape of an exiting sidecar: under ``sidecar run`` the exporter serves until
the final files are written and the hooks hold the final state, so a scrape just before
the exit says how the run ended (completed, or incomplete when the job died unfinished).
The scrape is taken by a lifecycle hook at ``stopped`` (``tests/support/exit_scrape.py``)
on the real ``/metrics`` of the real sidecar."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.helpers import env, run_json, sidecar_command
from tests.support.prometheus import free_port

JOB = textwrap.dedent("""
    import os, sys, time
    import markers

    run = markers.start_run(out_dir="maps", warmup_iterations=1, train_batch_size=4)
    with run.epoch():
        for batch in run.train_batches([[0] * 4] * 6):
            with run.phase("forward"):
                time.sleep(0.005)
    if sys.argv[1] == "die":
        os._exit(3)  # no finish: the sidecar decides the run's end at its own exit
    run.finish()
""")


def _samples(body: str, name: str) -> dict[str, float]:
    """The values of ``trainmon_run_status`` (by status) or another family (by ``run``)."""
    for family in text_string_to_metric_families(body):
        if family.name == name:
            return {
                s.labels.get("status", s.labels.get("run", "")): s.value for s in family.samples
            }
    return {}


@pytest.mark.parametrize(
    ("how", "status", "code"), [("finish", "completed", 0), ("die", "incomplete", 3)]
)
def test_the_last_scrape_before_the_exit_has_the_final_status(
    short_tmp: Path, how: str, status: str, code: int
) -> None:
    port = free_port()
    scrape = short_tmp / "last-scrape.txt"
    (short_tmp / "job.py").write_text(JOB)
    command = sidecar_command(
        "run",
        "--metrics-port",
        str(port),
        "--",
        sys.executable,
        "job.py",
        how,
        seams=["--exit-scrape", f"{port}:{scrape}"],
    )
    # stdin a pipe, not the terminal: the job gets its own process group
    sidecar = subprocess.run(
        command, cwd=short_tmp, env=env(), input=b"", capture_output=True, timeout=120
    )
    assert sidecar.returncode == code, sidecar.stderr
    assert scrape.exists(), sidecar.stderr  # the hook scraped while the exporter served
    body = scrape.read_text()
    meta = run_json(short_tmp / "maps")
    assert meta["status"] == status
    states = _samples(body, "trainmon_run_status")
    assert states[status] == 1.0 and states["running"] == 0.0, states
    ends = _samples(body, "trainmon_run_end_timestamp_seconds")
    assert ends == {meta["run_id"]: pytest.approx(meta["end_unix"], abs=1e-3)}
