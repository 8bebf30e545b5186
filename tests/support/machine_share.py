"""Tests marked ``alone`` run with no other test beside them under pytest-xdist.

The suite runs on several workers (pyproject.toml's ``addopts``), most of them waiting on
subprocesses; a test whose assertion compares two timings closely would read the other
workers' load as its own. Every worker holds a shared lock on one file for the duration
of each test (setup, call, teardown); an ``alone`` test holds it exclusively, so it starts
once the tests running beside it ended and no other starts until it did. A second file,
taken exclusively before either, is the turnstile that keeps the ``alone`` test from
waiting forever behind workers that take turns holding the shared lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

MARK = "alone"


def _folder(run_uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"trainmon-machine-share-{run_uid}"


def _xdist_controller(config: pytest.Config) -> bool:
    """This process runs xdist's controller (or a run without workers: ``-n0``)."""
    return getattr(config, "workerinput", None) is None and config.pluginmanager.has_plugin("xdist")


def name_the_run(config: pytest.Config) -> None:
    """On the controller: fix xdist's id of this run now (it would draw one later), so
    that ``remove`` finds the lock folder the workers made."""
    if _xdist_controller(config) and config.getoption("testrunuid") is None:
        config.option.testrunuid = uuid.uuid4().hex


def lock_folder(config: pytest.Config) -> Path | None:
    """On a worker: the folder of this run's two lock files (one per run, so that two
    suites run at once by two people do not wait on each other); None outside xdist's
    workers, where each test runs alone anyway."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else _folder(workerinput["testrunuid"])


def remove(config: pytest.Config) -> None:
    """On the controller, once every worker ended: delete this run's lock folder."""
    if _xdist_controller(config) and config.getoption("testrunuid") is not None:
        shutil.rmtree(_folder(config.getoption("testrunuid")), ignore_errors=True)


@contextlib.contextmanager
def _flock(path: Path, operation: int) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, operation)  # released when the file closes
        yield


@contextlib.contextmanager
def share(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the machine for one test: exclusively when ``alone``, shared otherwise.
    Blocks until it may start."""
    folder.mkdir(exist_ok=True)
    turnstile, machine = folder / "turnstile.lock", folder / "machine.lock"
    if alone:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(machine, fcntl.LOCK_EX):
            yield
        return
    with contextlib.ExitStack() as held:
        with _flock(turnstile, fcntl.LOCK_EX):
            held.enter_context(_flock(machine, fcntl.LOCK_SH))
        yield
