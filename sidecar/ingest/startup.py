"""The time a training process spent before ``start_run``: from its start (the kernel's
process start time) to its hello, and of that the wait for a private sidecar (which the
markers measure and send as ``sidecar_wait_s``); for a later run of the same process, the
time its own ``start_run`` took before the hello's stamp (``start_run_s``).

The kernel keeps a process's start as clock ticks since boot (``/proc/<pid>/stat``,
field 22). psutil's ``create_time()`` adds ``/proc/stat``'s ``btime``, a whole number of
seconds, to them: it is early by the fractional part of the boot time, a constant per
machine of 0 to 1 s, which start-up would gain and downtime lose. Here the ticks are
placed against ``CLOCK_BOOTTIME`` (the clock they count on) read beside ``time.time()``:
precise to a tick (10 ms at the usual 100 Hz).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.model.session_clock import Session

# A process start this long before its hello is not believed (a reused pid, a clock step).
MAX_PRE_RUN_S = 7 * 24 * 3600.0
PROC = Path("/proc")
# Index of ``starttime`` (field 22 of ``proc_pid_stat(5)``) among the fields after the
# command name's closing parenthesis (the name may hold spaces and parentheses).
_START_TICKS_FIELD = 22 - 3


def now_unix_and_boot() -> tuple[float, float]:
    """``(time.time(), CLOCK_BOOTTIME)`` at the same moment, seconds: the boot clock read on
    both sides of the wall clock, its mean taken (the reads are ~100 ns apart)."""
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    unix = time.time()
    after = time.clock_gettime(time.CLOCK_BOOTTIME)
    return unix, (before + after) / 2


def start_ticks(pid: int, proc: Path = PROC) -> int:
    """Process ``pid``'s start, clock ticks since boot (``/proc/<pid>/stat``). Raises
    OSError when it is gone or unreadable, ValueError when the file is not the kernel's."""
    text = (proc / str(pid) / "stat").read_text()
    try:
        return int(text.rsplit(")", 1)[1].split()[_START_TICKS_FIELD])
    except IndexError:
        raise ValueError(f"{proc / str(pid) / 'stat'}: no start time in it") from None


def process_start_unix(
    pid: int,
    host: str,
    proc: Path = PROC,
    clocks: Callable[[], tuple[float, float]] = now_unix_and_boot,
) -> float | None:
    """When process ``pid`` on ``host`` started (Unix seconds, to a clock tick); None when
    it is not on this host, is gone, or cannot be read. ``proc`` and ``clocks`` (a
    ``now_unix_and_boot``) are the kernel's unless a test gives its own."""
    if pid <= 0 or host != socket.gethostname():
        return None
    try:
        ticks = start_ticks(pid, proc)
    except (OSError, ValueError):
        return None
    unix_now, boot_now = clocks()
    return unix_now - (boot_now - ticks / os.sysconf("SC_CLK_TCK"))


def note_startup(session: Session, body: dict[str, Any], start_unix: float) -> None:
    """Set ``session``'s time before ``start_run`` from a hello ``body`` (its ``pid``,
    ``host``, ``sidecar_wait_s``, ``start_run_s`` and ``earlier_runs``) whose run started
    at ``start_unix``. A run after others in the same process (a k-fold split) starts at
    its own ``start_run`` call, ``start_run_s`` before ``start_unix``: the process's
    start, and the earlier runs, are not its start-up."""
    pid, host = body.get("pid"), body.get("host")
    first = not body.get("earlier_runs")
    started = (
        process_start_unix(pid, host)
        if first and isinstance(pid, int) and isinstance(host, str)
        else None
    )
    if started is not None and 0.0 <= start_unix - started <= MAX_PRE_RUN_S:
        session.pre_run_s = start_unix - started
    wait, within = _seconds(body.get("sidecar_wait_s")), _seconds(body.get("start_run_s"))
    if wait:
        session.sidecar_wait_s = wait
    # both lie within the time before start_run's stamp, whether or not its start is known
    session.pre_run_s = max(session.pre_run_s, wait, within)


def _seconds(value: Any) -> float:
    """A hello's duration field as seconds: 0 unless a number in 0 … ``MAX_PRE_RUN_S``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number and 0.0 < value <= MAX_PRE_RUN_S else 0.0
