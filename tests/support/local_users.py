"""Real local users for tests, and a Python they can run.

The project's own virtual environment lives where only root can read (a clone under
/root), as a node daemon's installation does. A job of another user runs Debian's
``/usr/bin/python3`` (with Debian's ``python3-zmq``, all the markers need) and a copy of
the ``markers`` package it can read: a Python the daemon's installation does not share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"


def unavailable() -> str | None:
    """Why users cannot be made here (not root, no useradd), or None."""
    if os.geteuid() != 0:
        return "local users need root"
    return None if shutil.which("useradd") else "useradd is not installed"


@contextlib.contextmanager
def local_users(count: int, tag: str = "") -> Iterator[list[str]]:
    """``count`` fresh users (no home, no login shell, each in its own group); deleted on
    exit."""
    names = [f"tm{os.getpid() % 100000}{tag}{chr(ord('a') + index)}" for index in range(count)]
    made: list[str] = []
    try:
        for name in names:
            subprocess.run(
                [
                    "useradd",
                    "--no-create-home",
                    "--user-group",
                    "--shell",
                    "/usr/sbin/nologin",
                    name,
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            made.append(name)
        yield made
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)


def user_python_unavailable() -> str | None:
    """Why the users' Python cannot run the markers (no Debian python3 or python3-zmq)."""
    if not Path(SYSTEM_PYTHON).exists():
        return f"{SYSTEM_PYTHON} is not installed"
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import zmq"], capture_output=True, timeout=60)
    return None if probe.returncode == 0 else "python3-zmq is not installed"


def readable_markers(folder: Path) -> Path:
    """A copy of the ``markers`` package (and the tests' job scripts) that every user can
    read, under ``folder`` (made readable down from it); returns the folder to put on
    ``PYTHONPATH``."""
    site = folder / "site"
    shutil.copytree(
        REPO / "markers",
        site / "markers",
        ignore=shutil.ignore_patterns("__pycache__"),
        dirs_exist_ok=True,
    )
    shutil.copytree(
        REPO / "tests" / "support" / "jobs",
        site / "jobs",
        ignore=shutil.ignore_patterns("__pycache__"),
        dirs_exist_ok=True,
    )
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return site
