"""What the benchmarks share: a real sidecar subprocess, medians with their spread, and
the headline line each benchmark prints for ``bench/run_all.py``."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = "HEADLINE "  # prefix of the one stdout line run_all.py collects


@contextmanager
def sidecar(folder: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``sidecar serve --root folder`` subprocess on an ipc socket in ``folder`` (with
    its default priority), stopped (SIGTERM) on exit; yields (endpoint, process)."""
    socket_file = folder / "sidecar.sock"
    endpoint = f"ipc://{socket_file}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--quiet",
            "--endpoint",
            endpoint,
            "--root",
            str(folder),
            *args,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    with serving(process, socket_file):
        yield endpoint, process


@contextmanager
def monitored_run(out_dir: str, **settings: Any) -> Iterator[Any]:
    """A ``markers`` run (``start_run(out_dir, warmup_iterations=0, **settings)``) on a
    fresh sidecar in a temporary folder, its warnings silenced; finished on exit."""
    import markers

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, sidecar(Path(tmp)) as (endpoint, _):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = markers.start_run(
                out_dir=out_dir, warmup_iterations=0, endpoint=endpoint, **settings
            )
        try:
            yield run
        finally:
            run.finish()


@contextmanager
def serving(process: subprocess.Popen[bytes], socket_file: Path) -> Iterator[None]:
    """Wait (at most 30 s) until the sidecar ``process`` listens on ``socket_file``;
    stop it with SIGTERM on exit (SIGKILL after 60 s). Raises RuntimeError when it
    exits or does not listen in time."""
    try:
        deadline = time.monotonic() + 30
        while not socket_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start")
            time.sleep(0.05)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def spread(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    """``median (min–max)`` of ``values`` times ``scale``."""
    m, lo, hi = (statistics.median(values) * scale, min(values) * scale, max(values) * scale)
    return f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def headline(name: str, figures: dict[str, Any]) -> None:
    """Print the figures ``run_all.py`` quotes in its headline table."""
    print(HEADLINE + json.dumps({"bench": name, **figures}), flush=True)


def load_line() -> str:
    """The load average, to print beside figures measured on a shared machine."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"
