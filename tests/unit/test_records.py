"""The sidecar's numpy decoder and validation against a per-record reading of the wire
format written out plainly here (the oracle), on random slot streams: the same records,
or the same error kind."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from markers import wire
from sidecar.ingest import records

HEADER = wire.pack_header(wire.KIND_RECORDS, 0, 0, 0, 0, b"x" * 16)


def oracle(slots: list[int]) -> list[list[int]] | str:
    """One record per phase slot, read slot by slot; the WireError kind otherwise."""
    if slots and slots[0] & wire.TAG_MASK != wire.TAG_CONTEXT:
        return "malformed"
    out: list[list[int]] = []
    context = (0, 0, 0, 0)
    last: list[int] | None = None
    for i in range(0, len(slots), 3):
        tag, a, b = slots[i:i + 3]
        kind = tag & wire.TAG_MASK
        if kind == wire.TAG_CONTEXT:
            context, last = ((tag >> 16) & 0xFFFF, tag >> 32, a, b), None
        elif kind == wire.TAG_GPU:
            if last is None:
                return "malformed"
            last[1] |= (tag >> 16) & 0xFFFF
            last[7], last[8], last = a, b, None
        else:
            flags, epoch, iteration, batch = context
            last = [kind, -1 if tag >> 16 else flags, epoch, iteration, batch, a, b, -1, -1]
            out.append(last)
    return out


small = st.integers(-3, 10**6)
slot = st.one_of(
    st.tuples(st.builds(lambda f, e: wire.TAG_CONTEXT | f << 16 | e << 32,
                        st.integers(0, 7), st.integers(0, 5)), small, small),
    st.tuples(st.builds(lambda f: wire.TAG_GPU | f << 16, st.integers(0, 7)), small, small),
    st.tuples(st.one_of(st.integers(1, 12), st.integers(64, 70),
                        st.builds(lambda p: p | 1 << 20, st.integers(1, 12))), small, small),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(slot, max_size=40), st.booleans())
def test_decode_matches_the_per_slot_reading(slots: list[tuple[int, int, int]],
                                             lead: bool) -> None:
    flat = [*wire.context_slot(1, 2, 3, 4)] * lead + [v for s in slots for v in s]
    expected = oracle(flat)
    try:
        got = records.decode(wire.encode_records(HEADER, array("q", flat))).tolist()
    except wire.WireError as exc:
        got = exc.kind
    assert got == expected


def test_a_body_of_partial_slots_is_truncated() -> None:
    frame = wire.encode_records(HEADER, array("q", [*wire.context_slot(0, 0, 0, 0), 4, 1]))
    try:
        records.decode(frame)
    except wire.WireError as exc:
        assert exc.kind == "truncated"
    else:
        raise AssertionError("no error")


def test_valid_masks_unknown_phases_flags_and_reversed_times() -> None:
    rows = np.array([
        [wire.FORWARD, wire.FLAG_IN_ITERATION, 0, 0, 0, 10, 20, -1, -1],  # good
        [0, 0, 0, 0, 0, 10, 20, -1, -1],  # Training comes from the sessions, not the wire
        [64, 0, 0, 0, 0, 10, 20, -1, -1],  # a custom id declared below
        [65, 0, 0, 0, 0, 10, 20, -1, -1],  # a custom id never declared
        [wire.FORWARD, -1, 0, 0, 0, 10, 20, -1, -1],  # a phase slot with extra bits
        [wire.FORWARD, 8, 0, 0, 0, 10, 20, -1, -1],  # an unknown flag
        [wire.FORWARD, 0, 0, 0, 0, 20, 10, -1, -1],  # ends before it starts
    ], dtype=np.int64)
    assert records.valid(rows, {64}).tolist() == [True, False, True, False, False, False,
                                                 False]
    assert records.valid(rows, set()).tolist()[2] is False
