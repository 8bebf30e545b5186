"""The sidecar's numpy decoder gives what the reference decoder in ``markers.wire`` gives:
the same records, the same refusals, body by body, for many bodies decoded together."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from markers import wire
from sidecar.ingest.records import decode_bodies

HEADER = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, bytes(16))
INT64 = st.integers(-(2**63), 2**63 - 1)
TAGS = st.one_of(
    st.builds(
        lambda flags, epoch: wire.TAG_CONTEXT | flags << 16 | epoch << 32,
        st.integers(0, 0xFFFF),
        st.integers(-(2**31), 2**31 - 1),
    ),
    st.builds(
        lambda flags, lag: wire.TAG_GPU | flags << 16 | lag << 32,
        st.integers(0, 0xFFFF),
        st.integers(-(2**31), 2**31 - 1),
    ),
    st.builds(
        lambda phase, batches: phase | batches << wire.BATCHES_SHIFT,
        st.integers(0, wire.MAX_PHASE_ID),
        st.integers(-(2**47), 2**47 - 1),
    ),
    INT64,
)
SLOTS = st.lists(st.tuples(TAGS, INT64, INT64), max_size=12)


def body_of(slots: list[tuple[int, int, int]], context_first: bool) -> bytes:
    values = array("q", [v for slot in slots for v in slot])
    if context_first:
        values = array("q", wire.context_slot(1, 2, 3, 4)) + values
    return values.tobytes()


def reference(body: bytes) -> np.ndarray | str:
    try:
        values = wire.decode_records(HEADER + body)
    except wire.WireError as exc:
        return exc.kind
    return np.array(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(SLOTS, st.booleans(), st.integers(0, 30)), max_size=6))
def test_numpy_decoder_matches_the_reference(messages: list) -> None:
    bodies = []
    for slots, context_first, cut in messages:
        body = body_of(slots, context_first)
        bodies.append(body[: len(body) - cut] if cut < 8 else body)  # some truncated
    decoded = decode_bodies(bodies)
    for i, body in enumerate(bodies):
        expected = reference(body)
        error = decoded.errors[i]
        if isinstance(expected, str):
            assert error is not None and error.kind == expected
            assert len(decoded.of(i)) == 0
        else:
            assert error is None
            assert np.array_equal(decoded.of(i), expected)


def test_no_bodies_and_empty_bodies() -> None:
    assert len(decode_bodies([]).values) == 0
    decoded = decode_bodies([b"", body_of([(wire.FORWARD, 5, 9)], True), b""])
    assert decoded.errors == [None, None, None]
    assert [len(decoded.of(i)) for i in range(3)] == [0, 1, 0]
