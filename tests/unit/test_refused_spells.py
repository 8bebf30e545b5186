"""Refused tries on a socket that serves only holders of a secret, counted once a spell:
real ZeroMQ sockets (a CURVE server with its ZAP handler, plain clients that ZeroMQ keeps
retrying) and the connection watch on a test clock that the test moves.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import zmq

from markers import secret as shared_secret
from markers import wire
from sidecar.ingest.connections import JUDGE_AFTER_S, REFUSED_QUIET_S, ConnectionWatch
from sidecar.ingest.job_only import JobOnly


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Server:
    def __init__(self, context: zmq.Context, secret: str) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.guard = JobOnly(context, self.socket, secret)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.clock = Clock()
        self.counts: Counter[str] = Counter()
        self.messages = 0
        self.watch = ConnectionWatch(
            self.socket,
            lambda kind, detail: self.counts.update([kind]),
            lambda run_id: False,
            refuse_failed_handshakes=True,
            clock_s=self.clock,
        )

    def serve_until(self, done: Callable[[], bool], step_s: float = 0.05) -> None:
        """Read events and messages (each taken as a status request, a goodbye), the
        test clock moving ``step_s`` a round, until ``done`` (10 s of real time at most)."""
        deadline = time.monotonic() + 10
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.watch.poll()
            while self.socket.poll(0):
                frames = self.socket.recv_multipart(copy=False)
                fd = frames[-1].get(zmq.SRCFD)
                self.watch.message(fd, frames[0].bytes, bytes(16), wire.STATUS)
                self.messages += 1
            self.clock.now_s += step_s
            time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[Server]:
    context = zmq.Context()
    made = Server(context, shared_secret.new())
    yield made
    made.watch.close()
    made.socket.close(linger=0)
    made.guard.close()
    context.term()


def refused_client(
    context: zmq.Context, endpoint: str, secret: str | None
) -> tuple[zmq.Socket, Callable[[], int]]:
    """A DEALER without the secret (none, or another one), and the count of its tries so
    far (connections made, each refused)."""
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        shared_secret.client(client, secret)
    monitor = client.get_monitor_socket(zmq.EVENT_CONNECTED)
    tries = 0

    def tries_so_far() -> int:
        nonlocal tries
        while monitor.poll(0):
            monitor.recv_multipart()
            tries += 1
        return tries

    client.connect(endpoint)
    return client, tries_so_far


def test_a_client_retried_many_times_counts_once_and_a_later_spell_again(server: Server) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    plain, plain_tries = refused_client(context, server.endpoint, None)
    wrong, wrong_tries = refused_client(context, server.endpoint, shared_secret.new())
    # refused at the same time, the one with a wrong key many times over (ZeroMQ retries
    # it at once; a plain one waits for the handshake's timeout), with the clock moving
    # less than the quiet time between two reads: one spell
    server.serve_until(lambda: plain_tries() >= 1 and wrong_tries() >= 5)
    plain.close()
    wrong.close()
    closed_s = server.clock()
    server.serve_until(lambda: server.clock() > closed_s + 4 * JUDGE_AFTER_S)
    assert server.counts == Counter(unauthenticated=1)

    # a quiet time later, a new try begins a new spell
    server.clock.now_s += REFUSED_QUIET_S
    again, again_tries = refused_client(context, server.endpoint, shared_secret.new())
    server.serve_until(lambda: server.counts["unauthenticated"] >= 2)
    assert again_tries() >= 1
    again.close()
    assert server.counts == Counter(unauthenticated=2)


def test_a_holder_of_the_secret_that_speaks_is_not_counted(server: Server) -> None:
    client: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    shared_secret.client(client, server.guard.secret)
    client.connect(server.endpoint)
    client.send(b"hello")
    server.serve_until(lambda: server.messages >= 1)
    client.close()
    closed_s = server.clock()
    server.serve_until(lambda: server.clock() > closed_s + 4 * JUDGE_AFTER_S)
    assert server.counts == Counter()
