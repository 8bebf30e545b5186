"""The sidecar's heap settings, on the real allocator of a real process: kept, a read's
freed megabytes are reused without page faults; given back, they leave the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from sidecar.daemon.heap import Heap, glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="needs glibc (mallopt, malloc_trim)")

# In a process of its own (the settings are the whole process's): reads as the sidecar's,
# ~4 MB of records and as much of temporaries each, freed at the end of every read.
READS = """
import json, resource, sys
import numpy as np
from sidecar.daemon.heap import Heap, glibc

heap = Heap(glibc())
kept = heap.keep() if sys.argv[1] == "keep" else False

def read():
    records = np.ones((45_000, 11), dtype=np.int64, order="F")
    temporaries = [records[:, column] * 2 for column in range(11)]
    return int(records.sum()) + len(temporaries)

read()  # the first read maps its pages in any case
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    read()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()

rss_kept = rss_bytes()
heap.used()
trimmed = heap.give_back()
rss_after = rss_bytes()
again = heap.give_back()  # nothing taken since
print(json.dumps({"kept": kept, "faults": faults, "rss_kept": rss_kept,
                  "rss_after": rss_after, "trimmed": trimmed, "again": again}))
"""


def _reads(mode: str) -> dict[str, int | bool]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(READS), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_kept_pages_are_reused_and_given_back_when_the_stream_pauses() -> None:
    defaults = _reads("defaults")
    kept = _reads("keep")
    assert kept["kept"] and not defaults["kept"]
    # 20 reads of ~8 MB: with the defaults every read maps fresh pages (thousands of
    # faults each); kept, the pages of the first read serve them all.
    assert defaults["faults"] > 20 * 1000, defaults
    assert kept["faults"] < defaults["faults"] / 10, (kept, defaults)
    # Given back: the free pages the reads left leave the process.
    assert kept["trimmed"] and not kept["again"]  # once a pause, not every empty read
    assert kept["rss_after"] < kept["rss_kept"] - 2 * 1024 * 1024, kept
    assert not defaults["trimmed"]  # nothing kept, nothing to give back


def test_no_c_library_changes_nothing() -> None:
    heap = Heap(None)
    assert not heap.keep()
    heap.used()
    assert not heap.give_back()
