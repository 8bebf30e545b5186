"""A wrong or missing secret on a job's own tcp sidecar is said as such, by the markers'
warning and by ``sidecar status``, not as a sidecar that never answered; and refused
clients are counted once a spell, however often ZeroMQ reconnects them (docs/contract.md,
Faults and bad input).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import zmq

from markers import secret as shared_secret
from tests.support.helpers import env, progress, sidecar_command, status, wait_for
from tests.support.own_sidecar import free_port, job_secret, run_job

PROBE = """
import warnings, markers
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run = markers.start_run(out_dir="maps-x", warmup_iterations=0)
    run.finish()
print("\\n".join(str(w.message) for w in caught))
"""


def test_a_refused_secret_is_said_and_counted_once(short_tmp: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    stop = short_tmp / "stop"
    sidecar = run_job(short_tmp, endpoint, stop)
    try:
        job = wait_for(lambda: progress(short_tmp / "p.json").get("pid"), 60, "the job")
        secret = job_secret(job)
        # A client with a key of its own, refused and retried by ZeroMQ every 100 ms all
        # through: every refused try below is of one spell, however the clients are spaced.
        forger: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        shared_secret.client(forger, shared_secret.new())
        forger.connect(endpoint)
        wrong = shared_secret.new()
        said = {}
        for name, extra in (("wrong", {shared_secret.ENV: wrong}), ("missing", {})):
            probe = subprocess.run(
                [sys.executable, "-c", PROBE],
                cwd=short_tmp,
                env=env(SIDECAR_ENDPOINT=endpoint, **extra),
                capture_output=True,
                text=True,
                timeout=60,
            )
            said[name] = probe.stdout
            cli = subprocess.run(
                sidecar_command("status", "--endpoint", endpoint),
                env=env(**extra),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cli.returncode != 0
            assert "no sidecar answered" not in cli.stderr, cli.stderr
            assert shared_secret.ENV in cli.stderr, cli.stderr
        assert "is not the secret of that sidecar" in said["wrong"], said
        assert "is not set" in said["missing"], said
        assert "none connected" not in said["wrong"] + said["missing"]
        # the forger, two probes and two status commands, each refused many times over
        # (ZeroMQ's retries): one spell, counted once
        view = wait_for(
            lambda: (
                (v := status(endpoint, 2.0, secret))
                and v["rejected_by_kind"].get("unauthenticated", 0) >= 1
                and v
            ),
            30,
            "the refused clients to be counted",
        )
        forger.close()
        assert view["rejected_by_kind"] == {"unauthenticated": 1}, view["rejected_by_kind"]
        stop.touch()
        assert sidecar.wait(60) == 0
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
