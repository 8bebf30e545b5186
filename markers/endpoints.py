"""Endpoints, parsed in one place for both halves (docs/contract.md, Command line, security): ipc
sockets in a private folder of the user's, tcp on loopback unless a host is named. Standard library
only: ``import markers`` stays light.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

LOOPBACK = "127.0.0.1"


class UnsafeFolder(RuntimeError):
    """The runtime folder exists but is not private to this user; the message says why."""


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/sidecar`` when set, else ``/tmp/sidecar-<uid>``; mode 0700.

    An existing folder of ours with a looser mode is tightened to 0700. Raises UnsafeFolder
    when it is owned by another user or is not a real folder (e.g. a symlink).
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        folder = Path(base) / "sidecar"
    else:
        folder = Path(tempfile.gettempdir()) / f"sidecar-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeFolder(
            f"{folder} is not a folder owned by uid {os.getuid()}; remove it or set XDG_RUNTIME_DIR"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


IPC_PATH_MAX = 107  # bytes of a Unix socket path (sun_path, with its terminating NUL)


def check(endpoint: str) -> str:
    """``endpoint`` when it is one a sidecar can serve: ``ipc://PATH`` (at most
    ``IPC_PATH_MAX`` bytes) or ``tcp://HOST:PORT`` (HOST may be empty: loopback, or ``*``;
    PORT 1-65535, or ``*`` for any free port). Raises ValueError saying what is wrong and
    what to give instead.
    """
    usage = "give ipc:///path/to/socket or tcp://HOST:PORT"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not path or len(os.fsencode(path)) > IPC_PATH_MAX or "\0" in path:
            raise ValueError(
                f"ipc endpoint {endpoint!r}: the socket path must be 1 to "
                f"{IPC_PATH_MAX} bytes; choose a shorter path"
            )
        return endpoint
    if endpoint.startswith("tcp://"):
        _host, colon, port = endpoint[len("tcp://") :].rpartition(":")
        if colon and (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            return endpoint
        raise ValueError(f"tcp endpoint {endpoint!r} needs a port 1-65535 (or *): {usage}")
    scheme = endpoint.partition("://")[0] if "://" in endpoint else None
    what = f"unknown endpoint scheme {scheme!r}" if scheme else "no endpoint scheme"
    raise ValueError(f"{what} in {endpoint!r}: {usage}")


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc endpoint, None for other transports."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def daemon_endpoint() -> str:
    """Where ``sidecar serve`` listens and ``sidecar status`` asks, unless told otherwise."""
    return f"ipc://{runtime_dir() / 'sidecar.sock'}"


def private_endpoint() -> str:
    """A fresh ipc endpoint for one job's own sidecar (``sidecar run``, private sidecars)."""
    folder = tempfile.mkdtemp(prefix="job-", dir=runtime_dir())
    return f"ipc://{folder}/sidecar.sock"


def bind_address(endpoint: str) -> str:
    """The address to bind for ``endpoint``: a tcp endpoint without a host binds to
    loopback (``tcp://:5555`` -> ``tcp://127.0.0.1:5555``); ``tcp://*:5555`` or a named
    interface binds there, as asked. Other transports are returned unchanged.
    """
    if endpoint.startswith("tcp://:"):
        return f"tcp://{LOOPBACK}:" + endpoint[len("tcp://:") :]
    return endpoint


def connect_address(endpoint: str) -> str:
    """The address a client connects to for ``endpoint``: the same loopback default as
    ``bind_address``, and ``tcp://*:P`` (a daemon bound to all interfaces) reached on
    loopback.
    """
    if endpoint.startswith("tcp://*:"):
        return f"tcp://{LOOPBACK}:" + endpoint[len("tcp://*:") :]
    return bind_address(endpoint)
