"""The sidecar's heap: its pages kept from one read to the next while records flow, given
back to the system once they stop.

A read decodes up to 1 MiB of slots into ~4 MB of records and as many megabytes of
temporaries, all freed when the read is done. With glibc's defaults a block over 128 KiB
(a threshold raised, as blocks are freed, to the largest one) is mapped from the system
and unmapped when freed, and the top of the heap is handed back as soon as twice that is
free: every read then maps fresh pages and takes a page fault for each 4 KiB it touches.
That was about a third of the ingest's CPU (one producer, measured: 2.2 M records/s with
the defaults, 3.1-3.6 M/s with the thresholds below). Fixed thresholds keep the pages;
``give_back`` trims the heap when the stream pauses, so an idle sidecar holds what it
held before.

glibc only (``mallopt`` and ``malloc_trim`` are its own): elsewhere both calls do
nothing and the allocator keeps its defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap: a read's largest array is ~4 MB.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the heap's top kept between reads (all of a read's temporaries).
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has ``mallopt`` and
    ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim")):
        return None
    return libc


class Heap:
    """The process's allocator settings: ``keep`` once at start, ``give_back`` when idle.
    ``libc``: the C library to call (``glibc()``; None: none, nothing is changed)."""

    def __init__(self, libc: ctypes.CDLL | None) -> None:
        self._libc = libc
        self._kept = False
        self._used_since_trim = False

    def keep(self) -> bool:
        """Keep freed blocks up to ``MMAP_THRESHOLD_BYTES`` in the heap and up to
        ``TRIM_THRESHOLD_BYTES`` of free memory at its top. Returns False (logged at
        debug level) where the C library has no such settings or refuses them."""
        libc = self._libc
        if libc is None:
            log.debug("allocator thresholds left at their defaults: no glibc")
            return False
        # mallopt returns 1 on success, 0 on error.
        self._kept = bool(
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
        if not self._kept:
            log.debug("allocator thresholds refused by the C library")
        return self._kept

    def used(self) -> None:
        """Records were taken or files written: the heap may hold their freed pages."""
        self._used_since_trim = True

    def give_back(self) -> bool:
        """Hand the heap's free pages back to the system when records were taken or files
        written since the last call (the loop is idle now); True when a trim ran."""
        if not (self._kept and self._used_since_trim):
            return False
        self._used_since_trim = False
        assert self._libc is not None  # kept
        self._libc.malloc_trim(0)
        return True
