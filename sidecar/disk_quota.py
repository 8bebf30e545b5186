"""Test hook: a disk that fills, where no small filesystem can be mounted (CI without
privileges). Used only by ``sidecar.atomic``, the single place where the sidecar writes.

With ``SIDECAR_TEST_DISK_QUOTA=DIR:BYTES`` in its environment, the sidecar treats ``DIR``
as a filesystem of ``BYTES`` bytes: the regular files under it (anyone's) use the space,
and a write that does not fit writes what fits, then fails with ENOSPC, as a full disk
does. Freeing space (deleting files under ``DIR``) lets the next write through. Unset, it
costs one environment lookup per file written.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO

ENV = "SIDECAR_TEST_DISK_QUOTA"


def _quota() -> tuple[Path, int] | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    folder, _, size = value.rpartition(":")
    return Path(folder).resolve(), int(size)


def _used(folder: Path) -> int:
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except FileNotFoundError:
                continue
    return total


def room(path: Path) -> int | None:
    """Bytes that still fit where ``path`` lies; None when no quota applies there."""
    quota = _quota()
    if quota is None:
        return None
    folder, size = quota
    if not path.resolve().is_relative_to(folder):
        return None
    return max(0, size - _used(folder))


def write(handle: BinaryIO, path: Path, data: bytes) -> None:
    """Write ``data`` to the open binary ``handle`` of ``path``, as a full disk would:
    what fits, then OSError(ENOSPC). Without a quota there, a plain write.
    """
    free = room(path)
    if free is not None and len(data) > free:
        handle.write(data[:free])
        handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    handle.write(data)
