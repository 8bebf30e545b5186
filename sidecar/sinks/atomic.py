"""The one place where the sidecar writes files: atomically, so a crash never leaves a
truncated file (write beside the target, flush to disk, then rename over it); and, for a
file that other code holds open (summary.log), rewritten in place keeping its inode.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# Writes bytes into an open temporary file (its path given too); a seam for tests.
WriteBytes = Callable[[BinaryIO, Path, bytes], None]


def _write_bytes(handle: BinaryIO, _path: Path, data: bytes) -> None:
    handle.write(data)


def write_atomic(path: Path, text: str, write_bytes: WriteBytes = _write_bytes) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically, creating parent folders.

    Raises OSError (not writable, disk full, ...) with the target left as it was and no
    temporary file left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write_bytes(handle, Path(tmp), text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rewrite_in_place(
    path: Path, transform: Callable[[str], str], write_bytes: WriteBytes = _write_bytes
) -> None:
    """Replace the text of ``path`` by ``transform(text)`` in the same file (same inode),
    for a file that other code appends to while we update it (a ``logging.FileHandler``
    on summary.log): their open handles keep pointing at the file we rewrite.

    Lines appended after our read are kept: the bytes past the length we read are read
    again right before our write and written after the new text, in one write. An
    ``O_APPEND`` writer whose line lands in the microseconds between that second read and
    our write, and a writer without ``O_APPEND`` (it keeps its own offset), can still
    lose text. A write that fails (disk full) puts the previous text back, into the
    blocks it already had; unlike ``write_atomic``, a crash of the sidecar in the middle
    of the write can leave the file partial. Creates the file and its folders when
    missing; raises OSError.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        created = True
    except FileExistsError:
        fd = os.open(path, os.O_RDWR)
        created = False
    with os.fdopen(fd, "r+b", buffering=0) as handle:
        old = handle.read()
        new = transform(old.decode("utf-8", errors="replace")).encode("utf-8")
        # What others wrote since our read, read again right before our write.
        appended = os.pread(fd, max(0, os.fstat(fd).st_size - len(old)), len(old))
        try:
            handle.seek(0)
            write_bytes(handle, path, new + appended)
            handle.truncate()
            os.fsync(fd)
        except OSError:
            # Disk full: the previous text goes back into the blocks it already had.
            handle.seek(0)
            handle.write(old + appended)
            handle.truncate()
            if created:
                path.unlink(missing_ok=True)
            raise
