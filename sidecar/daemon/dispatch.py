"""The control messages a sidecar answers: one validated handler per type in one table.

Each handler takes the stream the message came from (None only for the types that need
none), its body and the time, checks every field it reads (WireError "malformed"
otherwise) and returns the reply body, or None when the type is never answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from markers import wire
from sidecar.ingest.peers import Peer
from sidecar.ingest.streams import Registry, Stream
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor

Reply = dict[str, Any] | None
Write = Callable[[Split, bool], str | None]  # (split, with_state) -> error text or None


def _string(body: dict[str, Any], key: str, kind: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise wire.WireError("malformed", f"{kind} needs a string {key!r}")
    return value


class Dispatcher:
    """Routes control bodies to their handler. The server answers the two that are not
    about one run: ``status(caller)`` gives the status view the caller may see,
    ``finish_job(job_id, caller)`` ends a job's runs; ``caller`` is the kernel's word on
    the sender (a Peer) or None."""

    def __init__(self, registry: Registry, monitor: ResourceMonitor, write: Write,
                 status: Callable[[Peer | None], dict[str, Any]],
                 finish_job: Callable[[str, Peer | None], dict[str, Any]]) -> None:
        self.registry = registry
        self.monitor = monitor
        self.write = write
        self.status = status
        self.finish_job = finish_job
        self._table: dict[str, Callable[[Stream, dict[str, Any], float], Reply]] = {
            wire.PHASE: self._phase,
            wire.GPU: self._gpu,
            wire.BATCH_SIZE: self._batch_size,
            wire.STATE: self._state,
            wire.LOAD_STATE: self._load_state,
            wire.CHECKPOINT: self._checkpoint,
            wire.FINISH: self._finish,
        }

    def dispatch(self, header: wire.Header, body: dict[str, Any], now: float,
                 caller: Peer | None = None) -> Reply:
        """Handle one control body from ``caller``. Raises WireError (malformed,
        unknown_control) and Refused; the caller counts them."""
        kind = body["type"]
        if kind == wire.STATUS:
            return {"ok": True, **self.status(caller)}
        if kind == wire.FINISH_JOB:
            return self.finish_job(_string(body, "job_id", kind), caller)
        if kind == wire.HELLO:
            return self.registry.hello(header, body, now, caller)
        handler = self._table.get(kind)
        if handler is None:
            raise wire.WireError("unknown_control", f"control type {kind!r}")
        stream = self.registry.stream_for(header, kind)
        if stream is None:
            return {"ok": False, "error": "unknown run: no hello received"}
        return handler(stream, body, now)

    def _phase(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        self.registry.declare_phase(stream, body)
        return None

    def _gpu(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        uuid, name = _string(body, "uuid", "gpu"), _string(body, "name", "gpu")
        stream.split.add_gpu(uuid, name)
        self.monitor.add_gpu(uuid)
        return None

    def _batch_size(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        which, value = body.get("kind"), body.get("value")
        if which not in ("train", "validation") or not isinstance(value, int) \
                or isinstance(value, bool) or value < 1:
            raise wire.WireError("malformed", "batch_size needs kind and a positive value")
        stream.split.batch_sizes.setdefault(which, value)
        return None

    def _state(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        return self.registry.state_of(stream)

    def _load_state(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        return self.registry.load_state(stream, body.get("state"))

    def _checkpoint(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        return self._written(stream.split, with_state=True)

    def _finish(self, stream: Stream, body: dict[str, Any], now: float) -> Reply:
        status = body.get("status")
        if status not in ("completed", "failed"):
            raise wire.WireError("malformed", "finish status must be completed or failed")
        end_ns, error = body.get("end_ns"), body.get("error")
        self.registry.finish(stream, status, error if isinstance(error, str) else None,
                             end_ns if isinstance(end_ns, int) else None, now)
        return self._written(stream.split)

    def _written(self, split: Split, with_state: bool = False) -> dict[str, Any]:
        error = self.write(split, with_state)
        return {"ok": error is None, "error": error, "out_dir": str(split.out_dir)}
