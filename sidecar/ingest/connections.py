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
the error code), and a client refused for a missing secret often gets no such event at
all: on a socket that serves only holders of a secret, a connection that ends without a
single message is a refused try. ZeroMQ retries a refused client every 100 ms, so tries
are counted per spell: a try less than REFUSED_QUIET_S after the one before is part of the
same spell, counted once. Which process made a try cannot be told: a refused connection is
usually gone before the sidecar reads its accept event, so the kernel has no peer left to
name, and clients refused at the same time count as one.
"""

from __future__ import annotations

import time
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
# Refused tries closer together than this are one spell, counted once: far longer than
# ZeroMQ's reconnect interval (100 ms) and than a busy loop's pause between two reads.
REFUSED_QUIET_S = 5.0


@dataclass
class _Peer:
    identity: bytes | None = None  # the ROUTER's routing id, from its first message
    run_id: bytes | None = None
    said_goodbye: bool = False
    spoke: bool = False  # a message came on it (so its handshake succeeded)


class ConnectionWatch:
    """Joins the ROUTER's monitor events with the messages read; reports dropped ones.

    ``reject(kind, detail)`` counts one; ``connection_lost(run_id)`` is told of a run's
    connection that ended without a goodbye and returns True when that needs no count
    (its process died, or the run ends with it). ``refuse_failed_handshakes``: the socket
    serves only holders of a secret, so a connection that ends without a message is an
    ``unauthenticated`` try. ``clock_s`` (monotonic seconds) times the spells of refused tries.
    """

    def __init__(
        self,
        socket: zmq.Socket,
        reject: Callable[[str, str], None],
        connection_lost: Callable[[bytes], bool],
        refuse_failed_handshakes: bool = False,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monitor = socket.get_monitor_socket(_EVENTS)
        self._socket = socket
        self._reject = reject
        self._connection_lost = connection_lost
        self._refuse = refuse_failed_handshakes
        self._peers: dict[int, _Peer] = {}
        self._ended: list[tuple[float, _Peer]] = []
        self._failed_handshakes = 0  # whose connection's end is still to come
        self._clock_s = clock_s
        self._last_refused_s: float | None = None  # when the latest refused try was judged

    def message(self, fd: int, identity: bytes, run_id: bytes, control_type: str | None) -> None:
        """Note a message read from the connection ``fd`` whose ROUTER routing id is
        ``identity`` (its control type, if any)."""
        peer = self._peers.get(fd)
        if peer is None or peer.identity not in (None, identity):
            # The descriptor was reused by a new connection whose events are still
            # unread (a short-lived status client follows another quickly): read them.
            self._read_events(self._clock_s())
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
        now_mono = self._clock_s()
        self._read_events(now_mono)
        while self._ended and now_mono - self._ended[0][0] >= JUDGE_AFTER_S:
            peer = self._ended.pop(0)[1]
            for fd in [fd for fd, known in self._peers.items() if known is peer]:
                del self._peers[fd]
            self._judge(peer, now_mono)

    def _read_events(self, now_mono: float) -> None:
        while self._monitor.poll(0):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                break
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._peers[fd] = _Peer()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._ended.append((now_mono, self._peers.setdefault(fd, _Peer())))
            else:
                self._failed_handshakes += 1  # counted when its connection's end is judged

    def _judge(self, peer: _Peer, now_mono: float) -> None:
        if not peer.spoke and (self._refuse or self._failed_handshakes):
            # the end of a connection whose handshake failed (on a secret's socket, a
            # client without the secret may end without a failure event)
            self._failed_handshakes = max(0, self._failed_handshakes - 1)
            self._count_refused(now_mono)
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

    def _count_refused(self, now_mono: float) -> None:
        """Count a refused try, once per spell of tries."""
        last, self._last_refused_s = self._last_refused_s, now_mono
        if last is not None and now_mono - last < REFUSED_QUIET_S:
            return  # the same spell: ZeroMQ retrying, or another client refused with it
        if self._refuse:
            self._reject(
                "unauthenticated",
                "a client without this job's secret was refused at the handshake "
                f"(tries less than {REFUSED_QUIET_S:g} s apart count once)",
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
