"""A slow disk (a busy network filesystem): a ``write_bytes`` for ``sidecar.sinks.atomic``
that takes ``delay_s`` seconds per file, handed to the server by the test launcher
(``tests.support.launcher --slow-disk SECONDS``). It makes a write last long in a known,
steady way, so waits that depend on the sidecar's progress can be tested.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO


class SlowDisk:
    """Every file written takes ``delay_s`` seconds more."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def write(self, handle: BinaryIO, path: Path, data: bytes) -> None:
        """Wait, then write ``data`` to the open ``handle`` of ``path``."""
        time.sleep(self.delay_s)
        handle.write(data)
