"""Frames for the bad-input tests: a well-behaved client built on ``markers.wire``, and a
generator of bad frames (malformed, truncated, unknown version, out of order, records of
runs never started, bad records, unknown controls).
"""

from __future__ import annotations

import json
import os
import random
import struct
from array import array
from typing import Any

from markers import wire


def records(count: int, epoch: int = 0, first_batch: int = 0) -> array:
    """The slots of ``count`` standalone Forward records (one measurement each) after the
    context slot every message begins with."""
    values = array("q", wire.context_slot(0, epoch, -1, first_batch))
    for i in range(count):
        start = 1_000_000 + i * 1000
        values.extend((wire.FORWARD, start, start + 500))
    return values


class Client:
    """Builds the frames of one run as the markers would (sequence numbers, counters)."""

    def __init__(self, run_id: bytes | None = None) -> None:
        self.run_id = run_id or os.urandom(16)
        self.seq = 0
        self.sent = 0

    def _header(self, kind: int) -> bytes:
        header = wire.pack_header(kind, 0, self.seq, self.sent, 0, self.run_id)
        self.seq += 1
        return header

    def hello(self, out_dir: str, **extra: Any) -> bytes:
        """A hello asking for a reply (``reply_to`` "h")."""
        body = {
            "type": "hello",
            "out_dir": out_dir,
            "cwd": "/",
            "split": 0,
            "warmup_iterations": 0,
            "num_measurements": 1_000_000,
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "start_ns": 0,
            "reply_to": "h",
            **extra,
        }
        return wire.encode_control(self._header(wire.KIND_CONTROL), body)

    def control(self, body: dict[str, Any]) -> bytes:
        """A control frame."""
        return wire.encode_control(self._header(wire.KIND_CONTROL), body)

    def records(self, count: int) -> bytes:
        """A records frame of ``count`` good records."""
        frame = wire.encode_records(self._header(wire.KIND_RECORDS), records(count))
        self.sent += count
        return frame


RUN_ID_SLICE = slice(struct.calcsize("<4sBBHIQQ"), wire.HEADER.size)  # in a header

# Kinds a generated bad frame is rejected as, per generator below.
BAD_KINDS = (
    "malformed",
    "truncated",
    "unknown_version",
    "unknown_run",
    "out_of_order",
    "bad_record",
    "unknown_control",
    "oversized",
)


def bad_frame(rng: random.Random, good: Client, kind: str) -> bytes:
    """One frame that the sidecar must reject as ``kind``; it never harms ``good``'s run.

    ``out_of_order``, ``bad_record``, ``unknown_control`` and ``oversized`` frames carry
    ``good``'s run id (``out_of_order`` repeats sequence number 0, so ``good`` must have
    sent a message after its hello); the others carry random run ids.
    """
    stranger = Client()
    if kind == "malformed":
        choice = rng.randrange(4)
        if choice == 0:  # bad magic
            return b"XXXX" + rng.randbytes(rng.randrange(wire.HEADER.size, 200))
        if choice == 1:  # unknown message kind
            header = wire.HEADER.pack(
                wire.MAGIC, wire.VERSION, rng.randrange(3, 256), 0, 0, 0, 0, stranger.run_id
            )
            return header + rng.randbytes(rng.randrange(50))
        if choice == 2:  # control body that is not JSON
            return stranger._header(wire.KIND_CONTROL) + b"\xff{" + rng.randbytes(20)
        return (
            stranger._header(wire.KIND_CONTROL)
            + json.dumps(  # JSON without a type
                rng.choice([[1, 2], {"kind": "x"}, "text", {"type": 3}])
            ).encode()
        )
    if kind == "truncated":
        if rng.random() < 0.5:
            return rng.randbytes(rng.randrange(wire.HEADER.size))
        frame = stranger.records(rng.randrange(1, 5))
        return frame[: len(frame) - rng.randrange(1, wire.SLOT_BYTES)]
    if kind == "unknown_version":
        version = rng.choice([v for v in (0, 1, 2, 3, 255) if v != wire.VERSION])
        header = wire.HEADER.pack(
            wire.MAGIC, version, wire.KIND_RECORDS, 0, 0, 0, 0, stranger.run_id
        )
        return header + records(1).tobytes()
    if kind == "unknown_run":
        return stranger.records(rng.randrange(1, 4))
    if kind == "out_of_order":
        header = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, good.run_id)  # seq 0 again
        return wire.encode_records(header, records(1))
    if kind == "bad_record":
        values = records(1)
        # an undeclared phase id, or bits above a phase slot's 16-bit id
        values[wire.SLOT_WIDTH] = rng.choice([5000, -3, wire.MAX_PHASE_ID + 7])
        frame = wire.encode_records(good._header(wire.KIND_RECORDS), values)
        good.sent += 1
        return frame
    if kind == "unknown_control":
        return good.control({"type": rng.choice(["nonsense", "HELLO", "", "checkpoint2"])})
    if kind == "oversized":  # a control body over MAX_CONTROL_BYTES, under the socket cap
        return good.control({"type": "phase", "pad": "x" * (wire.MAX_CONTROL_BYTES + 10)})
    raise ValueError(kind)


def noise(rng: random.Random) -> bytes:
    """Arbitrary bytes, or a good frame of a stranger with random bytes flipped."""
    if rng.random() < 0.3:
        return rng.randbytes(rng.randrange(0, 300))
    stranger = Client()
    frame = bytearray(
        stranger.records(rng.randrange(0, 4))
        if rng.random() < 0.5
        else stranger.control(
            {
                "type": rng.choice(["phase", "gpu", "finish", "checkpoint", "batch_size"]),
                "id": rng.randrange(-5, 70000),
                "name": "n",
                "status": "completed",
                "value": rng.randrange(-2, 5),
            }
        )
    )
    for _ in range(rng.randrange(1, 4)):
        frame[rng.randrange(len(frame))] = rng.randrange(256)
    if frame[RUN_ID_SLICE] == bytes(16):  # never the status client's id: it gets replies
        frame[RUN_ID_SLICE.start] = 1
    return bytes(frame)
