"""The markers' side of the socket: non-blocking sends, drop counting, bounded request waits.

One ZeroMQ DEALER socket connects to the sidecar's ROUTER. Sends use NOBLOCK: when the
sidecar is absent or slow the socket queues up to ``SNDHWM`` messages (``SEND_QUEUE_BYTES``
of full messages), then a send raises ``zmq.Again`` and the records of that message are
dropped and counted: the training process never holds more than that for the sidecar.
ZeroMQ reconnects by itself, so a sidecar started later on the same endpoint receives what follows.

A monitor socket tells whether a sidecar is connected right now; it is read only when a
request is made (rare), so a checkpoint or finish with no sidecar returns at once instead
of waiting for a reply that cannot come.

No message larger than the sidecar's cap (``wire.MAX_MESSAGE_BYTES``) is ever sent: libzmq
would drop the whole connection for it. A payload of any size (a saved state) travels as
``part`` messages of ``wire.PART_BYTES`` before the request that uses it. While a request
is being worked on (or a write this run asked for earlier, such as a checkpoint's, is
still going on), the sidecar sends progress replies; each one restarts the wait, so a long
write is waited for and a gone or stuck sidecar is given up after ``timeout_s``.
"""

from __future__ import annotations

import base64
import json
import os
import time
from array import array
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from markers import secret as shared_secret
from markers import wire

# Bytes queued while no sidecar takes them (ZeroMQ counts messages: sized from the
# largest message a flush makes); past it records are dropped and counted.
SEND_QUEUE_BYTES = 4 * 1024 * 1024
SNDHWM = SEND_QUEUE_BYTES // wire.FLUSH_MESSAGE_BYTES
CONNECT_POLL_S = 0.01
# ZMTP heartbeats: a sidecar that died with its host, or froze, is noticed within about
# HEARTBEAT_IVL + HEARTBEAT_TIMEOUT (the I/O thread pings; nothing runs in the loop).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 6000
# However much progress a sidecar reports, a request is given up after this long.
PROGRESS_LIMIT_S = 600.0
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED
# The sidecar there refused our key (a wrong secret) or our plain handshake (none). A
# CURVE server that denies a key closes the connection without saying why: a connection
# made (_CONNECTED) that ends before the handshake succeeded is that refusal.
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_CONNECTED = zmq.EVENT_CONNECTED


class Sender:
    """Sends the messages of one run; never blocks and never raises ``zmq`` errors once
    built. ``secret`` (the job's ``SIDECAR_SECRET``) authenticates it to a job's own
    sidecar; the constructor raises ValueError for a malformed one, ZMQError for an
    endpoint ZeroMQ cannot use.
    """

    def __init__(self, endpoint: str, run_id: bytes, rank: int, secret: str | None = None) -> None:
        self.run_id = run_id
        self.rank = rank
        self.seq = 0
        self.records_sent = 0
        self.dropped = 0
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SNDHWM)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if secret:
            try:
                shared_secret.client(self._socket, secret)
            except ValueError:
                self._socket.close(linger=0)
                raise
        self._monitor = self._socket.get_monitor_socket(_UP | _DOWN | _REFUSED | _CONNECTED)
        self._connected = False
        self._handshaking = False  # connected, handshake not done yet
        self._has_secret = bool(secret)
        self.refused = ""  # why the sidecar there refused our handshake, in words
        self._socket.connect(endpoint)
        self._pid = os.getpid()
        self.last_failure = ""  # why the latest request got no reply, in words

    @property
    def connected(self) -> bool:
        """Whether a sidecar is connected now (as of the socket's latest events)."""
        while self._monitor.poll(0):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                break
            kind = event["event"]
            if kind == _CONNECTED:
                self._handshaking = True
                continue
            refused = kind & _REFUSED or (self._handshaking and kind == zmq.EVENT_DISCONNECTED)
            if refused:
                self.refused = self._refusal()
            self._handshaking = False
            self._connected = kind == _UP
        return self._connected

    def _refusal(self) -> str:
        if self._has_secret:
            return (
                f"the sidecar there refused this process's key: {shared_secret.ENV} is "
                "not the secret of that sidecar"
            )
        return (
            f"the sidecar there serves only holders of its secret and {shared_secret.ENV} "
            "is not set"
        )

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for a sidecar to be connected."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            if self.refused or time.monotonic() >= deadline:  # a refusal is for good
                return False
            time.sleep(CONNECT_POLL_S)
        return True

    def _header(self, kind: int) -> bytes:
        return wire.pack_header(
            kind, self.rank, self.seq, self.records_sent, self.dropped, self.run_id
        )

    def _send(self, frame: bytes) -> bool:
        if os.getpid() != self._pid:  # a forked child (data-loader worker) must not share it
            return False
        if len(frame) > wire.MAX_MESSAGE_BYTES:  # it would cost the whole connection
            return False
        try:
            self._socket.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        self.seq += 1
        return True

    def send_records(self, records: array, count: int) -> None:
        """Send ``count`` records (flat int64 values); count them as dropped if they can't go."""
        if self._send(wire.encode_records(self._header(wire.KIND_RECORDS), records)):
            self.records_sent += count
        else:
            self.dropped += count

    def send_control(self, body: dict[str, Any]) -> bool:
        """Send one control message; False when it could not be queued."""
        return self._send(wire.encode_control(self._header(wire.KIND_CONTROL), body))

    def wait_for_room(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds until one more message can be queued (a
        sidecar that is behind frees the queue as it reads). False at once without a
        connected sidecar, or when it took nothing in time."""
        if os.getpid() != self._pid or not self.connected:
            return False
        return bool(self._socket.poll(max(0, int(timeout_s * 1000)) + 1, zmq.POLLOUT))

    def _queue_waiting(self, body: dict[str, Any], timeout_s: float, limit: float) -> bool:
        """Queue a request's message: a full queue is waited on while the sidecar takes
        messages, ``timeout_s`` at most for each, never past ``limit`` (monotonic s)."""
        self.wait_for_room(min(timeout_s, limit - time.monotonic()))
        return self.send_control(body)

    def request(
        self,
        body: dict[str, Any],
        timeout_s: float,
        connect_timeout_s: float = 0.0,
        payload: bytes = b"",
    ) -> dict[str, Any] | None:
        """Send a control message that asks for a reply and wait for it. ``payload`` (any
        size) goes first as ``part`` messages; the sidecar hands it to the request.

        Waits at most ``timeout_s`` seconds without news: a progress reply from the sidecar
        (it is working on this request, or still writing for an earlier one of this run)
        restarts that wait, up to ``PROGRESS_LIMIT_S`` in all; so does room freed in a
        full send queue (a sidecar still reading a backlog). Without a connected sidecar
        (after waiting ``connect_timeout_s`` for one) it returns None at once: the training
        loop is never held up by an absent sidecar. Replies to earlier requests that arrive
        late are skipped. Returns None when no reply came; ``last_failure`` then says why.
        """
        started = time.monotonic()
        limit = started + PROGRESS_LIMIT_S
        if os.getpid() != self._pid:  # a forked child must not touch the parent's sockets
            return self._failed("a forked child cannot use its parent's connection")
        if not self.wait_connected(min(connect_timeout_s, timeout_s)):
            return self._failed(self.refused or "no sidecar is connected")
        for offset in range(0, len(payload), wire.PART_BYTES):
            chunk = base64.b64encode(payload[offset : offset + wire.PART_BYTES]).decode()
            if not self._queue_waiting({"type": wire.PART, "data": chunk}, timeout_s, limit):
                return self._failed(
                    f"part {offset // wire.PART_BYTES + 1} of "
                    f"{-(-len(payload) // wire.PART_BYTES)} could not be queued "
                    f"(the sidecar took no message within {timeout_s:g} s)"
                )
        request_id = f"{self.seq}-{os.getpid()}"
        if not self._queue_waiting({**body, "reply_to": request_id}, timeout_s, limit):
            return self._failed(
                "the request could not be queued (the sidecar took no message "
                f"within {timeout_s:g} s)"
            )
        deadline = time.monotonic() + timeout_s  # queued: the wait for the reply starts
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while (left_s := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left_s * 1000) + 1))
            if self._monitor in ready and not self.connected:
                return self._failed("the sidecar went away while we waited")
            if self._socket not in ready:
                continue
            try:
                reply = json.loads(self._socket.recv(zmq.NOBLOCK))
            except (zmq.ZMQError, ValueError):
                continue
            if not isinstance(reply, dict):
                continue
            if "progress" in reply:  # on this run's socket: news of this run's work
                deadline = min(time.monotonic() + timeout_s, limit)
            elif reply.get("reply_to") == request_id:
                return reply
        return self._failed(f"no answer and no progress within {timeout_s:g} s")

    def _failed(self, reason: str) -> dict[str, Any] | None:
        """No reply: ``reason`` becomes ``last_failure``; None, what ``request`` returns."""
        self.last_failure = reason
        return None

    def close(self) -> None:
        """Close the socket without waiting for unsent messages (LINGER 0)."""
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
