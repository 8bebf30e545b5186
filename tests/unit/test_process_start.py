"""A process's start time as the sidecar reads it: the kernel's start ticks placed against
``CLOCK_BOOTTIME``, not psutil's ``create_time()`` (whole-second ``btime`` plus the ticks,
early by the boot time's fraction of a second)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.ingest.startup import process_start_unix

BOOT_UNIX = 1_700_000_000.64  # a boot time with a fraction: btime says 1700000000
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _fake_proc(root: Path, pid: int, start_ticks: int) -> Path:
    """A /proc with ``/proc/stat`` (btime) and ``/proc/<pid>/stat`` of a process whose
    command name holds a space and a parenthesis, started ``start_ticks`` after boot."""
    (root / str(pid)).mkdir(parents=True)
    (root / "stat").write_text(f"cpu 1 2 3 4\nbtime {int(BOOT_UNIX)}\n")
    fields = ["S", *["0"] * 18, str(start_ticks), "0", "0"]
    (root / str(pid) / "stat").write_text(f"{pid} (my (job) x) {' '.join(fields)}\n")
    return root


def test_the_boot_times_fraction_is_kept(tmp_path: Path) -> None:
    """Booted at .64 s past a second, the process started 500 s after boot, the boot clock
    reads 1000 s now: its start is boot + 500 s exactly, not btime + 500 s."""
    pid = os.getpid()
    proc = _fake_proc(tmp_path, pid, 500 * TICKS_PER_S)
    clocks = lambda: (BOOT_UNIX + 1000.0, 1000.0)  # noqa: E731
    started = process_start_unix(pid, socket.gethostname(), proc, clocks)
    assert started == pytest.approx(BOOT_UNIX + 500.0, abs=1e-6)
    assert process_start_unix(pid + 1, socket.gethostname(), proc, clocks) is None  # gone
    assert process_start_unix(pid, "another-host", proc, clocks) is None


def test_a_broken_stat_file_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (cut")
    assert process_start_unix(7, socket.gethostname(), tmp_path) is None


def test_a_real_process_starts_just_before_its_own_first_clock_read() -> None:
    """A child reads ``time.time()`` as its first statement: its start is before that, by
    the interpreter's own start (tens of ms) and a tick at most, never by the boot time's
    fraction (0.43 s on the machine this was written on)."""
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", "import time; print(repr(time.time()), flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        first_unix = float(child.stdout.readline())
        started = process_start_unix(child.pid, socket.gethostname())
    finally:
        child.communicate("\n", timeout=30)
    assert started is not None
    assert started <= first_unix
    assert first_unix - started < 0.25, f"start read {first_unix - started:.3f} s early"
