"""The control messages a sidecar answers: one handler per type in one table.

Every body is checked against its type's fields (``sidecar.daemon.schema``) before its
handler runs (WireError "malformed" otherwise). Each handler takes the stream the message
came from, its body and the time, and returns the reply body, or None when the type is
never answered. Work that must follow the reply (a checkpoint's writing: the client goes
on as soon as the state is taken) is queued in ``later``; the server runs it right after
replying, before it reads anything else, so what is written is the state at the
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from markers import wire
from sidecar.daemon import schema
from sidecar.ingest import payload, resume
from sidecar.ingest.peers import Peer
from sidecar.ingest.stream import Stream
from sidecar.ingest.streams import Registry
from sidecar.model import state
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceMonitor

Reply = dict[str, Any] | None
Write = Callable[[Split, bool], str | None]  # (split, with_state) -> error text or None


class Dispatcher:
    """Routes control bodies to their handler. The server answers the two that are not
    about one run: ``status(caller)`` gives the status view the caller may see,
    ``finish_job(job_id, caller)`` ends a job's runs; ``caller`` is the kernel's word on
    the sender (a Peer) or None."""

    def __init__(
        self,
        registry: Registry,
        monitor: ResourceMonitor,
        write: Write,
        status: Callable[[Peer | None, dict[str, Any]], dict[str, Any]],
        finish_job: Callable[[str, Peer | None], dict[str, Any]],
    ) -> None:
        self.registry = registry
        self.monitor = monitor
        self.write = write
        self.status = status
        self.finish_job = finish_job
        self.later: list[Callable[[], object]] = []  # run by the server after the reply
        self._table: dict[str, Callable[[Stream, dict[str, Any], float], Reply]] = {
            wire.PHASE: self._phase,
            wire.GPU: self._gpu,
            wire.BATCH_SIZE: self._batch_size,
            wire.LOADER: self._loader,
            wire.PART: self._part,
            wire.STATE: self._state,
            wire.LOAD_STATE: self._load_state,
            wire.CHECKPOINT: self._checkpoint,
            wire.FINISH: self._finish,
        }

    def dispatch(
        self, header: wire.Header, body: dict[str, Any], now_unix: float, caller: Peer | None = None
    ) -> Reply:
        """Handle one control body from ``caller``. Raises WireError (malformed,
        unknown_control) and Refused; the caller counts them."""
        kind = body["type"]
        if kind not in schema.FIELDS:
            raise wire.WireError("unknown_control", f"control type {kind!r}")
        schema.check(kind, body)
        if kind == wire.STATUS:
            return {"ok": True, **self.status(caller, body)}
        if kind == wire.FINISH_JOB:
            return self.finish_job(body["job_id"], caller)
        if kind == wire.HELLO:
            return self.registry.hello(header, body, now_unix, caller)
        handler = self._table[kind]
        stream = self.registry.stream_for(header, kind)
        if stream is None:
            return {"ok": False, "error": "unknown run: no hello received"}
        return handler(stream, body, now_unix)

    def _phase(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        self.registry.declare_phase(stream, body)
        return None

    def _gpu(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        uuid = body["uuid"]
        stream.split.add_gpu(uuid, body["name"])
        stream.split.rank_gpus[stream.rank] = uuid
        self.monitor.add_gpu(uuid)
        return None

    def _batch_size(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        stream.split.rank(stream.rank).note_batch_size(
            body["kind"] == "validation",
            body["iteration"],
            body.get("value"),
            body.get("position", 0),
        )
        return None

    def _loader(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        settings = {"num_workers": body["num_workers"], "pin_memory": body["pin_memory"]}
        if stream.split.loaders.get(body["kind"]) != settings:
            stream.split.loaders[body["kind"]] = settings
            stream.split.dirty = True
        return None

    def _state(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        return resume.state_of(stream)

    def _part(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        payload.add_part(stream, body)
        return None

    def _load_state(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        if "payload_bytes" not in body:  # small enough to travel inline
            return self.registry.load_state(stream, body.get("state"))
        try:
            saved = payload.take_payload(stream, body["payload_bytes"])
        except state.StateError as exc:
            return {"ok": False, "error": str(exc)}
        if not schema.finite(saved):  # a body is checked whole; a payload is checked here
            return {
                "ok": False,
                "error": "the state sent holds a NaN, an infinite or an over-64-bit number",
            }
        return self.registry.load_state(stream, saved)

    def _checkpoint(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        split = stream.split
        self.later.append(lambda: self.write(split, True))
        return {"ok": True, "out_dir": str(split.out_dir), "error": split.write_error}

    def _finish(self, stream: Stream, body: dict[str, Any], now_unix: float) -> Reply:
        self.registry.note_worker_phases(stream, body.get("worker_phases"))
        self.registry.note_gpu_unfinished(stream, body.get("gpu_unfinished"))
        self.registry.note_loop(stream, body.get("loop_start_ns"), body.get("loop_end_ns"))
        self.registry.finish(
            stream, body["status"], body.get("error"), body.get("end_ns"), now_unix
        )
        return self._written(stream.split)

    def _written(self, split: Split, with_state: bool = False) -> dict[str, Any]:
        error = self.write(split, with_state)
        return {"ok": error is None, "error": error, "out_dir": str(split.out_dir)}
