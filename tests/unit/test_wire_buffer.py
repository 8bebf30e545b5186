"""The wire slots and the markers' buffer, through a real ZeroMQ socket pair.

GPU slots are exercised with the real GpuTimer over the fake CUDA backend: pending
results hold the queue in order, the pool running dry is marked, finish drains.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from markers import wire
from markers.buffer import FLUSH_RECORDS, RecordBuffer
from markers.cuda import TorchCudaBackend
from markers.gpu import GpuTimer
from markers.transport import Sender
from tests.support.fake_cuda import FakeBackend, FakeCuda, fake_torch

ROOT = Path(__file__).resolve().parents[2]
P = {name: i for i, name in enumerate(wire.RECORD_FIELDS)}
HELLO = {"type": "hello", "accumulation_steps": 1}


@pytest.fixture
def socket_pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket, Sender]]:
    """A ROUTER (the sidecar's side) and a Sender connected to it."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/s.sock"
    router.bind(endpoint)
    sender = Sender(endpoint, b"r" * 16, 0)
    yield router, sender
    sender.close()
    router.close(linger=0)


def received(router: zmq.Socket) -> list[array]:
    """Every RECORDS message waiting at ``router``, decoded (controls skipped)."""
    out = []
    while router.poll(500):
        _, frame = router.recv_multipart()
        if wire.decode_header(frame).kind == wire.KIND_RECORDS:
            out.append(wire.decode_records(frame))
    return out


def rows(values: array) -> list[tuple[int, ...]]:
    return [
        tuple(values[i : i + wire.RECORD_WIDTH]) for i in range(0, len(values), wire.RECORD_WIDTH)
    ]


def test_slots_expand_to_records_with_their_context() -> None:
    slots = array(
        "q",
        [
            *wire.context_slot(wire.FLAG_IN_ITERATION, 3, 7, 40),
            wire.FORWARD,
            100,
            150,
            wire.gpu_tag(25_000),
            30,
            4096,
            wire.BACKWARD,
            150,
            300,
            wire.TRAINING_LOOP | 3 << wire.BATCHES_SHIFT,
            90,
            310,
            *wire.context_slot(0, 3, -1, 41),
            wire.EPOCH,
            0,
            400,
        ],
    )
    header = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, b"x" * 16)
    records = rows(wire.decode_records(wire.encode_records(header, slots)))
    assert [r[: wire.P_PEAK + 1] for r in records] == [
        (wire.FORWARD, wire.FLAG_IN_ITERATION, 3, 7, 40, 100, 150, 30, 4096),
        (wire.BACKWARD, wire.FLAG_IN_ITERATION, 3, 7, 40, 150, 300, -1, -1),
        (wire.TRAINING_LOOP, wire.FLAG_IN_ITERATION, 3, 7, 40, 90, 310, -1, -1),
        (wire.EPOCH, 0, 3, -1, 41, 0, 400, -1, -1),
    ]
    # The loop slot's batch count rides above its id; other records hold 0.
    assert [r[wire.P_BATCHES] for r in records] == [0, 0, 3, 0]
    # The GPU slot's lag (µs on the wire) is decoded in ns.
    assert [r[wire.P_LAG] for r in records] == [25_000, 0, 0, 0]


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (array("q", [wire.FORWARD, 1, 2]), "malformed"),  # no leading context
        (array("q", [*wire.context_slot(0, 0, 0, 0), wire.TAG_GPU, 1, 2]), "malformed"),
        (array("q", [*wire.context_slot(0, 0, 0, 0), wire.FORWARD, 1]), "truncated"),
    ],
)
def test_bad_slot_streams_are_rejected_by_kind(body: array, kind: str) -> None:
    header = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, b"x" * 16)
    with pytest.raises(wire.WireError) as error:
        wire.decode_records(wire.encode_records(header, body))
    assert error.value.kind == kind


def test_buffer_sends_in_batches_and_every_message_starts_with_its_context(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    router, sender = socket_pair
    buffer = RecordBuffer(sender, HELLO, 0)
    buffer.deadline_ns = 1 << 62  # only the size triggers flushes here
    total = FLUSH_RECORDS * 2 + 10
    for i in range(total):
        if i % 5 == 0:
            buffer.set_context(wire.FLAG_IN_ITERATION, 0, i // 5, i)
        buffer.record(wire.FORWARD, i, i + 1)
    messages_before_flush = received(router)
    assert len(messages_before_flush) == 2  # two full batches went by size alone
    buffer.flush()
    records = [r for m in messages_before_flush + received(router) for r in rows(m)]
    assert [r[P["start_ns"]] for r in records] == list(range(total))
    assert all(r[P["iteration"]] == r[P["start_ns"]] // 5 for r in records)
    assert sender.records_sent == total and sender.dropped == 0


def test_gpu_results_hold_the_queue_in_order_and_never_wait(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    router, sender = socket_pair
    backend = FakeBackend()
    buffer = RecordBuffer(sender, HELLO, 0)
    buffer.use_gpu(GpuTimer(backend, pool_size=2))
    for i in range(3):  # the third finds the pool dry
        slot = buffer.gpu.begin()
        backend.clock_ms += 1.5
        buffer.gpu.end(slot)
        buffer.record_gpu(wire.FORWARD, i * 10, i * 10 + 5, slot)
        buffer.record(wire.TRAINING_LOOP, i * 10, i * 10 + 9)
    buffer.flush()
    assert received(router) == []  # the first GPU result is pending: nothing may pass it
    backend.done = 3  # the GPU passed the anchor and the first phase's end event
    buffer.flush()
    first = [r for m in received(router) for r in rows(m)]
    assert [(r[P["phase"]], r[P["gpu_ns"]]) for r in first] == [
        (wire.FORWARD, 1_500_000),
        (wire.TRAINING_LOOP, -1),
    ]
    backend.finish_all()
    buffer.flush()
    rest = [r for m in received(router) for r in rows(m)]
    assert [r[P["phase"]] for r in rest] == [wire.FORWARD, wire.TRAINING_LOOP] * 2
    assert rest[0][P["gpu_ns"]] == 1_500_000
    assert rest[2][P["gpu_ns"]] == -1 and rest[2][P["flags"]] & wire.FLAG_GPU_DROPPED
    assert buffer.gpu.dropped == 1


def test_finish_drains_pending_gpu_results_within_its_bound(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    router, sender = socket_pair
    backend = FakeBackend()
    buffer = RecordBuffer(sender, HELLO, 0)
    buffer.use_gpu(GpuTimer(backend, pool_size=8))
    slot = buffer.gpu.begin()
    backend.clock_ms += 2.0
    buffer.gpu.end(slot)
    buffer.record_gpu(wire.BACKWARD, 0, 5, slot)
    backend.later = (3, 3)  # the GPU gets there while finish polls
    buffer.drain_gpu()
    buffer.flush()
    (record,) = [r for m in received(router) for r in rows(m)]
    assert record[P["gpu_ns"]] == 2_000_000


def _fill_send_queue(sender: Sender) -> None:
    """Send full records messages until one is dropped even after ZeroMQ's I/O threads
    had time to move what they could: the queue is full (the ROUTER reads nothing)."""
    assert sender.wait_connected(5.0)
    full = array(
        "q", [*wire.context_slot(0, 0, -1, 0)] + [wire.FORWARD, 1, 2] * (FLUSH_RECORDS - 1)
    )
    while True:
        dropped = sender.dropped
        sender.send_records(full, FLUSH_RECORDS - 1)
        if sender.dropped > dropped:
            time.sleep(0.2)
            sender.send_records(full, FLUSH_RECORDS - 1)
            if sender.dropped > dropped + FLUSH_RECORDS - 1:
                return


def test_a_request_behind_a_full_send_queue_waits_while_the_sidecar_reads(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    """A fast loop left the queue full: finish's request must wait for room while the
    sidecar works through the backlog, not fail at once; nothing queued is lost."""
    router, sender = socket_pair
    _fill_send_queue(sender)
    counted: list[int] = []

    def slow_sidecar() -> None:
        time.sleep(0.5)  # behind: reads nothing yet
        records = 0
        while router.poll(2000):
            identity, frame = router.recv_multipart()
            header = wire.decode_header(frame)
            if header.kind == wire.KIND_RECORDS:
                records += len(wire.decode_records(frame)) // wire.RECORD_WIDTH
                continue
            body = wire.decode_control(frame)
            if "reply_to" in body:
                counted.append(records)
                router.send_multipart(
                    [identity, json.dumps({"reply_to": body["reply_to"], "ok": True}).encode()]
                )
                return

    reader = threading.Thread(target=slow_sidecar)
    reader.start()
    reply = sender.request({"type": wire.STATUS}, timeout_s=5.0)
    reader.join(10)
    assert reply == {"reply_to": reply["reply_to"], "ok": True}, sender.last_failure
    assert counted == [sender.records_sent]


def test_a_request_behind_a_full_queue_of_a_stuck_sidecar_gives_up_in_its_time(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    _router, sender = socket_pair
    _fill_send_queue(sender)
    started = time.monotonic()
    assert sender.request({"type": wire.STATUS}, timeout_s=0.5) is None
    assert 0.4 < time.monotonic() - started < 5.0
    # ZeroMQ's bound is approximate (its I/O thread may still move a message into the
    # socket's kernel buffer): the request either finds no room or gets no answer.
    assert "could not be queued" in sender.last_failure or "no answer" in sender.last_failure


def test_a_forked_child_never_destroys_the_parents_cuda_events(
    socket_pair: tuple[zmq.Socket, Sender],
) -> None:
    """A DataLoader worker (forked) enters the child state and collects its garbage: the
    parent's events must stay alive there, for their destructors touch the device."""
    _, sender = socket_pair
    cuda = FakeCuda(["A"])
    buffer = RecordBuffer(sender, HELLO, 0)
    buffer.use_gpu(GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=8))
    for _ in range(3):  # events recorded in the parent: each holds a CUDA event now
        start_ns = time.perf_counter_ns()
        slot = buffer.gpu.begin()
        buffer.gpu.end(slot)
        buffer.record_gpu(wire.FORWARD, start_ns, time.perf_counter_ns(), slot)
    read_fd, write_fd = os.pipe()
    buffer.children.before_fork()  # what the Run's at-fork hooks do, then a worker's life
    pid = os.fork()
    if pid == 0:
        try:
            buffer.enter_child()
            buffer.record(wire.FORWARD, 1, 2)
            gc.collect()
            os.write(write_fd, str(cuda.destroyed_in_child).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 64) == b"0"
    os.close(read_fd)
    assert buffer.gpu is not None and buffer.children.collect() == 1


def test_the_parents_cuda_events_outlive_a_forked_child_that_exits_normally(tmp_path: Path) -> None:
    """A child that leaves through interpreter shutdown (modules cleared) frees nothing."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys\n"
        "from markers.buffer import RecordBuffer\n"
        "from markers.cuda import TorchCudaBackend\n"
        "from markers.gpu import GpuTimer\n"
        "from tests.support.fake_cuda import FakeCuda, fake_torch\n"
        "class Quiet:\n"
        "    dropped = 0\n"
        "    def send_control(self, body): return True\n"
        "    def send_records(self, values, count): return True\n"
        "cuda = FakeCuda(['A'])\n"
        "buffer = RecordBuffer(Quiet(), {}, 0)\n"
        "buffer.use_gpu(GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=4))\n"
        "buffer.gpu.end(buffer.gpu.begin())\n"
        "if os.fork() == 0:\n"
        "    buffer.enter_child()\n"
        "    sys.exit(0)\n"
        "os.wait()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert "initialization error" not in done.stderr
