"""The one place where the sidecar writes files: atomically, so a crash never leaves a
truncated file (write beside the target, flush to disk, then rename over it).
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
