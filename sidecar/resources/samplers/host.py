"""CPU and memory of the job's process tree, read from ``/proc`` (Linux), psutil for USS.

The job is its root processes (the training processes) and all their descendants (data
loader workers, their children, ...). Descendants are found by walking the tree down from
the roots through the kernel's per-thread ``children`` lists (``/proc/<pid>/task/<tid>/
children``): the cost follows the job's processes and threads, not the host's (psutil's
``children(recursive=True)`` reads every process on the host, once per root). Where the
kernel has no such lists (built without ``CONFIG_PROC_CHILDREN``) one scan of every
process serves all the roots. The tree is refreshed every ``tree_refresh_s``; between
refreshes the known processes are read directly. A process found once stays in the job
while it runs, even if its parent exits.

Per process and round, one read of ``/proc/<pid>/stat`` gives its CPU time, its RSS and
its start time (a pid reused by another process is dropped at once, its start time
differs):

* CPU: the sum over the tree of the CPU time (user + system) since the previous round
  over the wall time since then (100 = one core). A process counts from the round after
  the one that found it (its first reading is a baseline), so a new process's first
  interval is missed.
* RSS: the sum of resident set sizes. Pages shared between processes (a fork's
  copy-on-write pages, shared libraries) are counted once per process, so the sum
  overstates the job's memory when data loader workers are forked.
* USS (memory unique to each process, the honest sum for forked workers) is psutil's
  ``memory_full_info`` (``/proc/<pid>/smaps_rollup``: ~0.3 ms for a small process and
  far more for a large one, whose page tables the kernel walks while holding its memory
  map's lock). It is measured every ``uss_period_s`` (``USS_PERIOD_S``) and when the
  caller asks (a run's last round), None on the other rounds.
* The host's memory used: ``/proc/meminfo``'s (MemTotal − MemAvailable) / MemTotal, as
  psutil's ``virtual_memory().percent``.

Processes that exit, turn zombie or deny access are dropped quietly.
Memory is in MiB = bytes / 1024².
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from sidecar.model.units import BYTES_PER_MIB

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_CHILDREN_LISTS = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
# How often the job's USS is read (s): the dearest reading by far, and one that holds each
# process's memory map lock meanwhile; memory moves slowly, and a run's end is read too.
USS_PERIOD_S = 30.0


@dataclass(frozen=True)
class HostSample:
    """One reading of the job's process tree and the host's memory."""

    t_ns: int
    cpu_pct: float  # summed over the tree; 100 = one core
    rss_mib: float
    uss_mib: float | None  # every USS_PERIOD_S and at a run's end, else None
    system_mem_used_pct: float
    n_processes: int


def read_stat(pid: int) -> tuple[int, int, int] | None:
    """``(CPU ticks, user + system; RSS pages; start time, ticks since boot)`` of ``pid``
    from ``/proc/<pid>/stat``; None when it is gone, a zombie, or cannot be read."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # after the command name, which may hold spaces and parentheses: field 3 (state) on
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 22 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[11]) + int(fields[12]), int(fields[21]), int(fields[19])


def _children(pid: int) -> list[int]:
    """The child pids of ``pid``: every one of its threads' ``children`` list."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as listing:
                found += [int(child) for child in listing.read().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _parents() -> dict[int, list[int]]:
    """Every process's children, from one scan of the host (kernels without per-thread
    ``children`` lists)."""
    tree: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        tree.setdefault(proc.info["ppid"], []).append(proc.pid)
    return tree


def _system_mem_used_pct() -> float:
    """The host's memory used, %: (MemTotal − MemAvailable) / MemTotal, 0.1 % steps."""
    total = available = None
    with open("/proc/meminfo", "rb") as meminfo:
        for line in meminfo:
            if line.startswith(b"MemTotal:"):
                total = int(line.split()[1])
            elif line.startswith(b"MemAvailable:"):
                available = int(line.split()[1])
                break
    if not total or available is None:  # a kernel before 3.14: psutil estimates it
        return float(psutil.virtual_memory().percent)
    return round(100.0 * (total - available) / total, 1)


@dataclass
class _Proc:
    """A process of the job: its start time (pid reuse) and its last CPU reading."""

    start: int
    ticks: int | None = None  # None until its first reading (the baseline)


class HostSampler:
    """Samples the process trees under ``root_pids``; one caller, not thread-safe."""

    def __init__(
        self,
        root_pids: Iterable[int],
        tree_refresh_s: float = 5.0,
        uss_period_s: float = USS_PERIOD_S,
    ) -> None:
        self._roots: set[int] = set()
        self._procs: dict[int, _Proc] = {}
        self._refresh_ns = round(tree_refresh_s * 1e9)
        self._last_refresh_ns: int | None = None
        self._uss_ns = round(uss_period_s * 1e9)
        self._last_uss_ns: int | None = None
        self._last_read_s: float | None = None  # time.monotonic() of the last round
        for pid in root_pids:
            self.add_root(pid)

    def add_root(self, pid: int) -> bool:
        """Add a training process; its tree is scanned at the next sample.

        Returns False (and adds nothing) when no such process exists or it cannot be read.
        """
        stat = read_stat(pid)
        if stat is None:
            return False
        self._roots.add(pid)
        self._procs.setdefault(pid, _Proc(stat[2]))
        self._last_refresh_ns = None
        return True

    @property
    def pids(self) -> set[int]:
        """Pids of the processes currently attributed to the job."""
        return set(self._procs)

    def sample(self, now_ns: int, uss: bool = False) -> HostSample:
        """Read the tree, refreshing it first when ``tree_refresh_s`` has passed since the
        last refresh (``now_ns`` is ``time.monotonic_ns()``; the first sample refreshes);
        the USS too when ``uss_period_s`` has passed since it was last read, or with
        ``uss`` (the first sample reads it).

        Never raises for processes that vanish; an empty job reads 0 with n_processes 0.
        """
        uss = uss or self._last_uss_ns is None or now_ns - self._last_uss_ns >= self._uss_ns
        if uss:
            self._last_uss_ns = now_ns
        refresh = (
            self._last_refresh_ns is None or now_ns - self._last_refresh_ns >= self._refresh_ns
        )
        if refresh:
            self._refresh_tree()
            self._last_refresh_ns = now_ns
        read_s = time.monotonic()
        window_s = read_s - self._last_read_s if self._last_read_s is not None else 0.0
        self._last_read_s = read_s
        cpu_ticks = 0
        rss_pages = 0
        for pid, proc in list(self._procs.items()):
            stat = read_stat(pid)
            if stat is None or stat[2] != proc.start:  # gone, zombie, or its pid reused
                self._drop(pid)
                continue
            ticks, rss, _ = stat
            if proc.ticks is not None:
                cpu_ticks += ticks - proc.ticks
            proc.ticks = ticks
            rss_pages += rss
        return HostSample(
            t_ns=now_ns,
            cpu_pct=100.0 * cpu_ticks / _TICKS_PER_S / window_s if window_s > 0 else 0.0,
            rss_mib=rss_pages * _PAGE_BYTES / BYTES_PER_MIB,
            uss_mib=self._uss_mib() if uss else None,
            system_mem_used_pct=_system_mem_used_pct(),
            n_processes=len(self._procs),
        )

    def _uss_mib(self) -> float | None:
        """The job's USS (psutil, ``smaps_rollup``); None when a process's is unreadable."""
        uss = 0
        for pid in list(self._procs):
            try:
                uss += psutil.Process(pid).memory_full_info().uss
            except _GONE:  # gone since, or smaps unreadable: no USS this round
                return None
        return uss / BYTES_PER_MIB

    def _drop(self, pid: int) -> None:
        self._procs.pop(pid, None)
        self._roots.discard(pid)

    def _refresh_tree(self) -> None:
        """Drop processes that ended, turned zombie or whose pid was reused; add new
        descendants of the roots."""
        for pid, proc in list(self._procs.items()):
            stat = read_stat(pid)
            if stat is None or stat[2] != proc.start:
                self._drop(pid)
        host_tree = None if _CHILDREN_LISTS else _parents()
        waiting = list(self._roots)
        seen = set(waiting)
        while waiting:
            pid = waiting.pop()
            for child in _children(pid) if host_tree is None else host_tree.get(pid, []):
                if child in seen:
                    continue
                seen.add(child)
                waiting.append(child)
                if child not in self._procs:
                    stat = read_stat(child)
                    if stat is not None:
                        self._procs[child] = _Proc(stat[2])
