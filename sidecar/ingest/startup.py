"""The time a training process spent before ``start_run``: from its start (the kernel's
process start time, read with psutil) to its hello, and of that the wait for a private
sidecar (which the markers measure and send as ``sidecar_wait_s``)."""

from __future__ import annotations

import socket
from typing import Any

import psutil

from sidecar.model.session_clock import Session

# A process start this long before its hello is not believed (a reused pid, a clock step).
MAX_PRE_RUN_S = 7 * 24 * 3600.0


def process_start_unix(pid: int, host: str) -> float | None:
    """When process ``pid`` on ``host`` started (Unix seconds); None when it is not on this
    host, is gone, or cannot be read."""
    if pid <= 0 or host != socket.gethostname():
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def note_startup(session: Session, body: dict[str, Any], start_unix: float) -> None:
    """Set ``session``'s time before ``start_run`` from a hello ``body`` (its ``pid``,
    ``host`` and ``sidecar_wait_s``) whose run started at ``start_unix``."""
    pid, host = body.get("pid"), body.get("host")
    started = (
        process_start_unix(pid, host) if isinstance(pid, int) and isinstance(host, str) else None
    )
    if started is not None and 0.0 <= start_unix - started <= MAX_PRE_RUN_S:
        session.pre_run_s = start_unix - started
    wait = body.get("sidecar_wait_s")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0:
        # the wait lies within the time before start_run, whether or not its start is known
        session.sidecar_wait_s = float(wait)
        session.pre_run_s = max(session.pre_run_s, session.sidecar_wait_s)
