"""Whether a training process still lives, and how to say how one ended."""

from __future__ import annotations

import signal

import psutil

# The processes being watched, kept between checks: the check runs five times a second
# per run, and building a psutil.Process (its creation time read and checked) cost more
# than reading its status. A pid seen gone is dropped; the bound only stops a sidecar
# that outlives many processes from keeping them all.
_watched: dict[int, psutil.Process] = {}
_WATCHED_MAX = 1024


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs on this host (a zombie counts as gone)."""
    proc = _watched.get(pid)
    try:
        if proc is None:
            if len(_watched) >= _WATCHED_MAX:
                _watched.clear()
            proc = _watched[pid] = psutil.Process(pid)
        alive = proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        alive = False
    if not alive:
        _watched.pop(pid, None)
    return alive


def describe_exit(returncode: int) -> str:
    """Human cause for a process exit status (negative: killed by that signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with status {returncode}"


def gone_cause(pid: int) -> str:
    """The cause of a run whose process ended without finishing it (no exit status known:
    not our child)."""
    return (
        f"process {pid} ended without finish() (killed, e.g. by SIGKILL or the "
        "out-of-memory killer, or it exited without closing the run)"
    )
