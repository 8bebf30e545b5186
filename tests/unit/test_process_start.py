"""A process's start time as the sidecar reads it: the kernel's start ticks placed against
``CLOCK_BOOTTIME``, not psutil's ``create_time()`` (whole-second ``btime`` plus the ticks,
early by the boot time's fraction of a second)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.ingest.startup import note_startup, process_start_unix
from sidecar.model.session_clock import Session

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


def _startup(start_unix: float = 1000.0, **hello: object) -> Session:
    """The session of a hello from this process stamped at ``start_unix``."""
    session = Session(number=0, start_unix=start_unix, start_ns=0, last_ns=0)
    body = {"pid": os.getpid(), "host": socket.gethostname(), **hello}
    note_startup(session, body, start_unix)
    return session


def test_a_later_run_starts_at_its_own_start_run_call() -> None:
    """A k-fold split after others in the process: its start-up is the time its
    ``start_run`` took before the stamp (reaching the sidecar), not the process's life;
    a private sidecar's start lies within that time."""
    later = _startup(earlier_runs=2, start_run_s=0.05)
    assert (later.pre_run_s, later.sidecar_wait_s) == (0.05, 0.0)
    private = _startup(earlier_runs=1, start_run_s=1.5, sidecar_wait_s=1.4)
    assert (private.pre_run_s, private.sidecar_wait_s) == (1.5, 1.4)


def test_a_first_run_counts_from_its_process_start() -> None:
    """The first run's start-up runs from the process's start (this interpreter's start,
    well over 50 ms ago), whatever its start_run took; where the start is unknown (another
    host), from its start_run call."""
    now = time.time()
    first = _startup(now, earlier_runs=0, start_run_s=0.05)
    started = process_start_unix(os.getpid(), socket.gethostname())
    assert started is not None
    assert first.pre_run_s == pytest.approx(now - started, abs=0.02)
    assert first.pre_run_s > 0.05
    assert _startup(now, host="another-host", start_run_s=0.05).pre_run_s == 0.05


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "0.05", 1e9])
def test_a_duration_out_of_bounds_is_not_start_up(value: object) -> None:
    session = _startup(earlier_runs=1, start_run_s=value, sidecar_wait_s=value)
    assert (session.pre_run_s, session.sidecar_wait_s) == (0.0, 0.0)
