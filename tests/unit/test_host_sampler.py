"""The host sampler against real processes: a job tree built by tests/support/proc_tree.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.resources.samplers.host import HostSampler

PROC_TREE = Path(__file__).parents[1] / "support" / "proc_tree.py"
S = 1_000_000_000


class Tree:
    """A job root process that starts children on request."""

    def __init__(self) -> None:
        self.root = subprocess.Popen(
            [sys.executable, str(PROC_TREE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.root.pid

    def command(self, line: str) -> int:
        assert self.root.stdin is not None and self.root.stdout is not None
        self.root.stdin.write(line + "\n")
        self.root.stdin.flush()
        return int(self.root.stdout.readline())

    def close(self) -> None:
        assert self.root.stdin is not None
        self.root.stdin.close()
        try:
            self.root.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.root.kill()
            self.root.wait()


@pytest.fixture
def tree() -> Iterator[Tree]:
    job = Tree()
    yield job
    job.close()


@pytest.fixture
def unrelated() -> Iterator[subprocess.Popen[str]]:
    """A process holding 200 MiB that is not part of the job (a child of pytest)."""
    code = (
        "import time\nblock = bytearray(b'\\x01') * (200 * 1024 * 1024)\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_memory_of_the_job_tree_only(tree: Tree, unrelated: subprocess.Popen[str]) -> None:
    sampler = HostSampler([tree.pid], tree_refresh_s=0.0)  # rescan on every sample
    before = sampler.sample(time.monotonic_ns())
    assert before.n_processes == 1
    child = tree.command("alloc 200")
    after = sampler.sample(time.monotonic_ns(), uss=True)  # as at a run's last round
    assert after.n_processes == 2
    assert sampler.pids == {tree.pid, child}
    assert unrelated.pid not in sampler.pids
    assert 170 < after.rss_mib - before.rss_mib < 260  # 200 MiB + a Python interpreter
    assert after.uss_mib is not None and before.uss_mib is not None
    assert 170 < after.uss_mib - before.uss_mib < 260
    assert 0 < after.system_mem_used_pct <= 100


def test_grandchildren_count_too(tree: Tree) -> None:
    sampler = HostSampler([], tree_refresh_s=0.0)
    assert sampler.add_root(tree.pid)
    tree.command("alloc 100")
    sample = sampler.sample(time.monotonic_ns())
    assert sample.n_processes == 2 and sample.rss_mib > 100


def test_cpu_of_a_spinning_child(tree: Tree) -> None:
    sampler = HostSampler([tree.pid], tree_refresh_s=0.0)
    tree.command("spin")
    sampler.sample(time.monotonic_ns())  # psutil's baseline for the new child
    time.sleep(1.0)
    busy = sampler.sample(time.monotonic_ns())
    assert 20 < busy.cpu_pct < 220  # one core is 100; generous on a loaded machine


def test_tree_refresh_cadence(tree: Tree) -> None:
    sampler = HostSampler([tree.pid], tree_refresh_s=60.0)
    t0 = time.monotonic_ns()
    first = sampler.sample(t0)
    assert first.n_processes == 1 and first.uss_mib is not None  # first sample scans
    child = tree.command("alloc 200")
    between = sampler.sample(t0 + 1 * S)  # before the next refresh: not seen yet
    assert between.n_processes == 1 and child not in sampler.pids
    assert between.uss_mib is None  # USS only on refresh rounds
    assert between.rss_mib < first.rss_mib + 100
    refreshed = sampler.sample(t0 + 61 * S)
    assert refreshed.n_processes == 2 and child in sampler.pids
    assert refreshed.rss_mib > first.rss_mib + 170
    assert refreshed.uss_mib is not None  # USS_PERIOD_S (30 s) passed too


def test_uss_is_read_every_period_and_when_asked(tree: Tree) -> None:
    sampler = HostSampler([tree.pid], tree_refresh_s=1.0, uss_period_s=30.0)
    t0 = time.monotonic_ns()
    assert sampler.sample(t0).uss_mib is not None  # the first
    assert sampler.sample(t0 + 2 * S).uss_mib is None  # a rescan, not a USS round
    assert sampler.sample(t0 + 3 * S, uss=True).uss_mib is not None  # a run's last round
    assert sampler.sample(t0 + 4 * S).uss_mib is None
    assert sampler.sample(t0 + 33 * S).uss_mib is not None  # its period since the last


def test_processes_that_exit_are_dropped_quietly(tree: Tree) -> None:
    sampler = HostSampler([tree.pid], tree_refresh_s=60.0)
    tree.command("alloc 10")
    t0 = time.monotonic_ns()
    assert sampler.sample(t0).n_processes == 2
    tree.command("stop")  # the child exits between refreshes
    assert sampler.sample(t0 + S).n_processes == 1
    tree.close()  # the root exits too
    gone = sampler.sample(t0 + 2 * S)
    assert (gone.n_processes, gone.cpu_pct, gone.rss_mib) == (0, 0.0, 0.0)
    assert sampler.sample(t0 + 100 * S).n_processes == 0


def test_add_root_of_a_missing_process() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sampler = HostSampler([dead.pid])
    assert not sampler.add_root(dead.pid)
    assert sampler.sample(time.monotonic_ns()).n_processes == 0


def test_a_child_started_by_another_thread_of_the_root_is_found() -> None:
    """The kernel lists a child under the thread that started it (a data loader started
    from a worker thread), not the main one: every thread's list is read."""
    code = (
        "import subprocess, sys, threading, time\n"
        "def start():\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "threading.Thread(target=start, daemon=True).start()\n"
        "time.sleep(60)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert root.stdout is not None
    child = int(root.stdout.readline())
    try:
        sampler = HostSampler([root.pid], tree_refresh_s=0.0)
        assert sampler.sample(time.monotonic_ns()).n_processes == 2
        assert sampler.pids == {root.pid, child}
    finally:
        os.kill(child, signal.SIGKILL)
        root.kill()
        root.wait()
