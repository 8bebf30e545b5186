"""Binding the sidecar's socket at its endpoint, refusing one that is taken.

An ipc endpoint is a socket file: libzmq would silently replace an existing one, stealing
the endpoint of a sidecar that still serves it. So a file there is probed first: one that
answers is another sidecar's (refused), one nobody answers on is stale (taken over), one
that is not a socket is left alone (refused). A tcp port in use is refused. The socket
file is created readable and writable by its owner only (0600, in a 0700 folder made for
it), or by everyone for a shared daemon (0666, 0755).
"""

from __future__ import annotations

import errno
import logging
import os
import socket as stdlib_socket
import stat
from pathlib import Path

import zmq

from markers.endpoints import ipc_path

log = logging.getLogger("sidecar")


class EndpointError(Exception):
    """An endpoint this sidecar cannot serve; the message says why and what to do."""


def _answers(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket file ``path``."""
    probe = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # not ours to connect to (another user's): someone is there
        return True
    finally:
        probe.close()
    return True


def _bind(socket: zmq.Socket, endpoint: str) -> None:
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise EndpointError(
                f"{endpoint} is already in use (another sidecar or program "
                "listens there): choose another port, or leave --endpoint "
                "out for a private ipc socket"
            ) from None
        raise EndpointError(f"cannot listen on {endpoint}: {exc}") from None


def _clear_ipc(path: Path, folder_mode: int) -> None:
    """Make the socket's folder when missing; take a stale socket file away."""
    try:
        if not path.parent.exists():
            path.parent.mkdir(mode=folder_mode, parents=True)
            os.chmod(path.parent, folder_mode)  # mkdir's mode is filtered by the umask
        if not (path.exists() or path.is_symlink()):
            return
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise EndpointError(
                f"{path} exists and is not a socket: remove it or choose another endpoint"
            )
        if _answers(path):
            raise EndpointError(
                f"ipc://{path} is already served by another sidecar: stop "
                "it, or choose another endpoint"
            )
        path.unlink()
        log.info("took over the stale socket file %s (nobody answered on it)", path)
    except OSError as exc:
        raise EndpointError(f"cannot use {path}: {exc.strerror or exc}") from None


def bind(socket: zmq.Socket, endpoint: str, shared: bool = False) -> None:
    """Bind ``socket`` at ``endpoint`` (a bind address); ``shared``: an ipc socket every
    local user may connect to. Raises EndpointError when it cannot be served."""
    path = ipc_path(endpoint)
    if path is None:
        _bind(socket, endpoint)
        return
    folder_mode, socket_mode = (0o755, 0o666) if shared else (0o700, 0o600)
    _clear_ipc(path, folder_mode)
    old = os.umask(0o177)  # no moment with a looser socket than asked
    try:
        _bind(socket, endpoint)
    finally:
        os.umask(old)
    os.chmod(path, socket_mode)
