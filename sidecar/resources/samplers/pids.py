"""The job's processes as NVML may name them: pid namespaces.

NVML reports pids in *some* pid namespace: recent drivers translate the process lists to
the caller's namespace, the per-process utilization samples often stay in the host's. A
sidecar on the host watching a job in a container sees the job's host pids, while NVML
may report container pids; a sidecar inside the container sees container pids, while
NVML may report host pids.

* ``PidAliases.aliases`` adds, for each job pid, its pids in the namespaces nested below ours
  (the ``NSpid`` line of ``/proc/<pid>/status``), so both spellings match.
* ``PidAliases.is_foreign`` tells a pid that no process of our namespace has: NVML then speaks
  another namespace, and "none of the job's pids is listed" means "unknown", not 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def nspids(pid: int, proc: Path = PROC) -> list[int]:
    """The pids of ``pid`` in its nested namespaces, ours first (``[pid]`` when the kernel
    does not say, or the process is gone)."""
    try:
        with open(proc / str(pid) / "status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(v) for v in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return [pid]


class PidAliases:
    """Maps every alias of the job's pids to the pid in our namespace; cached per pid
    (a process keeps its pids for its lifetime)."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._cache: dict[int, list[int]] = {}

    def aliases(self, pids: Iterable[int]) -> dict[int, int]:
        """``{alias: pid}`` for ``pids`` (each is its own alias)."""
        wanted = set(pids)
        for gone in set(self._cache) - wanted:
            del self._cache[gone]
        table: dict[int, int] = {}
        for pid in wanted:
            chain = self._cache.get(pid)
            if chain is None:
                chain = self._cache[pid] = nspids(pid, self._proc)
            for alias in chain:
                table.setdefault(alias, pid)
            table[pid] = pid
        return table

    def is_foreign(self, pid: int) -> bool:
        """True when no process in our pid namespace has ``pid``."""
        return not (self._proc / str(pid)).exists()
