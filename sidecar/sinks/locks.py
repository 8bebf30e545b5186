"""Locks between sidecars that share a run folder: on one host, or on hosts that share a
filesystem with working ``flock`` (local filesystems; NFS maps it to POSIX locks).

* ``SplitClaim``: the sidecar that writes a rank of a split holds
  ``training/split-<k>/claims/rank-<r>.lock`` with an exclusive ``flock`` while the rank
  is live (one writer per split and rank: the ranks of one split may be served by several
  sidecars, one per node, docs/multi-node.md). The kernel drops the lock when the
  holder's process ends, however it ends, so a dead sidecar's claim is taken over at once
  (no pid file to go stale, no pid reuse to fool). The file holds one JSON object naming
  the holder (sidecar pid, host, run id, training pid, the run's lineage, its start); it
  stays after the lock is released, so the next writer learns which run came last. A
  folder written before claims were per rank has one ``training/split-<k>/sidecar.lock``
  naming the last run of every rank instead: a rank whose own file names no run yet
  learns its last run from there (a resume of such a folder keeps its lineage).
* ``folder_lock(out_dir)``: ``run.json`` is read, merged and replaced under an exclusive
  ``flock`` of ``<out_dir>/.run.json.lock``, so splits written by several sidecars at once
  all keep their entries.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sidecar.sinks import layout

FOLDER_LOCK_TIMEOUT_S = 10.0  # run.json is rewritten in milliseconds; longer means stuck
_POLL_S = 0.01


class Busy(Exception):
    """The split is claimed by a live writer; ``holder`` is what its lock file says."""

    def __init__(self, holder: dict[str, Any]) -> None:
        super().__init__(f"claimed by {holder}")
        self.holder = holder


def _read_json(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _old_split_claim(split_dir: Path, rank: int) -> dict[str, Any]:
    """What the split-wide lock file of older versions says of ``rank`` (its holder and
    the rank's last run, in the per-rank file's form); {} when it is absent or names no
    run of the rank."""
    try:
        fd = os.open(split_dir / layout.OLD_SPLIT_CLAIM_FILE, os.O_RDONLY)
    except OSError:
        return {}
    try:
        said = _read_json(fd)
    finally:
        os.close(fd)
    ranks = said.get("ranks")
    last = ranks.get(str(rank)) if isinstance(ranks, dict) else None
    return {**said, "ranks": {str(rank): last}} if isinstance(last, dict) else {}


class SplitClaim:
    """The exclusive claim on one rank of a split's folder; ``previous`` is what the last
    holder wrote into the lock file ({} for none). Raises Busy when a live process holds
    it, OSError when the folder cannot be created or the file opened.
    """

    def __init__(self, split_dir: Path, rank: int = 0) -> None:
        path = split_dir / layout.claim_file(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_json(self._fd)
            os.close(self._fd)
            raise Busy(holder) from None
        self.previous = _read_json(self._fd) or _old_split_claim(split_dir, rank)

    def record(self, holder: dict[str, Any]) -> None:
        """Say in the lock file who holds it now (read by the next holder and by Busy)."""
        data = json.dumps(holder).encode()
        with contextlib.suppress(OSError):  # the claim holds without it; only news is lost
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Give the rank up (the file stays, naming the last holder)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def folder_lock(out_dir: Path, timeout_s: float = FOLDER_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive lock of ``out_dir``'s run.json for the block. Raises OSError
    (EWOULDBLOCK) when another process held it for ``timeout_s`` seconds.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / layout.RUN_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise OSError(
                        errno.EWOULDBLOCK,
                        f"{layout.RUN_FILE} stayed locked by another process for {timeout_s:g} s",
                    ) from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)
