"""Whether a training process still lives, and how to say how one ended."""

from __future__ import annotations

import signal

import psutil


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs on this host (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
