"""The job of ``sidecar run``: the training command started as the sidecar's child, the
signals passed on to it, its end and exit status; and the sidecar's CPU priority lowered
beside it.

Attached to a terminal (stdin is one), the job runs in the sidecar's process group, as if
started directly: it reads the terminal (input, pdb) and gets Ctrl-C, Ctrl-backslash and
Ctrl-Z from it. Otherwise it gets a process group of its own, and every signal the
sidecar gets is forwarded to it once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

from markers import secret as shared_secret
from sidecar.daemon.liveness import describe_exit

log = logging.getLogger("sidecar")

# What a terminal (or the shell, on hangup) sends to its whole foreground process group:
# a job sharing our group got it already.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})
# The sidecar yields the CPU to training: on a busy node its work waits, the loop's doesn't.
DEFAULT_NICE = 10


class Job:
    """A started job; ``shares_group``: it runs in our process group (a terminal's)."""

    def __init__(self, process: subprocess.Popen[bytes], shares_group: bool) -> None:
        self.process = process
        self.shares_group = shares_group

    @classmethod
    def start(
        cls, command: list[str], endpoint: str, secret: str | None, shares_group: bool
    ) -> Job:
        """Start ``command`` with SIDECAR_ENDPOINT (and SIDECAR_SECRET when ``secret``)
        set; raises OSError when it cannot be started."""
        env = {**os.environ, "SIDECAR_ENDPOINT": endpoint}
        if secret:
            env[shared_secret.ENV] = secret
        process = subprocess.Popen(command, env=env, process_group=None if shares_group else 0)
        return cls(process, shares_group)

    def ended(self) -> bool:
        """True once the job's process has exited (reaped)."""
        return self.process.poll() is not None

    def cause(self) -> str | None:
        """How the job ended ("job exited with status 1"), None while it runs."""
        if not self.ended():
            return None
        return "job " + describe_exit(self.process.returncode)

    def got_it_too(self, signum: int) -> bool:
        """True when the terminal sent ``signum`` to the job as well (our group's)."""
        return self.shares_group and signum in TERMINAL_SIGNALS

    def send(self, signum: int) -> None:
        """Forward ``signum`` to the job."""
        self.process.send_signal(signum)

    def exit_status(self) -> int | None:
        """The job's exit status as a shell reports it (128 + the signal that killed it),
        None while it runs."""
        code = self.process.returncode
        if code is None:
            return None
        return 128 - code if code < 0 else code


def lower_priority(increment: int) -> int:
    """Add ``increment`` to the niceness of every thread of this process (Linux keeps one
    per thread: ZeroMQ's I/O thread and the NVML threads already run); threads started
    later inherit it. Returns the niceness now; a value the system refuses leaves it
    unchanged (logged): monitoring goes on."""
    target = os.getpriority(os.PRIO_PROCESS, 0) + increment
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # a thread that just ended
            continue
        except OSError as exc:
            log.warning("cannot lower the sidecar's CPU priority by %d: %s", increment, exc)
            break
    return os.getpriority(os.PRIO_PROCESS, 0)
