"""A payload sent in parts (a saved state too large for one message): each ``part`` adds
base64 data to its stream's buffer, the request that follows takes it whole."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from markers import wire
from sidecar.ingest.stream import Stream
from sidecar.model import state

# A payload sent in parts (a saved state) may not grow past this.
MAX_PAYLOAD_BYTES = 1 << 30


def add_part(stream: Stream, body: dict[str, Any]) -> None:
    """One ``part`` of a payload (base64 ``data``); WireError when malformed or when
    the payload would exceed ``MAX_PAYLOAD_BYTES``."""
    data = body.get("data")
    try:
        chunk = base64.b64decode(data, validate=True) if isinstance(data, str) else None
    except (binascii.Error, ValueError):
        chunk = None
    if chunk is None:
        raise wire.WireError("malformed", "a part needs base64 'data'")
    if len(stream.payload) + len(chunk) > MAX_PAYLOAD_BYTES:
        stream.payload.clear()
        raise wire.WireError("oversized", f"payload over {MAX_PAYLOAD_BYTES} bytes")
    stream.payload += chunk


def take_payload(stream: Stream, expected: Any) -> Any:
    """The JSON value of the payload sent in parts before a request that says it has
    ``expected`` bytes; raises StateError when parts are missing or it is not JSON."""
    payload, stream.payload = bytes(stream.payload), bytearray()
    if not isinstance(expected, int) or len(payload) != expected:
        raise state.StateError(
            f"the state arrived incomplete ({len(payload)} of "
            f"{expected} bytes: parts were lost on the way)"
        )
    try:
        return json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise state.StateError(f"the state sent is not JSON ({type(exc).__name__})") from None
