"""A socket that serves only the holders of a job's secret (``markers.secret``).

The ROUTER becomes a CURVE server with the key pair made from the secret, and a ZAP
handler (pyzmq's authenticator thread, on the socket's own context) admits only the client
key made from it; any other client fails the handshake (counted by the connection watch).
On ipc the secret is also kept beside the socket (0600) for ``sidecar status`` of the
same user.
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from markers import secret as shared_secret

log = logging.getLogger("sidecar")


class _OneKey:
    """ZAP credentials: only the client key made from the job's secret gets in."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        """True for the job's key (pyzmq's ZAP handler calls it per handshake)."""
        return key == self.public_key


class JobOnly:
    """Guards ``socket`` (before it binds) with ``secret``; ``close`` after the socket."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, secret: str) -> None:
        self.secret = secret
        self._kept: Path | None = None
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("sidecar.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(
            "*", credentials_provider=_OneKey(shared_secret.keys(secret, "client")[0])
        )
        socket.curve_server = True
        socket.curve_secretkey = shared_secret.keys(secret, "server")[1]

    def keep_beside(self, socket_file: Path) -> None:
        """Keep the secret beside an ipc socket file (a warning when it cannot)."""
        try:
            shared_secret.save_beside(self.secret, socket_file)
            self._kept = shared_secret.file_beside(socket_file)
        except OSError as exc:
            log.warning(
                "cannot keep the secret beside %s (%s): sidecar status needs %s",
                socket_file,
                exc.strerror or exc,
                shared_secret.ENV,
            )

    def close(self) -> None:
        """Stop the ZAP handler; remove the kept secret."""
        self._auth.stop()
        if self._kept is not None:
            self._kept.unlink(missing_ok=True)
