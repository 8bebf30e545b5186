"""The wire format between the markers and the sidecar, defined once for both halves.

One ZeroMQ message is one frame: a fixed header, then a body whose kind the header names.

* ``KIND_RECORDS``: packed slots of three signed 64-bit little-endian integers
  ``(tag, a, b)``: a *context* slot (flags, epoch, iteration, batch) that the phase slots
  after it share, *phase* slots (id, start, end) and *GPU* slots (GPU time and peak of
  the phase slot just before). The markers pack the slots into a preallocated
  ``array('q')`` (one ``SLOT.pack_into`` per phase) and send its bytes;
  ``decode_records`` expands them into one ``RECORD_FIELDS`` record per phase for the
  sidecar. Every message begins with a context slot, so a lost message never shifts the
  context of the next.
* ``KIND_CONTROL``: a UTF-8 JSON object with a ``"type"`` key (``hello``, ``phase``,
  ``checkpoint``, ``finish``, ``state``, ``status``, ...). Rare, so readability wins.

Replies from the sidecar to a client are plain UTF-8 JSON frames (no header).

``docs/protocol.md`` describes every field; bump ``VERSION`` on any incompatible change.
Only the standard library is imported here: the markers must stay light to import.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

MAGIC = b"TLMR"
VERSION = 2  # 2: a loop slot's tag carries its batch count; flags INCOMPLETE and BEGIN

KIND_RECORDS = 1
KIND_CONTROL = 2

# magic, version, kind, rank, seq (message number per run, from 0),
# records_before (records this run put into earlier RECORDS messages),
# dropped (records this run could not send so far), run id (16 bytes).
HEADER = struct.Struct("<4sBBHIQQ16s")

# One phase measurement. Times from time.perf_counter_ns() (CLOCK_MONOTONIC on Linux,
# shared by every process of a host). gpu_ns and peak_bytes are -1 when not measured.
RECORD_FIELDS = (
    "phase",  # phase id: canonical ids below, custom ids declared by a "phase" control
    "flags",  # FLAG_* bits
    "epoch",  # epoch index within the split (continues across resumes)
    "iteration",  # optimization step (training) or validation batch index; -1 outside
    "batch",  # batches that went through the network in this process before the
    #           iteration began: the warmup gate
    "start_ns",
    "end_ns",
    "gpu_ns",
    "peak_bytes",
    "batches",  # loop records: batches the iteration really held (0 on other records)
    "gpu_lag_ns",  # the GPU reached the phase's start this long after start_ns (0: unknown
    #                or no GPU time); µs resolution on the wire
)
RECORD_WIDTH = len(RECORD_FIELDS)
# Offsets of the fields within one decoded record (the order of RECORD_FIELDS).
(
    P_PHASE,
    P_FLAGS,
    P_EPOCH,
    P_ITERATION,
    P_BATCH,
    P_START,
    P_END,
    P_GPU,
    P_PEAK,
    P_BATCHES,
    P_LAG,
) = range(RECORD_WIDTH)

FLAG_IN_ITERATION = 1  # part of a training or validation iteration (summed per iteration)
FLAG_VALIDATION = 2  # recorded during validation
FLAG_GPU_DROPPED = 4  # a GPU measurement was wanted but could not be made
FLAG_INCOMPLETE = 8  # cut short (exception, signal, left unfinished): kept, not measured
FLAG_BEGIN = 16  # an Epoch/Validation span began at start_ns (start == end); its end follows

# The packed slots on the wire: (tag, a, b). The low 16 bits of a tag say what a slot is.
SLOT_WIDTH = 3
SLOT_BYTES = 8 * SLOT_WIDTH
SLOT = struct.Struct("<3q")  # one slot: the markers' hot path packs a phase with it
TAG_CONTEXT = 0xFFFF  # tag | flags << 16 | epoch << 32; a = iteration; b = batch
# a = gpu_ns, b = peak_bytes of the phase slot before; tag | flags << 16 | lag_us << 32
TAG_GPU = 0xFFFE
TAG_MASK = 0xFFFF
# A phase slot's tag is its id; a loop slot's tag also carries its batch count above it.
BATCHES_SHIFT = 16
MAX_LAG_US = 2**31 - 1  # ~36 min: a larger lag is sent as this

# Standard phase ids. Ids are part of the protocol; never renumber.
TRAINING = 0
EPOCH = 1
TRAINING_LOOP = 2
TRAINING_DATA_LOADING = 3
FORWARD = 4
BACKWARD = 5
OPTIMIZATION = 6
VALIDATION = 7
VALIDATION_LOOP = 8
VALIDATION_DATA_LOADING = 9
EVALUATION = 10
METRICS = 11
FIRST_CUSTOM_ID = 64
MAX_PHASE_ID = 0xFFFD
MAX_NAME_CHARS = 200  # a custom phase name's length limit (its column label)
# Custom phases per run: their declarations ride in every hello, which must stay under
# MAX_CONTROL_BYTES (4000 names of 200 characters: about 0.85 MB).
MAX_CUSTOM_PHASES = 4000


@dataclass(frozen=True, kw_only=True)
class PhaseDef:
    """One standard phase, every name it goes by and what it is. The sidecar's files,
    summary, metrics and report take their phase lists from ``PHASES``; nothing else lists
    phases (docs/architecture.md, "How to add", says what a new row touches)."""

    phase: int  # wire id
    column: str  # label in computational.tsv (``<column> (s)``) and phases.tsv
    summary_label: str  # its line in summary.log's block
    indent: int  # that line's indent (the nesting of the phases)
    metric: str  # the ``phase`` label of the Prometheus series
    api: str | None = None  # the name a script passes to ``run.phase`` (None: markers stamp it)
    gpu: bool = False  # has GPU columns (GPU time and peak memory)
    network: bool = False  # the network's own work: its GPU seconds make the GPU throughput
    validation: bool = False  # part of validation (the summary's second table)
    loop: bool = False  # the loop record of an iteration (one per training or validation step)
    capped: bool = False  # stored after warmup, at most ``num_measurements`` rows per split
    # a part of the training step: compared across ranks (stragglers), its share of the
    # step reported (report, dashboard)
    step: bool = False
    before_sync: bool = False  # a step part before the gradient all-reduce (straggler rule)


# The standard phases in the order of computational.tsv's columns and the summary block.
PHASES: tuple[PhaseDef, ...] = (
    PhaseDef(
        phase=TRAINING, column="Training", summary_label="Training", indent=0, metric="training"
    ),
    PhaseDef(phase=EPOCH, column="Epoch", summary_label="Epoch", indent=1, metric="epoch"),
    PhaseDef(
        phase=TRAINING_LOOP,
        column="Training loop",
        summary_label="Iteration",
        indent=2,
        metric="train_loop",
        loop=True,
        capped=True,
    ),
    PhaseDef(
        phase=TRAINING_DATA_LOADING,
        column="Training data loading",
        summary_label="Data loading",
        indent=3,
        metric="train_loading",
        capped=True,
        step=True,
        before_sync=True,
    ),
    PhaseDef(
        phase=FORWARD,
        column="Forward",
        summary_label="Forward",
        indent=3,
        metric="forward",
        api="forward",
        gpu=True,
        network=True,
        capped=True,
        step=True,
        before_sync=True,
    ),
    PhaseDef(
        phase=BACKWARD,
        column="Backward",
        summary_label="Backward",
        indent=3,
        metric="backward",
        api="backward",
        gpu=True,
        network=True,
        capped=True,
        step=True,
    ),
    PhaseDef(
        phase=OPTIMIZATION,
        column="Optimization",
        summary_label="Optimization",
        indent=3,
        metric="optimization",
        api="optimization",
        gpu=True,
        network=True,
        capped=True,
        step=True,
    ),
    PhaseDef(
        phase=VALIDATION,
        column="Validation",
        summary_label="Validation",
        indent=0,
        metric="validation",
        validation=True,
    ),
    PhaseDef(
        phase=VALIDATION_LOOP,
        column="Validation loop",
        summary_label="Iteration",
        indent=1,
        metric="val_loop",
        validation=True,
        loop=True,
        capped=True,
    ),
    PhaseDef(
        phase=VALIDATION_DATA_LOADING,
        column="Validation data loading",
        summary_label="Data loading",
        indent=2,
        metric="val_loading",
        validation=True,
        capped=True,
    ),
    PhaseDef(
        phase=EVALUATION,
        column="Evaluation",
        summary_label="Evaluation",
        indent=2,
        metric="evaluation",
        api="evaluation",
        gpu=True,
        network=True,
        validation=True,
        capped=True,
    ),
    PhaseDef(
        phase=METRICS,
        column="Metrics computation",
        summary_label="Metrics computation",
        indent=2,
        metric="metrics",
        api="metrics",
        gpu=True,
        validation=True,
        capped=True,
    ),
)

# Derived views of PHASES.
PHASE_LABELS: dict[int, str] = {p.phase: p.column for p in PHASES}  # id -> column label
# Names a user passes to run.phase(...) for the standard phases the script stamps.
CANONICAL_PHASE_NAMES: dict[str, int] = {p.api: p.phase for p in PHASES if p.api is not None}
LOOP_IDS = frozenset(p.phase for p in PHASES if p.loop)
LOOP_ID: dict[bool, int] = {p.validation: p.phase for p in PHASES if p.loop}  # by validation
LAST_STANDARD_ID = max(p.phase for p in PHASES)
# The parts of a training step, in table order: every list of step parts derives from it.
STEP_PHASES: tuple[PhaseDef, ...] = tuple(p for p in PHASES if p.step)

# Column stems a custom name may not take, in lower case: each standard label and the
# "<label> GPU" stem of the GPU columns ("<name> (s)" would shadow a standard column).
_RESERVED_NAMES = frozenset(
    [p.column.casefold() for p in PHASES] + [f"{p.column} GPU".casefold() for p in PHASES if p.gpu]
)


def custom_phase_name(name: str) -> str:
    """``name`` as a custom phase's identity: tabs, newlines and carriage returns replaced
    by spaces (a column label must not break the TSV).

    Raises ValueError for an empty name, one over ``MAX_NAME_CHARS`` characters or one
    that equals a standard label in any case (``Forward``, ``epoch``, ``Training loop``,
    ``Forward GPU``, ...): it would shadow a standard column.
    """
    clean = name.replace("\t", " ").replace("\n", " ").replace("\r", " ")
    if not 0 < len(clean) <= MAX_NAME_CHARS:
        raise ValueError(f"a phase name needs 1-{MAX_NAME_CHARS} characters, got {len(clean)}")
    if clean.casefold() in _RESERVED_NAMES:
        raise ValueError(f"{clean!r} is a standard column's name")
    return clean


# Control message types (the "type" key of a CONTROL body). Markers -> sidecar:
HELLO = "hello"  # a run starts (or re-announces itself): its settings and identity
PHASE = "phase"  # declares a custom phase id and name
GPU = "gpu"  # the GPU the run's markers time on (uuid, name)
BATCH_SIZE = "batch_size"  # the batch size read from the batches, from an iteration on
PART = "part"  # one part of a payload too big for one message (base64 ``data``)
CHECKPOINT = "checkpoint"  # write every file and the resume state now (answered)
STATE = "state"  # send the split's state document (answered)
LOAD_STATE = "load_state"  # continue the split from a state the user kept (answered)
FINISH = "finish"  # the run ended; write everything (answered)
STATUS = "status"  # the status view (``sidecar status``; answered)
FINISH_JOB = "finish_job"  # end every run of a Slurm job (``sidecar finish --job``; answered)
LOADER = "loader"  # a loop's DataLoader settings (num_workers, pin_memory)
# The dtypes a hello's ``flops_dtype`` may name (the MFU estimate's peak is per dtype).
FLOPS_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
CONTROL_TYPES = (
    HELLO,
    PHASE,
    GPU,
    BATCH_SIZE,
    PART,
    CHECKPOINT,
    STATE,
    LOAD_STATE,
    FINISH,
    STATUS,
    FINISH_JOB,
    LOADER,
)

# Upper bound the sidecar enforces at the socket (ZMQ_MAXMSGSIZE).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The markers send their buffer once it holds this many slots (sooner by age), so a
# RECORDS message is at most FLUSH_MESSAGE_BYTES (~24 KiB); both ends size their queues,
# which ZeroMQ bounds in messages, from it. Only a GPU run whose CUDA events are still
# pending holds more back (up to the event pool) and sends it as one larger message.
FLUSH_SLOTS = 1024
FLUSH_MESSAGE_BYTES = HEADER.size + SLOT_BYTES * (FLUSH_SLOTS + 4)
MAX_CONTROL_BYTES = 1024 * 1024
MAX_REPLY_TO = 64  # a request id; echoed back in the reply
# Raw bytes per ``part`` message: base64 makes it 4/3 bigger, still under MAX_CONTROL_BYTES.
PART_BYTES = 512 * 1024


class WireError(ValueError):
    """A frame that does not follow this protocol; ``kind`` names the reason for counting."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class Header:
    """The decoded fixed header of one message."""

    kind: int
    rank: int
    seq: int
    records_before: int
    dropped: int
    run_id: bytes


def pack_header(
    kind: int, rank: int, seq: int, records_before: int, dropped: int, run_id: bytes
) -> bytes:
    """Header bytes for one message. ``run_id`` is 16 bytes; counters must fit their fields."""
    return HEADER.pack(
        MAGIC, VERSION, kind, rank, seq & 0xFFFFFFFF, records_before, dropped, run_id
    )


def context_slot(flags: int, epoch: int, iteration: int, batch: int) -> tuple[int, int, int]:
    """The context slot that the phase slots after it share (``epoch`` < 2**31)."""
    return (TAG_CONTEXT | flags << 16 | epoch << 32, iteration, batch)


def gpu_tag(lag_ns: int) -> int:
    """The tag of a measured GPU slot whose GPU start lags the phase's start by ``lag_ns``."""
    return TAG_GPU | min(max(lag_ns, 0) // 1000, MAX_LAG_US) << 32


def encode_records(header: bytes, slots: array) -> bytes:
    """A RECORDS message: ``header`` followed by the little-endian bytes of ``slots``."""
    if sys.byteorder != "little":  # the wire is little-endian; swap a copy on big-endian hosts
        slots = array("q", slots)
        slots.byteswap()
    return header + slots.tobytes()


def encode_control(header: bytes, body: dict[str, Any]) -> bytes:
    """A CONTROL message: ``header`` followed by ``body`` as compact UTF-8 JSON."""
    return header + json.dumps(body, separators=(",", ":")).encode()


def decode_header(frame: bytes | memoryview) -> Header:
    """Parse and check the header of ``frame`` (bytes, or a view of a receive buffer).

    Raises WireError with kind ``truncated``, ``malformed`` (bad magic or kind) or
    ``unknown_version``.
    """
    if len(frame) < HEADER.size:
        raise WireError("truncated", f"{len(frame)} bytes, header needs {HEADER.size}")
    magic, version, kind, rank, seq, records_before, dropped, run_id = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise WireError("malformed", f"bad magic {magic!r}")
    if version != VERSION:
        raise WireError("unknown_version", f"version {version}, this sidecar speaks {VERSION}")
    if kind not in (KIND_RECORDS, KIND_CONTROL):
        raise WireError("malformed", f"unknown message kind {kind}")
    return Header(kind, rank, seq, records_before, dropped, run_id)


def decode_records(frame: bytes) -> array:
    """The records of a RECORDS ``frame`` (header already checked), expanded into flat
    int64 values, ``RECORD_WIDTH`` per phase.

    Raises WireError("truncated") when the body is not whole slots, "malformed" when it
    does not begin with a context slot or a GPU slot follows no phase slot.
    """
    body = memoryview(frame)[HEADER.size :]
    if len(body) % SLOT_BYTES:
        raise WireError(
            "truncated", f"body of {len(body)} bytes is not whole {SLOT_BYTES}-byte slots"
        )
    slots = array("q")
    slots.frombytes(body)
    if sys.byteorder != "little":
        slots.byteswap()
    if slots and slots[0] & TAG_MASK != TAG_CONTEXT:
        raise WireError("malformed", "records do not begin with a context slot")
    records = array("q")
    context: tuple[int, int, int, int] = (0, 0, 0, 0)
    last_phase = -1  # offset in ``records`` of the phase a GPU slot may complete
    for i in range(0, len(slots), SLOT_WIDTH):
        tag, a, b = slots[i], slots[i + 1], slots[i + 2]
        kind = tag & TAG_MASK
        if kind == TAG_CONTEXT:
            context = ((tag >> 16) & 0xFFFF, tag >> 32, a, b)
            last_phase = -1
        elif kind == TAG_GPU:
            if last_phase < 0:
                raise WireError("malformed", "a GPU slot that follows no phase slot")
            records[last_phase + P_FLAGS] |= (tag >> 16) & 0xFFFF
            records[last_phase + P_GPU] = a
            records[last_phase + P_PEAK] = b
            records[last_phase + P_LAG] = (tag >> 32) * 1000
            last_phase = -1
        else:
            last_phase = len(records)
            flags, epoch, iteration, batch = context
            # Above the id: a loop slot's batch count; the sidecar rejects it elsewhere.
            records.extend(
                (kind, flags, epoch, iteration, batch, a, b, -1, -1, tag >> BATCHES_SHIFT, 0)
            )
    return records


def decode_control(frame: bytes) -> dict[str, Any]:
    """The JSON object of a CONTROL ``frame``: a string ``type`` and, when the sender
    wants an answer, a string ``reply_to`` of at most ``MAX_REPLY_TO`` characters.

    Raises WireError "oversized" over ``MAX_CONTROL_BYTES``, "malformed" for anything
    else that is not such an object, whatever its content (nesting too deep for the JSON
    parser included).
    """
    body = frame[HEADER.size :]
    if len(body) > MAX_CONTROL_BYTES:
        raise WireError("oversized", f"control body of {len(body)} bytes")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # json.loads raises RecursionError, not ValueError, on deeply nested input
        raise WireError(
            "malformed", f"control body is not JSON: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise WireError("malformed", "control body must be an object with a string 'type'")
    reply_to = obj.get("reply_to")
    if reply_to is not None and not (isinstance(reply_to, str) and len(reply_to) <= MAX_REPLY_TO):
        raise WireError(
            "malformed", f"'reply_to' must be a string of at most {MAX_REPLY_TO} characters"
        )
    return obj


def phase_label(phase_id: int, custom: dict[int, str]) -> str:
    """Column label of ``phase_id``: canonical label, else the declared custom name."""
    label = PHASE_LABELS.get(phase_id)
    return label if label is not None else custom[phase_id]
