"""The sidecar's socket: one ZeroMQ ROUTER bound at the endpoint. It reads frames, decodes
them with ``markers.wire`` and hands them on; frames that do not decode are rejected and
counted here. Replies go back to the sender's identity as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from markers import wire
from markers.endpoints import bind_address, ipc_path
from sidecar.ingest import records
from sidecar.ingest.connections import ConnectionWatch
from sidecar.ingest.peers import Peer, peer_of
from sidecar.ingest.streams import Registry

# Frames read per poll before the server gets to run its timers.
BATCH = 256
# Bytes that may wait in the receive queue of one connection (ZeroMQ bounds it in
# messages: sized from the largest message a markers' flush makes). Past it the markers'
# own queue fills, and they drop and count: a slow sidecar never grows without bound.
RECEIVE_QUEUE_BYTES = 4 * 1024 * 1024
RCVHWM = RECEIVE_QUEUE_BYTES // wire.FLUSH_MESSAGE_BYTES


@dataclass(frozen=True)
class Incoming:
    """One decoded message: records or a control body, with its sender's identity and,
    on an ipc socket, the kernel's credentials of the connection it came on."""

    identity: bytes
    header: wire.Header
    records: np.ndarray | None  # (phases, wire.RECORD_WIDTH), see sidecar.ingest.records
    control: dict[str, Any] | None
    peer: Peer | None = None


class Receiver:
    """Owns the ROUTER socket; ``read`` returns what arrived, ``reply`` answers a sender.

    ``run_alive(run_id)`` tells whether a run's process lives (None: unknown run); it lets
    the connection watch tell dropped connections from dead clients. ``shared``: an ipc
    socket every local user may connect to (0666; a daemon that tells users apart by
    their peer credentials), else its owner's only.
    """

    def __init__(self, endpoint: str, registry: Registry,
                 run_alive: Callable[[bytes], bool | None], shared: bool = False) -> None:
        self.endpoint = bind_address(endpoint)
        self.registry = registry
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.RCVHWM, RCVHWM)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        path = ipc_path(self.endpoint)
        self._ipc = path is not None
        if path is not None:
            self._bind_ipc(path, shared)
        else:
            self.socket.bind(self.endpoint)
        self.connections = ConnectionWatch(self.socket, registry.reject, run_alive)

    def _bind_ipc(self, path: Path, shared: bool) -> None:
        """Bind an ipc socket readable and writable by its owner only (0600; a folder
        created for it is private, 0700), or by everyone when ``shared`` (0666, 0755).
        """
        folder_mode, socket_mode = (0o755, 0o666) if shared else (0o700, 0o600)
        if not path.parent.exists():
            path.parent.mkdir(mode=folder_mode, parents=True)
            os.chmod(path.parent, folder_mode)  # mkdir's mode is filtered by the umask
        old = os.umask(0o177)  # no moment with a looser socket than asked
        try:
            self.socket.bind(self.endpoint)
        finally:
            os.umask(old)
        os.chmod(path, socket_mode)

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
                self.connections.message(frames[-1].get(zmq.SRCFD), message.identity,
                                         message.header.run_id, control_type)
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
                return Incoming(identity, header, records.decode(frame), None, peer)
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
        self.socket.close(linger=0)
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
