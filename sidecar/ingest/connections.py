"""Which client connections the sidecar's socket dropped, so they can be counted.

ZeroMQ enforces the message size cap (``ZMQ_MAXMSGSIZE``) by closing the connection of a
peer that sends a bigger message, silently. A monitor socket on the ROUTER reports every
connection's end with its file descriptor, and each received message carries the
descriptor it came on (``SRCFD``), so the two can be joined: a connection that ends
without a goodbye (``finish`` or ``status``) while its client lives was dropped by
this side: a message over the cap, or a ZMTP protocol error. Those are counted as rejected
input of kind ``connection_dropped``; handshakes that fail (a peer of an incompatible
socket type or protocol) as ``handshake``, or as ``unauthenticated`` on a socket that
serves only holders of a secret (a client without it fails there). A connection that
ends after its run's process died, or that was the only link to a remote run (the server
ends that run), is not counted.

A failed handshake is reported without the connection's descriptor (the event carries
the error code), and the connection's end follows it: the failure is counted when that
end is judged, once per client (its process on ipc, its host on tcp, as the descriptor
told when it was accepted): ZeroMQ reconnects a refused client every 100 ms, and each
try is one more failed handshake of the same client.
"""

from __future__ import annotations

import os
import socket as sockets
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from markers import wire

GOODBYES = frozenset({wire.FINISH, wire.STATUS, wire.FINISH_JOB})
# A disconnect is judged this long after it was seen: a client killed by a signal loses
# its connection a moment before its process shows as gone.
JUDGE_AFTER_S = 0.5
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
REFUSED_KEPT = 1024  # refused clients remembered, so that each counts once


def client_of(fd: int) -> str | None:
    """Who is at the other end of the accepted connection ``fd``: "pid N" on a unix
    socket, the host's address on tcp; None when the descriptor tells nothing (gone)."""
    try:
        probe = sockets.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if probe.family == sockets.AF_UNIX:
            creds = probe.getsockopt(sockets.SOL_SOCKET, sockets.SO_PEERCRED, struct.calcsize("3i"))
            return f"pid {struct.unpack('3i', creds)[0]}"
        return str(probe.getpeername()[0])
    except OSError:
        return None
    finally:
        probe.close()


@dataclass
class _Peer:
    identity: bytes | None = None  # the ROUTER's routing id, from its first message
    run_id: bytes | None = None
    said_goodbye: bool = False
    spoke: bool = False  # a message came on it (so its handshake succeeded)
    client: str | None = None  # ``client_of`` its descriptor when accepted


class ConnectionWatch:
    """Joins the ROUTER's monitor events with the messages read; reports dropped ones.

    ``reject(kind, detail)`` counts one; ``connection_lost(run_id)`` is told of a run's
    connection that ended without a goodbye and returns True when that needs no count
    (its process died, or the run ends with it). ``refuse_failed_handshakes``: the socket
    serves only holders of a secret, so a failed handshake is an ``unauthenticated`` client.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        reject: Callable[[str, str], None],
        connection_lost: Callable[[bytes], bool],
        refuse_failed_handshakes: bool = False,
    ) -> None:
        self._monitor = socket.get_monitor_socket(_EVENTS)
        self._socket = socket
        self._reject = reject
        self._connection_lost = connection_lost
        self._refuse = refuse_failed_handshakes
        self._peers: dict[int, _Peer] = {}
        self._ended: list[tuple[float, _Peer]] = []
        self._failed_handshakes = 0  # whose connection's end is still to come
        self._refused: deque[str] = deque(maxlen=REFUSED_KEPT)  # clients counted already

    def message(self, fd: int, identity: bytes, run_id: bytes, control_type: str | None) -> None:
        """Note a message read from the connection ``fd`` whose ROUTER routing id is
        ``identity`` (its control type, if any)."""
        peer = self._peers.get(fd)
        if peer is None or peer.identity not in (None, identity):
            # The descriptor was reused by a new connection whose events are still
            # unread (a short-lived status client follows another quickly): read them.
            self._read_events(time.monotonic())
            peer = self._peers.setdefault(fd, _Peer())
        if peer.identity is None:
            peer.identity = identity
        peer.spoke = True
        if run_id != bytes(16):
            peer.run_id = run_id
        peer.said_goodbye = control_type in GOODBYES

    def poll(self) -> None:
        """Read the monitor's events and judge connections that ended long enough ago.

        Call it before reading messages: a connection's ACCEPTED event then comes before
        its messages. An ended connection keeps its entry until its descriptor is reused,
        so its last messages, read after the event, still count (a goodbye among them).
        """
        now_mono = time.monotonic()
        self._read_events(now_mono)
        while self._ended and now_mono - self._ended[0][0] >= JUDGE_AFTER_S:
            peer = self._ended.pop(0)[1]
            for fd in [fd for fd, known in self._peers.items() if known is peer]:
                del self._peers[fd]
            self._judge(peer)

    def _read_events(self, now_mono: float) -> None:
        while self._monitor.poll(0):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                break
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._peers[fd] = _Peer(client=client_of(fd))
            elif kind == zmq.EVENT_DISCONNECTED:
                self._ended.append((now_mono, self._peers.setdefault(fd, _Peer())))
            else:
                self._failed_handshakes += 1  # counted when its connection's end is judged

    def _judge(self, peer: _Peer) -> None:
        if not peer.spoke and self._failed_handshakes:
            self._failed_handshakes -= 1  # the end of a connection whose handshake failed
            self._count_refused(peer.client)
            return
        if peer.said_goodbye:
            return
        if peer.run_id is not None and self._connection_lost(peer.run_id):
            return
        self._reject(
            "connection_dropped",
            "a connection ended without a goodbye while its "
            f"client lives: a message over {wire.MAX_MESSAGE_BYTES} bytes (the "
            "socket's cap) or a protocol error",
        )

    def _count_refused(self, client: str | None) -> None:
        """Count a failed handshake, once per client."""
        if client is not None:
            if client in self._refused:
                return
            self._refused.append(client)
        if self._refuse:
            who = client or "a client"
            self._reject(
                "unauthenticated", f"{who} without this job's secret was refused at the handshake"
            )
        else:
            self._reject(
                "handshake",
                "a peer failed the ZeroMQ handshake (incompatible socket type or protocol)",
            )

    def close(self) -> None:
        """Stop monitoring."""
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
