"""A job under its own sidecar on tcp (``sidecar run``), for the secret tests: the job
holds the secret in its environment, nobody else does."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from markers import secret as shared_secret
from tests.support.helpers import JOB, env, job_args, sidecar_command


def free_port() -> int:
    """A tcp port on 127.0.0.1 that nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_secret(pid: int) -> str:
    """The ``SIDECAR_SECRET`` in the environment of process ``pid``."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)[shared_secret.ENV]


def run_job(short_tmp: Path, endpoint: str, stop: Path) -> subprocess.Popen[bytes]:
    """``sidecar run --endpoint ENDPOINT -- loop_job`` in ``short_tmp`` (its log in
    ``sidecar.log``, its progress in ``p.json``), training until ``stop`` exists."""
    with (short_tmp / "sidecar.log").open("wb") as log:
        return subprocess.Popen(
            sidecar_command(
                "run",
                "--endpoint",
                endpoint,
                "--",
                sys.executable,
                str(JOB),
                *job_args(out_dir="maps", stop_file=stop, progress=short_tmp / "p.json"),
            ),
            cwd=short_tmp,
            env=env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
