"""The sidecar's socket: one ZeroMQ ROUTER bound at the endpoint. It reads frames, decodes
them (headers and controls with ``markers.wire``, the records of a whole read at once with
``sidecar.ingest.records``) and hands them on; frames that do not decode are rejected and
counted here. Replies go back to the sender's identity as JSON.

The socket has a ZeroMQ context of its own (a ZAP handler answers for it alone). It is
bound by ``binding`` (an endpoint already served is refused, a stale socket file taken
over); with a secret (a job's own sidecar) ``job_only`` lets in only its holders, the
others fail the handshake and are counted (``unauthenticated``). On tcp, ZMTP heartbeats
drop a client that stops answering (a dead host, a frozen process) within ``heartbeat_s``;
on ipc every client is a local process whose pid the server watches.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from markers import wire
from markers.endpoints import bind_address, ipc_path
from sidecar.ingest.binding import bind
from sidecar.ingest.connections import ConnectionWatch
from sidecar.ingest.job_only import JobOnly
from sidecar.ingest.peers import Peer, peer_of
from sidecar.ingest.records import decode_bodies
from sidecar.ingest.streams import Registry

# Messages read per poll before the server gets to run its timers, and the bytes they may
# hold: one read is decoded as a whole, so its bytes bound the sidecar's working memory
# (1 MiB of slots: ~45 000 records, ~4 MB decoded) whatever size the messages have.
BATCH = 256
READ_BYTES = 1024 * 1024
# A frame as read: bytes, or a view of ZeroMQ's buffer (a RECORDS body, not copied).
Frame = bytes | memoryview
HEARTBEAT_S = 10.0  # default: a silent client is dropped within this many seconds
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
    records: np.ndarray | None  # records × wire.RECORD_WIDTH
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

    def __init__(
        self,
        endpoint: str,
        registry: Registry,
        connection_lost: Callable[[bytes], bool],
        secret: str | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        shared: bool = False,
    ) -> None:
        self.endpoint = bind_address(endpoint)
        self.registry = registry
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self._guard: JobOnly | None = None
        try:
            self._configure(None if ipc_path(self.endpoint) else heartbeat_s)
            if secret is not None:
                self._guard = JobOnly(self.context, self.socket, secret)
            bind(self.socket, self.endpoint, shared)
            path = ipc_path(self.endpoint)
            self._ipc = path is not None
            if path is not None and self._guard is not None:
                self._guard.keep_beside(path)
        except BaseException:
            self._close_context()
            raise
        self.connections = ConnectionWatch(
            self.socket,
            registry.reject,
            connection_lost,
            refuse_failed_handshakes=secret is not None,
        )

    def _configure(self, heartbeat_s: float | None) -> None:
        socket = self.socket
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if heartbeat_s is None:
            # ipc: every client is a local process whose pid is watched, so heartbeats
            # add nothing; and libzmq 4.3 aborts the whole process (stream_engine_base
            # "!_io_error") when a heartbeat times out on a connection held back by the
            # receive high-water mark, as a flooding client's is.
            return
        # A ping every fifth of the time, an answer awaited for three fifths of it: a
        # silent peer is dropped within heartbeat_s. TTL tells the clients the same bound.
        socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_s * 200)))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat_s * 600)))
        socket.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, int(heartbeat_s * 1000)))

    def read(self, timeout_ms: int) -> list[Incoming]:
        """Wait up to ``timeout_ms`` for frames; return up to ``BATCH`` decoded messages
        (fewer once they hold ``READ_BYTES``), in the order they came (the records of all
        of them decoded together)."""
        self.connections.poll()
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return []
        self.connections.poll()
        arrived: list[tuple[list[Frame], Peer | None, int]] = []
        read_bytes = 0
        while len(arrived) < BATCH and read_bytes < READ_BYTES:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            # The last frame stays a view of ZeroMQ's buffer: a RECORDS body is copied
            # once, when the read's bodies are joined to be decoded together.
            parts: list[Frame] = [*(frame.bytes for frame in frames[:-1]), frames[-1].buffer]
            read_bytes += len(parts[-1])
            arrived.append(
                (parts, peer_of(frames[-1]) if self._ipc else None, frames[-1].get(zmq.SRCFD))
            )
        out = []
        for message, (_, _, fd) in zip(
            self.decode_many([(parts, peer) for parts, peer, _ in arrived]), arrived, strict=True
        ):
            if message is not None:
                control_type = message.control["type"] if message.control else None
                self.connections.message(fd, message.identity, message.header.run_id, control_type)
                out.append(message)
        return out

    def decode(self, parts: list[Frame], peer: Peer | None = None) -> Incoming | None:
        """Decode one ROUTER message (identity, frame) sent by ``peer``; None after
        rejecting a bad one."""
        return self.decode_many([(parts, peer)])[0]

    def decode_many(
        self,
        messages: list[tuple[list[Frame], Peer | None]],
    ) -> list[Incoming | None]:
        """Decode ROUTER messages ((identity, frame), sender), the records of all of them
        in one go (``sidecar.ingest.records``); None in place of each one rejected."""
        out: list[Incoming | None] = []
        records: list[tuple[int, Frame]] = []  # (index in out, body) of RECORDS messages
        for parts, peer in messages:
            if len(parts) != 2:
                self.registry.reject("malformed", f"{len(parts) - 1} frames in one message")
                out.append(None)
                continue
            identity, frame = bytes(parts[0]), parts[1]
            try:
                header = wire.decode_header(frame)
                control = (
                    wire.decode_control(bytes(frame)) if header.kind == wire.KIND_CONTROL else None
                )
            except wire.WireError as exc:
                self.registry.reject(exc.kind, str(exc))
                out.append(None)
                continue
            if control is None:
                records.append((len(out), frame[wire.HEADER.size :]))
            out.append(Incoming(identity, header, None, control, peer))
        if records:
            decoded = decode_bodies([body for _, body in records])
            for n, (index, _) in enumerate(records):
                message = out[index]
                assert message is not None
                error = decoded.errors[n]
                if error is not None:
                    self.registry.reject(error.kind, str(error))
                    out[index] = None
                else:
                    out[index] = replace(message, records=decoded.of(n))
        return out

    def reply(self, identity: bytes, body: dict[str, Any]) -> None:
        """Send ``body`` as JSON to ``identity``; a vanished peer is ignored."""
        with contextlib.suppress(zmq.ZMQError):
            self.socket.send_multipart([identity, json.dumps(body).encode()], zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket and remove an ipc socket file (and the secret beside it)."""
        self.connections.close()
        self._close_context()
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)

    def _close_context(self) -> None:
        self.socket.close(linger=0)
        if self._guard is not None:
            self._guard.close()
        self.context.term()
