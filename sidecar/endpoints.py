"""Default endpoints: ipc sockets in a private folder of the user's (SPEC §2, security)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/sidecar`` when set, else ``/tmp/sidecar-<uid>``; made 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        folder = Path(base) / "sidecar"
    else:
        folder = Path(tempfile.gettempdir()) / f"sidecar-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def daemon_endpoint() -> str:
    """Where ``sidecar serve`` listens and ``sidecar status`` asks, unless told otherwise."""
    return f"ipc://{runtime_dir() / 'sidecar.sock'}"


def private_endpoint() -> str:
    """A fresh ipc endpoint for one job's own sidecar (``sidecar run``, private sidecars)."""
    folder = tempfile.mkdtemp(prefix="job-", dir=runtime_dir())
    return f"ipc://{folder}/sidecar.sock"
