"""The fields of each control type and what each may hold, checked before any handler
runs: whatever a message contains, it is handled or rejected as ``malformed``, never an
exception in the loop and never a value that later breaks a write or a sum.

Every body is first walked as a whole: a NaN or infinite number, or an integer beyond
64 bits, anywhere in it is malformed (JSON lets a sender write ``NaN`` and 10^4000). Then
each field the handlers read is checked for its type and range; fields nobody reads are
ignored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from markers import hello, wire

INT64_MAX = hello.INT64_MAX
TEXT_MAX = hello.TEXT_MAX  # paths, commands' words, causes
NAME_MAX = hello.NAME_MAX  # host names, GPU names and ids, version strings

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


def flag(v: Any) -> bool:
    """A bool."""
    return isinstance(v, bool)


def anything(v: Any) -> bool:
    """Any value: its handler checks it (a saved state, checked by its loader)."""
    return True


# type -> field -> (required, nullable, check)
Fields = dict[str, tuple[bool, bool, Check]]
FIELDS: dict[str, Fields] = {
    # The hello's fields, limits and defaults are the markers' own (``markers.hello``).
    wire.HELLO: {
        name: (field.required, field.nullable, functools.partial(hello.accepts, field))
        for name, field in hello.FIELDS.items()
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
        "position": (False, False, integer()),  # absent: 0, the iteration's first batch
    },
    wire.PART: {"data": (True, False, text(wire.MAX_CONTROL_BYTES))},  # base64: its handler
    wire.CHECKPOINT: {},
    wire.STATE: {},
    wire.LOAD_STATE: {  # the state inline, or the size of the parts sent before
        "state": (False, True, anything),
        "payload_bytes": (False, False, integer()),
    },
    wire.FINISH: {
        "status": (True, False, one_of("completed", "failed", "incomplete")),
        "error": (False, True, text()),
        "end_ns": (False, True, integer()),
        "worker_phases": (False, True, integer()),
        "gpu_unfinished": (False, True, integer()),
        # the framework's own training loop (the Trainer's train_runtime), perf_counter_ns
        "loop_start_ns": (False, True, integer()),
        "loop_end_ns": (False, True, integer()),
    },
    wire.STATUS: {  # splits: also every split's figures (sidecar top); token: see all
        "splits": (False, False, flag),
        "token": (False, False, text(NAME_MAX, 1)),
    },
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
            raise wire.WireError("malformed", f"{kind}: field {name!r} has a wrong type or value")
