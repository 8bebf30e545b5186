"""CPU and memory of the job's process tree, with psutil.

The job is its root processes (the training processes) and all their descendants (data
loader workers, their children, ...). Finding descendants scans every process on the
host (``children(recursive=True)``, ~0.6 ms), so the tree is refreshed only every
``tree_refresh_s``; between refreshes the known processes are read directly (~20 µs
each). A process found once stays in the job while it runs, even if its parent exits.

* CPU: the sum over the tree of ``cpu_percent`` since the previous sample (100 = one
  core). A process counts from the sample after the one that found it (psutil's first
  reading of a process is a baseline), so a new process's first interval is missed.
* RSS: the sum of resident set sizes. Pages shared between processes (a fork's
  copy-on-write pages, shared libraries) are counted once per process, so the sum
  overstates the job's memory when data loader workers are forked.
* USS (memory unique to each process, the honest sum for forked workers) reads
  ``/proc/<pid>/smaps_rollup``: ~0.3 ms for a small process and more for a large one.
  It is measured only on the rounds that refresh the tree and is None on the others.

Processes that exit, turn zombie or deny access are dropped quietly.
Memory is in MiB = bytes / 1024².
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from sidecar.model.units import BYTES_PER_MIB

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess


@dataclass(frozen=True)
class HostSample:
    """One reading of the job's process tree and the host's memory."""

    t_ns: int
    cpu_pct: float  # summed over the tree; 100 = one core
    rss_mib: float
    uss_mib: float | None  # only on rounds that refreshed the tree
    system_mem_used_pct: float
    n_processes: int


class HostSampler:
    """Samples the process trees under ``root_pids``; one caller, not thread-safe."""

    def __init__(self, root_pids: Iterable[int], tree_refresh_s: float = 5.0) -> None:
        self._roots: set[int] = set()
        self._procs: dict[int, psutil.Process] = {}
        self._refresh_ns = round(tree_refresh_s * 1e9)
        self._last_refresh_ns: int | None = None
        for pid in root_pids:
            self.add_root(pid)

    def add_root(self, pid: int) -> bool:
        """Add a training process; its tree is scanned at the next sample.

        Returns False (and adds nothing) when no such process exists or it cannot be read.
        """
        try:
            proc = psutil.Process(pid)
        except _GONE:
            return False
        self._roots.add(pid)
        self._procs.setdefault(pid, proc)
        self._last_refresh_ns = None
        return True

    @property
    def pids(self) -> set[int]:
        """Pids of the processes currently attributed to the job."""
        return set(self._procs)

    def sample(self, now_ns: int) -> HostSample:
        """Read the tree, refreshing it first when ``tree_refresh_s`` has passed since the
        last refresh (``now_ns`` is ``time.monotonic_ns()``; the first sample refreshes).

        Never raises for processes that vanish; an empty job reads 0 with n_processes 0.
        """
        refresh = (
            self._last_refresh_ns is None or now_ns - self._last_refresh_ns >= self._refresh_ns
        )
        if refresh:
            self._refresh_tree()
            self._last_refresh_ns = now_ns
        cpu = 0.0
        rss = 0
        uss: int | None = 0 if refresh else None
        for pid, proc in list(self._procs.items()):
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent()
                    rss += proc.memory_info().rss
            except _GONE:
                self._drop(pid)
                continue
            if uss is not None:
                try:
                    uss += proc.memory_full_info().uss
                except _GONE:  # gone since, or smaps unreadable: no USS this round
                    uss = None
        return HostSample(
            t_ns=now_ns,
            cpu_pct=cpu,
            rss_mib=rss / BYTES_PER_MIB,
            uss_mib=None if uss is None else uss / BYTES_PER_MIB,
            system_mem_used_pct=psutil.virtual_memory().percent,
            n_processes=len(self._procs),
        )

    def _drop(self, pid: int) -> None:
        self._procs.pop(pid, None)
        self._roots.discard(pid)

    def _refresh_tree(self) -> None:
        """Drop processes that ended, turned zombie or whose pid was reused; add new
        descendants of the roots."""
        for pid, proc in list(self._procs.items()):
            try:  # is_running compares creation times, so it catches pid reuse
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except _GONE:
                alive = False
            if not alive:
                self._drop(pid)
        for root in list(self._roots):
            try:
                children = self._procs[root].children(recursive=True)
            except _GONE:
                self._drop(root)
                continue
            for child in children:
                self._procs.setdefault(child.pid, child)
