"""RECORDS messages decoded with numpy: the slots of a frame are read in place
(``np.frombuffer`` on the wire's slot dtype, no copy) and expanded into one row of
``wire.RECORD_FIELDS`` per phase with whole-array operations, so the Python work is per
message, not per record. The wire format itself stays in ``markers.wire`` (standard
library only: the training process never imports numpy for us).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from markers import wire
from markers.wire import (
    P_BATCH,
    P_END,
    P_EPOCH,
    P_FLAGS,
    P_GPU,
    P_ITERATION,
    P_PEAK,
    P_PHASE,
    P_START,
    WireError,
)

SLOT_DTYPE = np.dtype([(name, "<i8") for name in wire.SLOT_FIELDS])
KNOWN_FLAGS = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION | wire.FLAG_GPU_DROPPED


def empty() -> np.ndarray:
    """No records: shape (0, RECORD_WIDTH)."""
    return np.empty((0, wire.RECORD_WIDTH), dtype=np.int64)


def decode(frame: Any) -> np.ndarray:
    """The records of a RECORDS ``frame`` (header already checked): an int64 array of shape
    (phases, ``wire.RECORD_WIDTH``), columns at the ``wire.P_*`` offsets. A phase slot with
    bits above its id gets flags -1 (rejected by ``valid``); gpu_ns and peak_bytes are -1
    unless a GPU slot follows the phase slot.

    Raises WireError("truncated") when the body is not whole slots, "malformed" when it
    does not begin with a context slot or a GPU slot follows no phase slot.
    """
    body = len(frame) - wire.HEADER.size
    if body % wire.SLOT_BYTES:
        raise WireError("truncated", f"body of {body} bytes is not whole {wire.SLOT_BYTES}-byte "
                        "slots")
    slots = np.frombuffer(frame, dtype=SLOT_DTYPE, offset=wire.HEADER.size)
    if not len(slots):
        return empty()
    tag, a, b = slots["tag"], slots["a"], slots["b"]
    kind = tag & wire.TAG_MASK
    is_context = kind == wire.TAG_CONTEXT
    if not is_context[0]:
        raise WireError("malformed", "records do not begin with a context slot")
    is_gpu = kind == wire.TAG_GPU
    is_phase = ~(is_context | is_gpu)
    gpu = np.flatnonzero(is_gpu)
    if len(gpu) and not is_phase[gpu - 1].all():  # slot 0 is a context: gpu - 1 >= 0
        raise WireError("malformed", "a GPU slot that follows no phase slot")
    phase = np.flatnonzero(is_phase)
    # The context of every slot: the latest context slot at or before it.
    context = np.maximum.accumulate(np.where(is_context, np.arange(len(slots)), 0))[phase]
    context_tag = tag[context]
    flags = (context_tag >> 16) & 0xFFFF
    flags[(tag[phase] >> 16) != 0] = -1  # a phase slot is its id alone: the record is bad
    out = np.empty((len(phase), wire.RECORD_WIDTH), dtype=np.int64)
    out[:, P_PHASE] = kind[phase]
    out[:, P_EPOCH] = context_tag >> 32
    out[:, P_ITERATION] = a[context]
    out[:, P_BATCH] = b[context]
    out[:, P_START] = a[phase]
    out[:, P_END] = b[phase]
    out[:, P_GPU] = -1
    out[:, P_PEAK] = -1
    if len(gpu):
        owner = np.searchsorted(phase, gpu - 1)  # the record of the phase slot before
        flags[owner] |= (tag[gpu] >> 16) & 0xFFFF
        out[owner, P_GPU] = a[gpu]
        out[owner, P_PEAK] = b[gpu]
    out[:, P_FLAGS] = flags
    return out


def valid(records: np.ndarray, custom_ids: set[int]) -> np.ndarray:
    """Boolean mask of the good records: a canonical phase id (not Training, which the
    sidecar derives) or a declared custom one, known flags only, end not before start."""
    phase = records[:, P_PHASE]
    known = (phase > 0) & (phase < wire.FIRST_CUSTOM_ID)
    if custom_ids:
        known |= np.isin(phase, np.fromiter(custom_ids, dtype=np.int64, count=len(custom_ids)))
    return known & ((records[:, P_FLAGS] & ~KNOWN_FLAGS) == 0) & (
        records[:, P_END] >= records[:, P_START])
