"""The sidecar's socket: one ZeroMQ ROUTER bound at the endpoint. It reads frames, decodes
them with ``markers.wire`` and hands them on; frames that do not decode are rejected and
counted here. Replies go back to the sender's identity as JSON.

The socket has a ZeroMQ context of its own (its ZAP handler answers for it alone). It
refuses an endpoint already served (an ipc socket file that answers; a tcp port in use)
and takes over a stale socket file nobody answers on. With a secret (a job's own sidecar)
it is a CURVE server that lets in only clients holding the secret (``markers.secret``);
the others fail the handshake and are counted (``unauthenticated``). ZMTP heartbeats drop
a client that stops answering (a dead host, a frozen process) within ``heartbeat_s``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket as stdlib_socket
import stat
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from markers import secret as shared_secret
from markers import wire
from markers.endpoints import bind_address, ipc_path
from sidecar.ingest.connections import ConnectionWatch
from sidecar.ingest.peers import Peer, peer_of
from sidecar.ingest.streams import Registry

log = logging.getLogger("sidecar")

# Frames read per poll before the server gets to run its timers.
BATCH = 256
HEARTBEAT_S = 10.0  # default: a silent client is dropped within this many seconds


class EndpointError(Exception):
    """An endpoint this sidecar cannot serve; the message says why and what to do."""


class _OneKey:
    """ZAP credentials: only the client key made from the job's secret gets in."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        """True for the job's key (pyzmq's ZAP handler calls it per handshake)."""
        return key == self.public_key


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


@dataclass(frozen=True)
class Incoming:
    """One decoded message: records or a control body, with its sender's identity and,
    on an ipc socket, the kernel's credentials of the connection it came on."""

    identity: bytes
    header: wire.Header
    records: array | None
    control: dict[str, Any] | None
    peer: Peer | None = None


class Receiver:
    """Owns the ROUTER socket; ``read`` returns what arrived, ``reply`` answers a sender.

    ``connection_lost(run_id)`` is told when the connection of a run ended without a
    goodbye; it returns True when that is the run's end (not a connection to count as
    dropped). ``secret``: serve only clients holding it. ``shared``: an ipc socket every
    local user may connect to (0666; a daemon that tells users apart by their peer
    credentials), else its owner's only. Raises EndpointError when the endpoint cannot be
    served.
    """

    def __init__(self, endpoint: str, registry: Registry,
                 connection_lost: Callable[[bytes], bool], secret: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, shared: bool = False) -> None:
        self.endpoint = bind_address(endpoint)
        self.registry = registry
        self.context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.socket = self.context.socket(zmq.ROUTER)
        try:
            self._configure(secret, heartbeat_s)
            path = ipc_path(self.endpoint)
            self._ipc = path is not None
            if path is not None:
                self._bind_ipc(path, shared)
                if secret is not None:
                    self._save_secret(secret, path)
            else:
                self._bind(self.endpoint)
        except BaseException:
            self._close_context()
            raise
        self.connections = ConnectionWatch(self.socket, registry.reject, connection_lost,
                                           refuse_failed_handshakes=secret is not None)

    def _configure(self, secret: str | None, heartbeat_s: float) -> None:
        socket = self.socket
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A ping every fifth of the time, an answer awaited for three fifths of it: a
        # silent peer is dropped within heartbeat_s. TTL tells the clients the same bound.
        socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_s * 200)))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat_s * 600)))
        socket.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, int(heartbeat_s * 1000)))
        if secret is None:
            return
        server_secret_key = shared_secret.keys(secret, "server")[1]
        self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("sidecar.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(
            "*", credentials_provider=_OneKey(shared_secret.keys(secret, "client")[0]))
        socket.curve_server = True
        socket.curve_secretkey = server_secret_key

    def _bind(self, address: str) -> None:
        try:
            self.socket.bind(address)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise EndpointError(f"{self.endpoint} is already in use (another sidecar or "
                                    "program listens there): choose another port, or leave "
                                    "--endpoint out for a private ipc socket") from None
            raise EndpointError(f"cannot listen on {self.endpoint}: {exc}") from None

    def _bind_ipc(self, path: Path, shared: bool) -> None:
        """Bind an ipc socket readable and writable by its owner only (0600; a folder
        created for it is private, 0700), or by everyone when ``shared`` (0666, 0755). A
        socket file that answers is another sidecar's: refused; one nobody answers on is
        stale: taken over.
        """
        folder_mode, socket_mode = (0o755, 0o666) if shared else (0o700, 0o600)
        try:
            if not path.parent.exists():
                path.parent.mkdir(mode=folder_mode, parents=True)
                os.chmod(path.parent, folder_mode)  # mkdir's mode is filtered by the umask
            if path.exists() or path.is_symlink():
                if not stat.S_ISSOCK(path.lstat().st_mode):
                    raise EndpointError(f"{path} exists and is not a socket: remove it or "
                                        "choose another endpoint")
                if _answers(path):
                    raise EndpointError(f"{self.endpoint} is already served by another "
                                        "sidecar: stop it, or choose another endpoint")
                path.unlink()
                log.info("took over the stale socket file %s (nobody answered on it)", path)
        except OSError as exc:
            raise EndpointError(f"cannot use {path}: {exc.strerror or exc}") from None
        old = os.umask(0o177)  # no moment with a looser socket than asked
        try:
            self._bind(self.endpoint)
        finally:
            os.umask(old)
        os.chmod(path, socket_mode)

    @staticmethod
    def _save_secret(secret: str, path: Path) -> None:
        """Keep the secret beside the socket for ``sidecar status`` of the same user."""
        try:
            shared_secret.save_beside(secret, path)
        except OSError as exc:
            log.warning("cannot keep the secret beside %s (%s): sidecar status needs %s",
                        path, exc.strerror or exc, shared_secret.ENV)

    def read(self, timeout_ms: int) -> list[Incoming]:
        """Wait up to ``timeout_ms`` for frames; return up to ``BATCH`` decoded messages."""
        out: list[Incoming] = []
        self.connections.poll()
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return out
        self.connections.poll()
        for _ in range(BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = self.decode([frame.bytes for frame in frames],
                                  peer_of(frames[-1]) if self._ipc else None)
            if message is not None:
                control_type = message.control["type"] if message.control else None
                self.connections.message(frames[-1].get(zmq.SRCFD), message.header.run_id,
                                         control_type)
                out.append(message)
        return out

    def decode(self, parts: list[bytes], peer: Peer | None = None) -> Incoming | None:
        """Decode one ROUTER message (identity, frame) sent by ``peer``; None after
        rejecting a bad one."""
        if len(parts) != 2:
            self.registry.reject("malformed", f"{len(parts) - 1} frames in one message")
            return None
        identity, frame = parts
        try:
            header = wire.decode_header(frame)
            if header.kind == wire.KIND_RECORDS:
                return Incoming(identity, header, wire.decode_records(frame), None, peer)
            return Incoming(identity, header, None, wire.decode_control(frame), peer)
        except wire.WireError as exc:
            self.registry.reject(exc.kind, str(exc))
            return None

    def reply(self, identity: bytes, body: dict[str, Any]) -> None:
        """Send ``body`` as JSON to ``identity``; a vanished peer is ignored."""
        with contextlib.suppress(zmq.ZMQError):
            self.socket.send_multipart([identity, json.dumps(body).encode()], zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket and remove an ipc socket file."""
        self.connections.close()
        self._close_context()
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
            if self._auth is not None:
                shared_secret.file_beside(path).unlink(missing_ok=True)

    def _close_context(self) -> None:
        self.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.context.term()
