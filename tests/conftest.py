"""Shared fixtures: a real sidecar process on a real socket, and readers of its files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that must import this checkout's packages."""
    env = dict(os.environ)
    env.pop("SIDECAR_ENDPOINT", None)  # only where a test asks for it
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@dataclass
class Sidecar:
    """A ``sidecar serve`` subprocess writing under ``root``."""

    endpoint: str
    root: Path
    process: subprocess.Popen[bytes]

    def split_dir(self, out_dir: str = "maps", split: int = 0) -> Path:
        """``<root>/<out_dir>/training/split-<split>``."""
        return self.root / out_dir / "training" / f"split-{split}"

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def start_sidecar(root: Path, endpoint: str) -> Sidecar:
    """Start ``python -m sidecar serve`` and wait until its socket exists."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--quiet", "--endpoint", endpoint,
         "--root", str(root)], env=python_env())
    socket_file = Path(endpoint.removeprefix("ipc://"))
    deadline = time.monotonic() + 30
    while not socket_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the sidecar did not start")
        time.sleep(0.05)
    return Sidecar(endpoint, root, process)


@pytest.fixture
def sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sidecar]:
    """A sidecar serving ``tmp_path/root``; SIDECAR_ENDPOINT points at it."""
    root = tmp_path / "root"
    root.mkdir()
    server = start_sidecar(root, f"ipc://{tmp_path}/sock/sidecar.sock")
    monkeypatch.setenv("SIDECAR_ENDPOINT", server.endpoint)
    yield server
    server.stop()


def read_tsv(path: Path) -> pd.DataFrame:
    """A TSV written by the sidecar, read back with pandas."""
    return pd.read_csv(path, sep="\t")
