"""Phases timed in forked children of the training process (DataLoader workers started
with ``fork``): a child cannot use its parent's socket, so its phases are not measured;
they are counted, and the counts reach the parent through a pipe made before the fork.
The parent reports the total to the sidecar, which says it once per run (never silent).

Each count is one 8-byte write (atomic on a pipe, whatever number of workers write at
once); the parent reads them without waiting, at its own flushes.
"""

from __future__ import annotations

import os
import struct
import weakref
from collections.abc import Callable
from typing import TypeVar

_COUNT = struct.Struct("<q")
_READ_BYTES = 64 * 1024  # a multiple of the 8-byte message: reads never split one


class ChildCounts:
    """The pipe from forked children to their parent, and the parent's running total."""

    def __init__(self) -> None:
        self._read_fd = -1
        self._write_fd = -1
        self._unsent = 0  # a child's counts not written yet (the pipe was full)
        self.total = 0  # parent: phases its children recorded so far

    def before_fork(self) -> None:
        """In the parent, before a fork: make the pipe once (both ends non-blocking)."""
        if self._read_fd < 0:
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)

    def in_child(self) -> None:
        """In a new child: it only writes."""
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1

    def report(self, count: int) -> None:
        """In a child: ``count`` more phases were recorded here. Never raises, never waits:
        with the pipe full the count waits for the child's next report."""
        self._unsent += count
        if self._write_fd < 0 or not self._unsent:
            return
        try:
            os.write(self._write_fd, _COUNT.pack(self._unsent))
        except OSError:
            return
        self._unsent = 0

    def collect(self) -> int:
        """In the parent: add what the children wrote since the last call; the total."""
        if self._read_fd < 0:
            return self.total
        while True:
            try:
                data = os.read(self._read_fd, _READ_BYTES)
            except OSError:  # nothing there (BlockingIOError) or closed
                return self.total
            if not data:
                return self.total
            self.total += sum(n for (n,) in _COUNT.iter_unpack(data))

    def close(self) -> None:
        """In the parent, once the run is over: no more counts are read."""
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1


T = TypeVar("T")


def on_fork(owner: T, before: Callable[[T], None], child: Callable[[T], None]) -> None:
    """Call ``before(owner)`` in the parent before every fork and ``child(owner)`` in each
    new child, for as long as ``owner`` lives (fork hooks cannot be removed; a weak
    reference keeps them from holding it)."""
    ref = weakref.ref(owner)

    def run_before() -> None:
        target = ref()
        if target is not None:
            before(target)

    def run_child() -> None:
        target = ref()
        if target is not None:
            child(target)

    os.register_at_fork(before=run_before, after_in_child=run_child)
