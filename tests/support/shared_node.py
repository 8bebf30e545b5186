"""A shared node daemon and jobs of real local users for the end-to-end tests.

A job runs as its user with Debian's Python and a readable copy of the markers
(``tests.support.local_users``): that user cannot read the daemon's installation.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.support import local_users
from tests.support.helpers import Sidecar


def prepare(short_tmp: Path) -> Path:
    """Make ``short_tmp`` and its ``root`` enterable by every user; returns the folder
    to put on a job's ``PYTHONPATH``."""
    short_tmp.chmod(0o755)
    (short_tmp / "root").mkdir(mode=0o755, exist_ok=True)
    return local_users.readable_markers(short_tmp / "py")


def start_shared(
    serve: Callable[..., Sidecar],
    *args: str,
    seams: Sequence[str] = (),
) -> Sidecar:
    """A ``sidecar serve --shared`` on ``short_tmp/s.sock`` serving ``short_tmp/root``."""
    return serve(args=("--shared", *args), seams=seams)


def user_job(
    user: str,
    site: Path,
    endpoint: str,
    cwd: Path,
    module: str,
    *args: str,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``python -m jobs.<module> ARGS`` as ``user`` (Debian's Python), its output
    captured as text."""
    return subprocess.Popen(
        [
            "runuser",
            "-u",
            user,
            "--",
            local_users.SYSTEM_PYTHON,
            "-W",
            "always",
            "-m",
            f"jobs.{module}",
            *args,
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(site),
            "SIDECAR_ENDPOINT": endpoint,
            **(extra_env or {}),
        },
    )
