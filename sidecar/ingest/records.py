"""The sidecar's decoder of RECORDS bodies: numpy over many messages at once.

``markers.wire.decode_records`` is the reference, one message and one record at a time
in pure Python (~0.6 µs a record); this module gives the same records and the same
refusals for a whole read of messages with a fixed number of array operations, so the
cost per record is a few nanoseconds and the Python work is per message.
A test holds the two equal on random slot sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from markers import wire
from markers.wire import (
    P_BATCH,
    P_BATCHES,
    P_END,
    P_EPOCH,
    P_FLAGS,
    P_GPU,
    P_ITERATION,
    P_LAG,
    P_PEAK,
    P_PHASE,
    P_START,
)

SLOT_DTYPE = np.dtype("<i8")


@dataclass(frozen=True)
class Decoded:
    """The records of several RECORDS bodies: ``values`` (records × ``RECORD_WIDTH``
    int64, in message order; column-ordered, see ``_expand``), ``bounds[i]:bounds[i + 1]``
    the rows of body ``i``, and ``errors[i]`` the WireError that refused body ``i`` (its
    rows are then empty)."""

    values: np.ndarray
    bounds: np.ndarray
    errors: list[wire.WireError | None]

    def of(self, index: int) -> np.ndarray:
        """The records of body ``index`` (a view)."""
        return self.values[self.bounds[index] : self.bounds[index + 1]]


def _slot_errors(slots: np.ndarray, starts: np.ndarray) -> list[wire.WireError | None]:
    """Per body (whole slots, beginning at the slot indices ``starts``): the refusal
    ``decode_records`` would raise, or None."""
    kinds = slots[:, 0] & wire.TAG_MASK
    # A GPU slot must come right after a phase slot (after a context or GPU slot, or
    # nothing, it is malformed); a body that does not begin with a context slot is
    # refused first, so no check crosses from one body into the next.
    orphan = kinds == wire.TAG_GPU
    orphan[1:] &= kinds[:-1] >= wire.TAG_GPU
    # Masks are counted into int32 here and below: numpy's cumsum of a mask into its
    # default int64 takes a cast path ~13x slower, and a read's slots fit by far.
    orphans = np.concatenate(([0], np.cumsum(orphan, dtype=np.int32)))
    ends = np.append(starts[1:], len(kinds))[: len(starts)]
    errors: list[wire.WireError | None] = []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if start < end and kinds[start] != wire.TAG_CONTEXT:
            errors.append(wire.WireError("malformed", "records do not begin with a context slot"))
        elif orphans[end] != orphans[start]:
            errors.append(wire.WireError("malformed", "a GPU slot that follows no phase slot"))
        else:
            errors.append(None)
    return errors


def _expand(slots: np.ndarray) -> np.ndarray:
    """The records of well-formed slots (every body begins with a context slot), in
    column order (Fortran): every consumer reads the records column by column, and a
    column of a row-ordered table is a pass over all of its 88-byte rows."""
    tags = slots[:, 0]
    kinds = tags & wire.TAG_MASK
    is_context = kinds == wire.TAG_CONTEXT
    is_gpu = kinds == wire.TAG_GPU
    phase_at = np.flatnonzero(~(is_context | is_gpu))
    # Each phase slot's context: the last context slot at or before it.
    context_at = np.flatnonzero(is_context)[np.cumsum(is_context, dtype=np.int32)[phase_at] - 1]
    out = np.empty((len(phase_at), wire.RECORD_WIDTH), dtype=np.int64, order="F")
    context_tag, phase_tag = tags[context_at], tags[phase_at]
    np.bitwise_and(phase_tag, wire.TAG_MASK, out=out[:, P_PHASE])
    np.bitwise_and(context_tag >> 16, 0xFFFF, out=out[:, P_FLAGS])
    np.right_shift(context_tag, 32, out=out[:, P_EPOCH])
    out[:, P_ITERATION] = slots[context_at, 1]
    out[:, P_BATCH] = slots[context_at, 2]
    out[:, P_START] = slots[phase_at, 1]
    out[:, P_END] = slots[phase_at, 2]
    out[:, P_GPU] = -1
    out[:, P_PEAK] = -1
    np.right_shift(phase_tag, wire.BATCHES_SHIFT, out=out[:, P_BATCHES])
    out[:, P_LAG] = 0
    following = phase_at + 1
    has_gpu = following < len(slots)
    has_gpu[has_gpu] = is_gpu[following[has_gpu]]
    if has_gpu.any():
        gpu_at = following[has_gpu]
        gpu_tag = tags[gpu_at]
        out[has_gpu, P_FLAGS] |= (gpu_tag >> 16) & 0xFFFF
        out[has_gpu, P_GPU] = slots[gpu_at, 1]
        out[has_gpu, P_PEAK] = slots[gpu_at, 2]
        out[has_gpu, P_LAG] = (gpu_tag >> 32) * 1000
    return out


def _truncation(body: bytes | memoryview) -> wire.WireError | None:
    if len(body) % wire.SLOT_BYTES:
        return wire.WireError(
            "truncated", f"body of {len(body)} bytes is not whole {wire.SLOT_BYTES}-byte slots"
        )
    return None


def decode_bodies(bodies: list[bytes | memoryview]) -> Decoded:
    """Decode the RECORDS ``bodies`` (each a message's bytes after its header) together.

    A body that ``wire.decode_records`` would refuse is refused here with the same kind
    (``truncated``: not whole slots; ``malformed``: no leading context slot, or a GPU
    slot after no phase slot) and contributes no records; the others are decoded.
    """
    errors = [_truncation(body) for body in bodies]
    if not any(errors):
        slots = np.frombuffer(b"".join(bodies), dtype=SLOT_DTYPE).reshape(-1, wire.SLOT_WIDTH)
        sizes = np.fromiter(map(len, bodies), dtype=np.int64, count=len(bodies))
        starts = (np.cumsum(sizes) - sizes) // wire.SLOT_BYTES
        errors = _slot_errors(slots, starts)
        if not any(errors):
            is_phase = (slots[:, 0] & wire.TAG_MASK) < wire.TAG_GPU
            before = np.concatenate(([0], np.cumsum(is_phase, dtype=np.int32)))
            bounds = np.append(before[starts], before[-1])
            return Decoded(_expand(slots.astype(np.int64, copy=False)), bounds, errors)
    kept = [i for i, error in enumerate(errors) if error is None]
    good = decode_bodies([bodies[i] for i in kept])  # refuses what is left to refuse
    counts = np.zeros(len(bodies), dtype=np.int64)
    counts[kept] = np.diff(good.bounds)
    for i, error in zip(kept, good.errors, strict=True):
        errors[i] = error
    return Decoded(good.values, np.concatenate(([0], np.cumsum(counts))), errors)
