"""The fields of each control type and what each may hold, checked before any handler
runs: whatever a message contains, it is handled or rejected as ``malformed``, never an
exception in the loop and never a value that later breaks a write or a sum.

Every body is first walked as a whole: a NaN or infinite number, or an integer beyond
64 bits, anywhere in it is malformed (JSON lets a sender write ``NaN`` and 10^4000). Then
each field the handlers read is checked for its type and range; fields nobody reads are
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from markers import wire

INT64_MAX = 2**63 - 1
PID_MAX = 2**22  # the kernel's upper bound of pid_max
TEXT_MAX = 4096  # paths, commands' words, causes
NAME_MAX = 256  # host names, GPU names and ids, version strings

Check = Callable[[Any], bool]  # True when a (present, non-null) value is acceptable


def integer(low: int = 0, high: int = INT64_MAX) -> Check:
    """An integer (not a bool) in [low, high]."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def text(max_len: int = TEXT_MAX, min_len: int = 0) -> Check:
    """A string of ``min_len`` to ``max_len`` characters."""
    return lambda v: isinstance(v, str) and min_len <= len(v) <= max_len


def one_of(*choices: str) -> Check:
    """One of the given strings."""
    return lambda v: isinstance(v, str) and v in choices


def number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def flag(v: Any) -> bool:
    """true or false."""
    return isinstance(v, bool)


def words(v: Any) -> bool:
    """A list of strings (a command line)."""
    return isinstance(v, list) and len(v) <= 4096 and all(
        isinstance(w, str) and len(w) <= TEXT_MAX for w in v)


def names(v: Any) -> bool:
    """An object of short strings (versions)."""
    return isinstance(v, dict) and len(v) <= 64 and all(
        isinstance(k, str) and isinstance(x, str) and len(k) <= NAME_MAX
        and len(x) <= NAME_MAX for k, x in v.items())


def anything(v: Any) -> bool:
    """Any value: its handler checks it (a saved state, checked by its loader)."""
    return True


# type -> field -> (required, nullable, check)
Fields = dict[str, tuple[bool, bool, Check]]
FIELDS: dict[str, Fields] = {
    wire.HELLO: {
        "out_dir": (True, False, text(min_len=1)),
        "cwd": (False, False, text(min_len=1)),
        "split": (False, False, integer(0, 2**31 - 1)),
        "warmup_iterations": (False, False, integer()),
        "num_measurements": (False, False, integer()),
        "train_batch_size": (False, True, integer(1)),
        "val_batch_size": (False, True, integer(1)),
        "accumulation_steps": (False, False, integer(1)),
        "resume": (False, False, flag),
        "repeat": (False, False, flag),
        "host": (False, True, text(NAME_MAX)),
        "pid": (False, False, integer(0, PID_MAX)),
        "user": (False, True, text(NAME_MAX)),
        "job_id": (False, True, text(NAME_MAX)),
        "command": (False, True, words),
        "start_unix": (False, True, number),
        "start_ns": (False, False, integer()),
        "versions": (False, True, names),
        "phases": (False, False, anything),  # custom names -> ids: checked by the streams
        "worker_phases": (False, False, integer()),
        "sidecar_wait_s": (False, False, number),
        "flops_per_batch": (False, True, number),
        "flops_dtype": (False, False, one_of(*wire.FLOPS_DTYPES)),
    },
    wire.PHASE: {
        "id": (True, False, integer(wire.FIRST_CUSTOM_ID, wire.MAX_PHASE_ID)),
        "name": (True, False, text(200, min_len=1)),
    },
    wire.GPU: {"uuid": (True, False, text(NAME_MAX, 1)), "name": (True, False, text(NAME_MAX))},
    wire.BATCH_SIZE: {
        "kind": (True, False, one_of("train", "validation")),
        "value": (False, True, integer(1, 2**31 - 1)),  # null: the batches have no size
        "iteration": (True, False, integer()),
    },
    wire.PART: {"data": (True, False, text(wire.MAX_CONTROL_BYTES))},  # base64: its handler
    wire.CHECKPOINT: {},
    wire.STATE: {},
    wire.LOAD_STATE: {  # the state inline, or the size of the parts sent before
        "state": (False, True, anything),
        "payload_bytes": (False, False, integer()),
    },
    wire.FINISH: {
        "status": (True, False, one_of("completed", "failed")),
        "error": (False, True, text()),
        "end_ns": (False, True, integer()),
        "worker_phases": (False, True, integer()),
    },
    wire.STATUS: {},
    wire.LOADER: {
        "kind": (True, False, one_of("train", "validation")),
        "num_workers": (True, False, integer(0, 2**31 - 1)),
        "pin_memory": (True, False, flag),
    },
    wire.FINISH_JOB: {"job_id": (True, False, text(NAME_MAX, 1))},
}


def finite(value: Any) -> bool:
    """No NaN, no infinity, no integer beyond 64 bits anywhere in ``value`` (walked without
    recursion: the JSON decoder already bounded its depth)."""
    todo: list[Any] = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return False
        elif isinstance(value, int):
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                return False
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return True


def check(kind: str, body: dict[str, Any]) -> None:
    """Check the body of a control of a known ``kind`` (a key of FIELDS).

    Raises WireError("malformed") naming the first field that is missing or wrong.
    """
    if not finite(body):
        raise wire.WireError("malformed", f"{kind}: a NaN, infinite or over-64-bit number")
    for name, (required, nullable, ok) in FIELDS[kind].items():
        value = body.get(name)
        if value is None:
            if required or (name in body and not nullable):
                raise wire.WireError("malformed", f"{kind} needs the field {name!r}")
        elif not ok(value):
            raise wire.WireError("malformed", f"{kind}: field {name!r} has a wrong type or "
                                 "value")
