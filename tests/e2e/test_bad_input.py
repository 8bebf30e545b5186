"""Bad input on the socket (docs/contract.md, Faults and bad input): malformed, truncated, unknown
version, oversized (over the control cap, and over the socket's cap, which makes ZeroMQ
drop the connection), records of runs never started, out of order. Each is rejected,
counted per kind and logged once per kind, and every good record around them is kept.

Where the frames go: ``test_every_kind_through_a_real_socket`` sends them through a real
socket to a real sidecar process; the hypothesis properties and the 10⁵-frame fuzz feed
the sidecar's own decode (``Receiver.decode``) and dispatch (``Messages.handle_safely``)
in this process (a real Server bound to a real socket), which is what a frame meets after
``recv``, for speed; ``test_fuzz_sample_through_a_real_socket`` sends a sample of the same
fuzz frames through the socket to a sidecar process.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from markers import wire
from sidecar.daemon.server import Config, Server
from tests.support.frames import BAD_KINDS, Client, bad_frame, noise
from tests.support.helpers import wait_for


def _dealer(endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(endpoint)
    return socket


def _request(socket: zmq.Socket, frame: bytes) -> dict:
    """Send ``frame`` and return its answer (progress replies before it are skipped)."""
    socket.send(frame)
    while True:
        assert socket.poll(10_000), "no reply"
        reply = json.loads(socket.recv())
        if "progress" not in reply:
            return reply


def test_every_kind_through_a_real_socket(serve, short_tmp: Path) -> None:
    sidecar = serve()
    rng = random.Random(5)
    good = Client()
    socket = _dealer(sidecar.endpoint)
    assert _request(socket, good.hello("good"))["ok"]
    expected: Counter[str] = Counter()
    for round_ in range(3):
        for kind in BAD_KINDS:
            socket.send(good.records(10))
            socket.send(bad_frame(rng, good, kind))
            expected[kind] += 1
        socket.send_multipart([good.records(10), b"extra frame"])  # two frames: malformed
        expected["malformed"] += 1
        if round_ == 1:  # over the socket's cap: ZeroMQ drops this connection
            socket.send(good.control({"type": "x", "pad": "y" * wire.MAX_MESSAGE_BYTES}))
            expected["connection_dropped"] += 1
            wait_for(
                lambda: sidecar.status()["rejected_by_kind"].get("connection_dropped"),
                20,
                "the dropped connection to be counted",
            )
    rogue = _dealer(sidecar.endpoint)  # another client: its drop spares the good one's
    rogue.send(b"\0" * (wire.MAX_MESSAGE_BYTES + 1))
    expected["connection_dropped"] += 1
    socket.send(good.records(10))
    # records of runs never started wait PENDING_S (5 s) for a hello, then are rejected
    view = wait_for(
        lambda: (
            (v := sidecar.status())["rejected_by_kind"].get("unknown_run", 0) >= 3
            and v["rejected_by_kind"].get("connection_dropped", 0) >= 2
            and v
        ),
        30,
        "the held records and the second drop to be rejected",
    )
    assert _request(
        socket, good.control({"type": "finish", "status": "completed", "reply_to": "f"})
    )["ok"]
    by_kind = view["rejected_by_kind"]
    records_kinds = {"unknown_run", "bad_record"}  # counted per record, not per message
    assert {k: v for k, v in by_kind.items() if k not in records_kinds} == {
        k: v for k, v in expected.items() if k not in records_kinds
    }
    assert by_kind["bad_record"] == expected["bad_record"]  # one bad record each
    assert by_kind["unknown_run"] >= expected["unknown_run"]
    phases = short_tmp / "root" / "good" / "training" / "split-0" / "logs" / "phases.tsv"
    forward_rows = [
        line for line in phases.read_text().splitlines() if line.startswith("Forward\t")
    ]
    assert len(forward_rows) == 10 * (3 * len(BAD_KINDS) + 1)  # every good record kept
    log = sidecar.log.read_text()
    for kind in by_kind:
        assert log.count(f"rejected {kind}:") == 1, kind
    assert sidecar.process.poll() is None
    socket.close()
    rogue.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Server in this process, bound to a real socket, fed frames directly."""
    server = Server(Config("tcp://127.0.0.1:*", root=tmp_path_factory.mktemp("root")))
    yield server
    server.receiver.close()


def _feed(server: Server, frame: bytes | list[bytes]) -> None:
    message = server.receiver.decode(
        [b"id", frame] if isinstance(frame, bytes) else [b"id", *frame]
    )
    if message is not None:
        server.messages.handle_safely(message)


def _good_run(server: Server, name: str) -> Client:
    good = Client()
    # A folder of its own: hypothesis replays an example, and a second live writer of
    # the same split would be refused (one writer per split).
    _feed(server, good.hello(f"{name}-{good.run_id.hex()[:8]}"))
    _feed(server, good.control({"type": "phase", "id": 64, "name": "custom"}))  # seq 1
    return good


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_any_bytes_are_decoded_or_rejected_once(server: Server, data: bytes) -> None:
    before = sum(server.registry.rejected.values())
    message = server.receiver.decode([b"id", data])
    after = sum(server.registry.rejected.values())
    assert (message is None) == (after == before + 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from((*BAD_KINDS, "good")), max_size=30), st.integers(0, 2**32))
def test_good_records_survive_any_mix_of_bad_frames(
    server: Server, plan: list[str], seed: int
) -> None:
    rng = random.Random(seed)
    good = _good_run(server, f"mix-{seed}-{len(plan)}")
    rejected_before = Counter(server.registry.rejected)
    sent = 0
    for step in plan:
        if step == "good":
            count = rng.randrange(1, 20)
            _feed(server, good.records(count))
            sent += count
        else:
            _feed(server, bad_frame(rng, good, step))
    stream = server.registry.streams[good.run_id]
    agg = stream.split.rank(0)
    # The frames' Forward records lie outside any iteration: each is kept, flagged.
    series = agg.series.get(wire.FORWARD)
    assert (len(series.flagged) if series is not None else 0) == sent
    grew = Counter(server.registry.rejected) - rejected_before
    for kind in set(plan) - {"good", "unknown_run"}:
        assert grew[kind] >= 1, kind
    assert "internal_error" not in server.registry.rejected


def test_fuzz_a_hundred_thousand_frames(server: Server) -> None:
    rng = random.Random(1234)
    good = _good_run(server, "fuzz")
    sent = 0
    started = time.monotonic()
    for i in range(100_000):
        if i % 10 == 0:
            _feed(server, good.records(3))
            sent += 3
        elif i % 10 == 5:
            _feed(server, bad_frame(rng, good, rng.choice(BAD_KINDS[:-1])))
        else:
            _feed(server, noise(rng))
        if i % 1000 == 0:
            server.registry.expire_pending(float(i))
    print(f"10^5 frames in {time.monotonic() - started:.1f} s")
    agg = server.registry.streams[good.run_id].split.rank(0)
    assert len(agg.series[wire.FORWARD].flagged) == sent  # outside iterations: flagged
    assert "internal_error" not in server.registry.rejected
    assert set(server.registry.rejected) >= {
        "malformed",
        "truncated",
        "unknown_version",
        "out_of_order",
        "bad_record",
        "unknown_run",
    }


def test_fuzz_sample_through_a_real_socket(serve, short_tmp: Path) -> None:
    sidecar = serve()
    rng = random.Random(99)
    good = Client()
    socket = _dealer(sidecar.endpoint)
    assert _request(socket, good.hello("sample"))["ok"]
    sent = 0
    for i in range(3000):
        if i % 10 == 0:
            socket.send(good.records(3))
            sent += 3
        else:
            socket.send(noise(rng))
    assert _request(
        socket, good.control({"type": "finish", "status": "completed", "reply_to": "f"})
    )["ok"]
    view = sidecar.status()
    run = next(r for r in view["runs"] if r["out_dir"].endswith("/sample"))
    assert run["records"] == sent and run["status"] == "completed"
    assert view["rejected"] > 0 and "internal_error" not in view["rejected_by_kind"]
    assert sidecar.process.poll() is None
    socket.close()
