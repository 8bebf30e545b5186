"""A real ``tensorboard`` server on 127.0.0.1 for the export tests, read through the HTTP
data API its own frontend reads (``/data/plugin/scalars/...``), with either loader:
``--load_fast=true`` (the Rust data server) or ``false`` (the Python multiplexer)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import wait_for
from tests.support.prometheus import free_port

Scalars = list[tuple[int, float]]  # (step, value) in the server's order


class TensorBoard:
    """One started server; ``scalars`` reads a run's tag as the frontend does."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **query: str) -> Any:
        """The JSON answer of ``path`` (``query``: its parameters)."""
        url = f"{self.base}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.loads(reply.read())

    def tags(self) -> dict[str, list[str]]:
        """Each run's scalar tags (runs named by their folder under the logdir)."""
        return {run: list(tags) for run, tags in self.get("/data/plugin/scalars/tags").items()}

    def scalars(self, run: str, tag: str) -> Scalars:
        """The points of ``tag`` in ``run``, (step, value)."""
        rows = self.get("/data/plugin/scalars/scalars", run=run, tag=tag)
        return [(int(step), float(value)) for _, step, value in rows]


@contextlib.contextmanager
def tensorboard(logdir: Path, load_fast: bool) -> Iterator[TensorBoard]:
    """A server over ``logdir`` (every point kept: no sampling), up once it answers."""
    command = Path(sys.executable).with_name("tensorboard")
    if not command.exists():
        pytest.skip("needs the tensorboard command (trainmon[tensorboard])")
    port = free_port()
    process = subprocess.Popen(
        [
            str(command),
            "--logdir",
            str(logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            f"--load_fast={'true' if load_fast else 'false'}",
            "--samples_per_plugin=scalars=100000",
            "--reload_interval=1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = TensorBoard(port)

    def up() -> bool:
        try:
            server.get("/data/runs")
        except OSError:
            return False
        return True

    try:
        wait_for(up, 120, "tensorboard answering", interval_s=0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
