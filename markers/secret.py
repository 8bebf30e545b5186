"""The secret a job's own sidecar shares with its job, and the CurveZMQ keys made from it.

``sidecar run`` (and the private sidecar ``start_run`` starts) makes a fresh secret and
hands it to the job in ``SIDECAR_SECRET``; the environment of a process is readable by its
own user only. Both sides derive the same two key pairs from it: the sidecar's socket is a
CURVE server with the server pair and accepts only clients that show the client pair's
public key (ZAP), so a process without the secret cannot complete the handshake, let alone
send a hello. CURVE also encrypts the traffic, which matters on tcp between hosts.

On an ipc endpoint the sidecar also leaves the secret beside its socket, readable by its
user only (``<socket>.secret``), so that ``sidecar status`` from another terminal of the
same user finds it; that user can read the job's environment anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path

import zmq
from zmq.utils import z85

ENV = "SIDECAR_SECRET"
_BYTES = 32


def new() -> str:
    """A fresh secret: 64 hex digits."""
    return secrets.token_hex(_BYTES)


def keys(secret: str, role: str) -> tuple[bytes, bytes]:
    """The (public, secret) CurveZMQ key pair, Z85-encoded, of ``role`` ("server" or
    "client") for ``secret``. Raises ValueError when ``secret`` is not 64 hex digits.
    """
    try:
        raw = bytes.fromhex(secret)
    except ValueError:
        raw = b""
    if len(raw) != _BYTES:
        raise ValueError(
            f"{ENV} must be {2 * _BYTES} hex digits (as sidecar run sets it), "
            f"got {len(secret)} characters"
        )
    secret_key = z85.encode(hashlib.sha256(b"trainmon " + role.encode() + raw).digest())
    return zmq.curve_public(secret_key), secret_key


def client(socket: zmq.Socket, secret: str) -> None:
    """Make ``socket`` (before it connects) a CURVE client of a sidecar holding ``secret``."""
    socket.curve_serverkey = keys(secret, "server")[0]
    socket.curve_publickey, socket.curve_secretkey = keys(secret, "client")


def file_beside(socket_file: Path) -> Path:
    """Where the secret of the sidecar listening on ``socket_file`` is kept."""
    return socket_file.with_name(socket_file.name + ".secret")


def save_beside(secret: str, socket_file: Path) -> None:
    """Write ``secret`` beside ``socket_file``, mode 0600, replacing a stale one; raises
    OSError when it cannot (a file of someone else's there)."""
    path = file_beside(socket_file)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret)


def read_beside(socket_file: Path) -> str | None:
    """The secret kept beside ``socket_file``, or None (none there, or not ours to read)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return file_beside(socket_file).read_text().strip()
    return None
