"""A disk that fills, where no small filesystem can be mounted (CI without privileges): a
``write_bytes`` for ``sidecar.sinks.atomic`` (both writers), handed to the server by the
test launcher (``tests.support.launcher --disk-quota DIR:BYTES``).

``DIR`` behaves as a filesystem of ``BYTES`` bytes: the regular files under it (anyone's)
use the space, and a write that does not fit writes what fits, then fails with ENOSPC, as
a full disk does. Freeing space (deleting files under ``DIR``) lets the next write through.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO


def _used(folder: Path) -> int:
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except FileNotFoundError:
                continue
    return total


class DiskQuota:
    """``folder`` as a filesystem of ``size_bytes`` bytes."""

    def __init__(self, folder: Path, size_bytes: int) -> None:
        self.folder = folder.resolve()
        self.size_bytes = size_bytes

    def room(self, path: Path) -> int | None:
        """Bytes that still fit where ``path`` lies; None when the quota does not apply."""
        if not path.resolve().is_relative_to(self.folder):
            return None
        return max(0, self.size_bytes - _used(self.folder))

    def write(self, handle: BinaryIO, path: Path, data: bytes) -> None:
        """Write ``data`` to the open ``handle`` of ``path`` as a full disk would: what
        fits, then OSError(ENOSPC)."""
        free = self.room(path)
        if free is not None and len(data) > free:
            handle.write(data[:free])
            handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        handle.write(data)
