"""What the sidecar knows of its clients: one stream per training process (run id), the
splits they feed, and the counts of rejected input. Decoded messages come in here from
``sidecar.ingest.receiver``; writing is left to the server.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from markers import wire
from markers.wire import P_BATCHES, P_END, P_FLAGS, P_PHASE, P_START
from sidecar.ingest.peers import Peer
from sidecar.ingest.startup import note_startup
from sidecar.model import state
from sidecar.model.aggregator import RankAggregator, RecordValues, Settings
from sidecar.model.split import Split

log = logging.getLogger("sidecar")

HOSTNAME = socket.gethostname()
LAST_STANDARD_ID = max(wire.PHASE_LABELS)  # standard ids are 1 (Training is derived) to this
KNOWN_FLAGS = (wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION | wire.FLAG_GPU_DROPPED
               | wire.FLAG_INCOMPLETE | wire.FLAG_BEGIN)
# Records of a run we have not heard the hello of yet (a restarted sidecar) wait this long
# for the markers' periodic hello, at most this many records in all (~18 MB: bounded in
# bytes, whatever the size of the messages).
PENDING_S = 5.0
PENDING_RECORDS = 200_000
# A payload sent in parts (a saved state) may not grow past this.
MAX_PAYLOAD_BYTES = 1 << 30


class Refused(Exception):
    """A hello the sidecar will not serve (e.g. an out_dir outside ``--root``, a split
    another live run writes)."""


class Claim(Protocol):
    """This sidecar's exclusive claim on a split's folder (``sidecar.sinks.locks``)."""

    previous: dict[str, Any]  # what the last holder recorded

    def record(self, holder: dict[str, Any]) -> None:
        """Say who holds it now."""

    def release(self) -> None:
        """Give it up."""


def _iso(unix: Any) -> str:
    if not isinstance(unix, (int, float)):
        return "an unknown time"
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


@dataclass
class Stream:
    """One training process (one ``start_run``) sending to this sidecar."""

    run_id: bytes
    split: Split
    rank: int
    pid: int
    host: str
    start_unix: float = 0.0
    start_ns: int = 0
    previous_end_unix: float | None = None  # last activity of the split's previous process
    last_seq: int = -1
    received: int = 0
    finished: bool = False
    custom_names: dict[int, str] = field(default_factory=dict)  # declared: wire id -> name
    owner: Peer | None = None  # the kernel's word on who started it (ipc), else unknown
    payload: bytearray = field(default_factory=bytearray)  # parts received for a request
    # wire id -> key in the aggregator ``_keys_of`` (names map to keys, ids are per process)
    _keys: dict[int, int] = field(default_factory=dict)
    _keys_of: object = None

    @property
    def key(self) -> str:
        """The run id as hex, used in files and the status view."""
        return self.run_id.hex()

    def is_local(self) -> bool:
        """True when the process runs on this host, so its pid can be watched."""
        return self.host == HOSTNAME

    def custom_keys(self, agg: RankAggregator) -> dict[int, int]:
        """This process's custom phase ids mapped to ``agg``'s keys, by name."""
        if self._keys_of is not agg or len(self._keys) != len(self.custom_names):
            self._keys = {i: agg.custom_key(name) for i, name in self.custom_names.items()}
            self._keys_of = agg
        return self._keys


def _int(body: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise wire.WireError("malformed", f"hello field {key!r} must be an integer >= {low}")
    return value


def _phase_id(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) \
            or not wire.FIRST_CUSTOM_ID <= value <= wire.MAX_PHASE_ID:
        raise wire.WireError("malformed", f"a custom phase id must lie in {wire.FIRST_CUSTOM_ID}"
                             f"-{wire.MAX_PHASE_ID}, got {value!r}")
    return value


def _phase_name(value: Any) -> str:
    if not isinstance(value, str):
        raise wire.WireError("malformed", "a custom phase name must be a string")
    try:
        return wire.custom_phase_name(value)
    except ValueError as exc:
        raise wire.WireError("malformed", f"custom phase name refused: {exc}") from None


def settings_from_hello(body: dict[str, Any]) -> Settings:
    """The aggregation settings in a hello; WireError("malformed") when a value is wrong."""
    return Settings(
        warmup_iterations=_int(body, "warmup_iterations", 0) or 0,
        num_measurements=_int(body, "num_measurements", 100) or 0,
        train_batch_size=_int(body, "train_batch_size", None, low=1),
        val_batch_size=_int(body, "val_batch_size", None, low=1),
        accumulation_steps=_int(body, "accumulation_steps", 1, low=1) or 1,
    )


class Registry:
    """Streams, splits and reject counts. The daemon supplies its policy and the sinks'
    knowledge as callables: ``resolve_out_dir(out_dir, cwd, owner)`` places a run's folder
    for the user ``owner`` (a Peer, or None when unknown; raises Refused),
    ``previous_activity(folder, split)`` tells when the split's last process was last
    heard of (Unix s, from the run folder; None when unknown), ``claim(split_dir)`` takes
    the split's folder for this sidecar (raises Refused when another live sidecar holds
    it; None when the folder cannot be used now, the writes will say why), ``alive(stream)``
    whether a stream's process still lives (False only when known to be gone).

    One writer per split (SPEC §4): a hello for a split and rank that a live run of this
    sidecar feeds, or whose folder another sidecar claimed, is refused. A resume takes
    only a state of the lineage of the last run started on the split (``state.lineage``).
    """

    def __init__(self, resolve_out_dir: Callable[[str, str, Peer | None], Path],
                 on_stream: Callable[[Stream], None] = lambda stream: None,
                 on_records: Callable[[Stream, np.ndarray], None] = lambda stream, values: None,
                 previous_activity: Callable[[Path, int], float | None] = lambda f, s: None,
                 claim: Callable[[Path], Claim | None] = lambda split_dir: None,
                 alive: Callable[[Stream], bool] = lambda stream: True,
                 ) -> None:
        self.resolve_out_dir = resolve_out_dir
        self.previous_activity = previous_activity
        self.claim = claim
        self.alive = alive
        self.claims: dict[tuple[Path, int], Claim] = {}
        # Per split, what its lock file says of the last run started on each rank:
        # {"ranks": {rank: {"run_id", "lineage", "start_unix", "pid", "host"}}, ...}
        self.last_runs: dict[tuple[Path, int], dict[str, Any]] = {}
        self.on_stream = on_stream  # a new training process said hello
        self.on_records = on_records  # good records of a stream, after aggregation
        self.streams: dict[bytes, Stream] = {}
        self.splits: dict[tuple[Path, int], Split] = {}
        self.rejected: Counter[str] = Counter()
        self.records_received = 0
        self.last_error: str | None = None  # the latest refusal or write error, for status
        self._pending: dict[bytes, list[tuple[float, wire.Header, np.ndarray]]] = {}
        self._pending_records = 0

    # -- rejects --------------------------------------------------------------------

    def reject(self, kind: str, detail: str, count: int = 1, split: Split | None = None) -> None:
        """Count ``count`` rejected records/messages of ``kind``; log the first of each kind."""
        if not self.rejected[kind]:
            log.warning("rejected %s: %s (further ones of this kind are counted, not logged)",
                        kind, detail)
        self.rejected[kind] += count
        if split is not None:
            split.rejected += count
            split.dirty = True

    @property
    def dropped(self) -> int:
        """Records the markers of every split could not send, as they reported."""
        return sum(sum(s.dropped.values()) for s in self.splits.values())

    # -- hello ----------------------------------------------------------------------

    def hello(self, header: wire.Header, body: dict[str, Any], now: float,
              owner: Peer | None = None) -> dict[str, Any]:
        """Register a run of the user ``owner`` (or note a repeated hello); the reply tells
        the markers the session and the epoch to continue from. Raises WireError for a
        malformed hello, Refused for one the policy refuses.

        A hello with ``resume`` continues the split from its state file; a repeated hello
        (``repeat``) of a run this sidecar does not know comes from a process that kept
        training while no sidecar listened: its session goes on from the state file, and
        the span since the checkpoint is recorded as a gap.
        """
        known = self.streams.get(header.run_id)
        if known is not None:
            self._hello_news(known, body)
            return {"ok": True, "session": known.split.rank(known.rank).sessions[-1].number}
        self._declarations(body)  # checked before anything changes
        out_dir = body.get("out_dir")
        cwd = body.get("cwd", "/")
        if not isinstance(out_dir, str) or not out_dir or not isinstance(cwd, str):
            raise wire.WireError("malformed", "hello needs 'out_dir' and 'cwd' strings")
        split_index = _int(body, "split", 0) or 0
        settings = settings_from_hello(body)
        start_ns = _int(body, "start_ns", 0) or 0
        start_unix = body.get("start_unix")
        start_unix = float(start_unix) if isinstance(start_unix, (int, float)) else now
        repeat = bool(body.get("repeat", False))
        resume = bool(body.get("resume", False)) or repeat
        folder = self.resolve_out_dir(out_dir, cwd, owner)
        key = (folder, split_index)
        split = self.splits.get(key)
        self._one_writer(key, split, header.rank)
        info = {k: body.get(k) for k in ("host", "user", "job_id", "command", "cwd",
                                          "versions", "flops_per_batch", "flops_dtype")}
        info["start_unix"] = start_unix
        previous_end = self.previous_activity(folder, split_index)
        old = split.ranks.get(header.rank) if split is not None else None
        if old is not None and old.sessions:
            previous_end = max(previous_end or 0.0, old.sessions[-1].last_unix)
        if split is None or (not resume and header.rank in split.ranks):
            split = self.splits[key] = Split(folder, split_index, settings, info)
        split.settings = settings
        split.status, split.cause, split.end_unix = "running", None, None
        stream = Stream(header.run_id, split, header.rank, _int(body, "pid", 0) or 0,
                        str(body.get("host", "")), start_unix, start_ns, previous_end,
                        owner=owner)
        warning = None
        agg = None
        if resume:
            try:
                saved = state.load(state.state_path(split.split_dir))
                self._same_lineage(key, saved, header.rank)
                agg = self._restore(stream, saved, now, repeat)
            except state.StateError as exc:
                warning = f"{exc}; starting this split afresh"
        if agg is None:
            agg = split.fresh_rank(header.rank) if resume else split.rank(header.rank)
            agg.begin_session(start_unix, start_ns, stream.key)
            if repeat:
                split.gaps.append((start_unix, now))
        if warning:
            log.warning("run %s: %s", header.run_id.hex(), warning)
        self.streams[header.run_id] = stream
        self._hello_news(stream, body)
        self._record_run(stream, agg)
        split.dirty = True
        self.on_stream(stream)
        self._replay_pending(header.run_id)
        reply: dict[str, Any] = {"ok": True, "session": agg.sessions[-1].number,
                                 "epoch": self._next_epoch(agg), "out_dir": str(folder)}
        if warning:
            reply["warning"] = warning
        return reply

    def _hello_news(self, stream: Stream, body: dict[str, Any]) -> None:
        """What a (repeated) hello tells of a known process: its custom phases (a sidecar
        that took over never saw their declarations) and its DataLoader workers' phases."""
        stream.custom_names.update(self._declarations(body))
        self.note_worker_phases(stream, body.get("worker_phases"))
        note_startup(stream.split.rank(stream.rank).sessions[-1], body, stream.start_unix)

    @staticmethod
    def _declarations(body: dict[str, Any]) -> dict[int, str]:
        """The ``phases`` map of a hello (name -> id) as id -> name; WireError if bad."""
        phases = body.get("phases", {})
        if not isinstance(phases, dict) or len(phases) > wire.MAX_CUSTOM_PHASES:
            raise wire.WireError("malformed", "hello 'phases' must map at most "
                                 f"{wire.MAX_CUSTOM_PHASES} names to ids")
        return {_phase_id(phase_id): _phase_name(name) for name, phase_id in phases.items()}

    def note_worker_phases(self, stream: Stream, count: Any) -> None:
        """The phases timed in ``stream``'s DataLoader workers so far (a running total;
        ignored unless a non-negative integer)."""
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            session = stream.split.rank(stream.rank).sessions[-1]
            if count > session.worker_phases:
                session.worker_phases = count
                stream.split.dirty = True

    def _restore(self, stream: Stream, saved: dict[str, Any], now: float,
                 repeat: bool) -> RankAggregator:
        """Continue ``stream``'s rank from the state document ``saved``; returns its
        aggregator with the process's session open. Raises StateError (with the reason)
        for a state of another schema that cannot be upgraded or that does not fit it.
        """
        split = stream.split
        saved = state.upgrade(saved)
        continuing = stream.key if repeat else ""
        try:
            agg = split.load_state(saved, stream.rank, continuing)
            saved_unix = float(saved["ranks"].get(str(stream.rank), {}).get(
                "saved_unix", stream.start_unix))
            if not (agg.sessions and agg.sessions[-1].end_ns is None):
                # the loaded sessions are used here first: a wrong value in them fails here
                agg.account_resume(saved_unix, stream.previous_end_unix, stream.start_unix)
                agg.begin_session(stream.start_unix, stream.start_ns, stream.key)
        except (KeyError, ValueError, TypeError, AttributeError, IndexError,
                ArithmeticError) as exc:
            split.fresh_rank(stream.rank)
            raise state.StateError(f"saved state does not fit schema {state.SCHEMA} "
                                   f"({type(exc).__name__}: {exc})") from None
        if repeat:  # a new sidecar took over a running process: what came since is missing
            split.gaps.append((max(saved_unix, stream.start_unix), now))
            stream.received = split.received.get(stream.key, 0)
        return agg

    def load_state(self, stream: Stream, saved: Any) -> dict[str, Any]:
        """A ``load_state`` control: continue ``stream``'s split from a state the user kept
        (``run.state_dict()`` of an earlier process). The reply carries the epoch to go on
        from, or ``ok: False`` and the reason.
        """
        try:
            agg = self._restore(stream, saved, 0.0, repeat=False)
        except state.StateError as exc:
            agg = stream.split.rank(stream.rank)
            if not agg.sessions or agg.sessions[-1].end_ns is not None:  # reset by the failure
                agg.begin_session(stream.start_unix, stream.start_ns, stream.key)
            log.warning("run %s: state not loaded: %s", stream.key, exc)
            return {"ok": False, "error": str(exc)}
        self._record_run(stream, agg)  # the user's state: this run continues its lineage
        stream.split.dirty = True
        return {"ok": True, "session": agg.sessions[-1].number, "epoch": self._next_epoch(agg)}

    def state_of(self, stream: Stream) -> dict[str, Any]:
        """A ``state`` control: the state document of ``stream``'s split (for the user's own
        checkpoint); the same content as the state file of a checkpoint.
        """
        return {"ok": True, "state": state.document(stream.split.to_state())}

    # -- one writer per split, lineage --------------------------------------------------

    def _one_writer(self, key: tuple[Path, int], split: Split | None, rank: int) -> None:
        """Refuse a second live writer of the split (Refused); claim its folder."""
        for other in self.streams.values():
            if other.split is not split or other.rank != rank or other.finished:
                continue
            if not self.alive(other):  # killed and restarted faster than the liveness check
                self.finish(other, "incomplete", f"process {other.pid} ended without "
                            "finish()", None, other.split.rank(rank).sessions[-1].last_unix)
                continue
            raise Refused(f"split {key[1]} of {key[0]} (rank {rank}) is being written by "
                          f"run {other.key[:8]} (pid {other.pid} on {other.host}) under this "
                          "sidecar; one writer per split: this run is not monitored")
        if key not in self.claims:
            claim = self.claim(key[0] / "training" / f"split-{key[1]}")
            if claim is not None:
                self.claims[key] = claim
                self.last_runs[key] = claim.previous

    def _same_lineage(self, key: tuple[Path, int], saved: dict[str, Any], rank: int) -> None:
        """Raise StateError when ``saved`` is not of the lineage of the last run started
        on the split's ``rank`` (a run started afresh after it left no state of its own)."""
        ranks = self.last_runs.get(key, {}).get("ranks")
        last = ranks.get(str(rank)) if isinstance(ranks, dict) else None
        lineage = state.lineage(saved, rank)
        if not isinstance(last, dict) or not lineage or not last.get("lineage") \
                or last["lineage"] == lineage:
            return
        raise state.StateError(
            f"the saved state belongs to run {lineage[:8]}, but run {str(last.get('run_id'))[:8]} "
            f"started afresh in this folder after it (at {_iso(last.get('start_unix'))}) and "
            "left no state: that state is older than the last run and is not loaded")

    def _record_run(self, stream: Stream, agg: RankAggregator) -> None:
        """Note ``stream`` as the last run started on its split and rank, in memory and in
        the split's lock file; its lineage is its aggregator's first session's run."""
        key = (stream.split.out_dir, stream.split.split)
        last = self.last_runs.setdefault(key, {})
        ranks = last.get("ranks") if isinstance(last.get("ranks"), dict) else {}
        ranks[str(stream.rank)] = {
            "run_id": stream.key, "lineage": agg.sessions[0].run_id or stream.key,
            "start_unix": stream.start_unix, "pid": stream.pid, "host": stream.host}
        last.update({"sidecar_pid": os.getpid(), "host": HOSTNAME, "ranks": ranks})
        claim = self.claims.get(key)
        if claim is not None:
            claim.record(last)

    def release(self, split: Split) -> None:
        """Give up the claim on ``split``'s folder once none of its runs is live."""
        if any(s.split is split and not s.finished for s in self.streams.values()):
            return
        claim = self.claims.pop((split.out_dir, split.split), None)
        if claim is not None:
            claim.release()

    # -- payloads -------------------------------------------------------------------

    def add_part(self, stream: Stream, body: dict[str, Any]) -> None:
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

    def take_payload(self, stream: Stream, expected: Any) -> Any:
        """The JSON value of the payload sent in parts before a request that says it has
        ``expected`` bytes; raises StateError when parts are missing or it is not JSON."""
        payload, stream.payload = bytes(stream.payload), bytearray()
        if not isinstance(expected, int) or len(payload) != expected:
            raise state.StateError(f"the state arrived incomplete ({len(payload)} of "
                                   f"{expected} bytes: parts were lost on the way)")
        try:
            return json.loads(payload)
        except (ValueError, RecursionError) as exc:
            raise state.StateError(f"the state sent is not JSON ({type(exc).__name__})") \
                from None

    @staticmethod
    def _next_epoch(agg: Any) -> int:
        epochs = agg.series.get(wire.EPOCH)
        return max((r.epoch for r in epochs.rows), default=-1) + 1 if epochs else 0

    # -- records --------------------------------------------------------------------

    def records(self, header: wire.Header, values: RecordValues, now: float) -> None:
        """Aggregate one RECORDS message (see ``records_batch``)."""
        self.records_batch([(header, values)], now)

    def records_batch(self, messages: list[tuple[wire.Header, RecordValues]],
                      now: float) -> None:
        """Aggregate RECORDS messages (header, decoded records: records × RECORD_WIDTH)
        in the order they came. The accounting is per message (order, lost, dropped);
        the checks and the aggregation take each run's good records at once, so their
        cost is per record in arrays, not per record in Python. Bad records are rejected
        one by one; records of a run not known yet are held for its hello.
        """
        taken: dict[bytes, list[np.ndarray]] = {}
        for header, values in messages:
            records = np.asarray(values, dtype=np.int64).reshape(-1, wire.RECORD_WIDTH)
            stream = self.streams.get(header.run_id)
            if stream is None:
                self._hold(header, records, now)
                continue
            if not self._in_order(stream, header):
                continue
            split = stream.split
            split.dropped[stream.key] = max(split.dropped.get(stream.key, 0), header.dropped)
            lost = header.records_before - stream.received
            if lost > 0:
                split.lost[stream.key] = split.lost.get(stream.key, 0) + lost
                stream.received += lost  # counted once
            stream.received += len(records)
            split.received[stream.key] = stream.received
            taken.setdefault(header.run_id, []).append(records)
        for run_id, parts in taken.items():
            stream = self.streams[run_id]
            split = stream.split
            records = parts[0] if len(parts) == 1 else np.concatenate(parts)
            agg = split.rank(stream.rank)
            good = self._checked(stream, records, agg)
            if len(good) < len(records):
                self.reject("bad_record", "a record with an unknown phase, unknown flags, a "
                            "batch count off a loop record or end before start",
                            len(records) - len(good), split)
            agg.add_records(good)
            self.on_records(stream, good)
            self.records_received += len(good)
            split.dirty = True

    def _in_order(self, stream: Stream, header: wire.Header) -> bool:
        if header.seq <= stream.last_seq:
            self.reject("out_of_order", f"message {header.seq} after {stream.last_seq} from "
                        f"run {stream.key}", split=stream.split)
            return False
        stream.last_seq = header.seq
        return True

    @staticmethod
    def _checked(stream: Stream, records: np.ndarray, agg: RankAggregator) -> np.ndarray:
        """The good ones of ``records``, custom phase ids mapped to ``agg``'s keys (a copy
        when any is mapped or bad; ``records`` itself when all are good as they are)."""
        phase = records[:, P_PHASE]
        good = (phase > wire.TRAINING) & (phase <= LAST_STANDARD_ID)
        custom = phase >= wire.FIRST_CUSTOM_ID
        if custom.any():
            keys = stream.custom_keys(agg)
            ids, where = np.unique(phase[custom], return_inverse=True)
            mapped = np.array([keys.get(i, -1) for i in ids.tolist()], dtype=np.int64)[where]
            records = records.copy()
            records[custom, P_PHASE] = mapped
            good[custom] = mapped >= 0
        batches = records[:, P_BATCHES]
        good &= (records[:, P_FLAGS] & ~KNOWN_FLAGS) == 0
        good &= records[:, P_END] >= records[:, P_START]
        good &= (batches == 0) | ((batches > 0) & ((phase == wire.TRAINING_LOOP)
                                                  | (phase == wire.VALIDATION_LOOP)))
        return records if good.all() else records[good]

    def _hold(self, header: wire.Header, values: np.ndarray, now: float) -> None:
        if self._pending_records + len(values) > PENDING_RECORDS:
            self.reject("unknown_run", f"records for run {header.run_id.hex()} that never said "
                        "hello", len(values))
            return
        # a copy: a view would keep the whole read's decoded records alive
        self._pending.setdefault(header.run_id, []).append((now, header, values.copy()))
        self._pending_records += len(values)

    def _replay_pending(self, run_id: bytes) -> None:
        held = self._pending.pop(run_id, [])
        self._pending_records -= sum(len(values) for _, _, values in held)
        for now, header, values in held:
            self.records(header, values, now)

    def expire_pending(self, now: float) -> None:
        """Reject held records whose run's hello did not come within ``PENDING_S``."""
        for run_id, held in list(self._pending.items()):
            keep = [h for h in held if now - h[0] < PENDING_S]
            expired = sum(len(values) for arrived, _, values in held
                          if now - arrived >= PENDING_S)
            if expired:
                self.reject("unknown_run", f"records for run {run_id.hex()} that never said "
                            "hello", expired)
            self._pending_records -= expired
            if keep:
                self._pending[run_id] = keep
            else:
                del self._pending[run_id]

    # -- controls -------------------------------------------------------------------

    def stream_for(self, header: wire.Header, kind: str) -> Stream | None:
        """The stream of a control message, or None (rejected) for an unknown run."""
        stream = self.streams.get(header.run_id)
        if stream is None:
            self.reject("unknown_run", f"{kind} for run {header.run_id.hex()} that never said "
                        "hello")
        elif not self._in_order(stream, header):
            return None
        return stream

    def declare_phase(self, stream: Stream, body: dict[str, Any]) -> None:
        """A custom phase id and name: the name is the phase's identity in the split.
        WireError("malformed") for an id out of range or declared with another name, or a
        name that is empty, too long or a standard label's."""
        phase_id, name = _phase_id(body.get("id")), _phase_name(body.get("name"))
        if stream.custom_names.setdefault(phase_id, name) != name:
            raise wire.WireError("malformed", f"phase id {phase_id} declared again as {name!r}")

    def finish(self, stream: Stream, status: str, cause: str | None, end_ns: int | None,
               now: float) -> None:
        """The end of a stream's session: by its own finish or found dead by the server."""
        if stream.finished:
            return
        stream.finished = True
        split = stream.split
        split.rank(stream.rank).end_session(end_ns)
        split.set_status(status, cause)
        if all(s.finished for s in self.streams.values() if s.split is split):
            split.end_unix = now

    def live_streams(self) -> list[Stream]:
        """Streams whose process has not finished."""
        return [s for s in self.streams.values() if not s.finished]

    def prune(self, now: float, keep_s: float) -> list[Split]:
        """Forget splits that ended more than ``keep_s`` seconds ago and are written (a
        long-lived daemon must not grow with every job it served); returns them. Their
        files and state stay on disk for a resume.
        """
        gone = [split for key, split in self.splits.items()
                if split.end_unix is not None and now - split.end_unix > keep_s
                and not split.dirty and self.splits.get(key) is split]
        for split in gone:
            del self.splits[(split.out_dir, split.split)]
        ids = {id(split) for split in gone}
        for run_id in [r for r, s in self.streams.items() if id(s.split) in ids]:
            del self.streams[run_id]
        return gone

    def status(self) -> dict[str, Any]:
        """The status view (``sidecar status --json``)."""
        return {
            "pid": os.getpid(),
            "records": self.records_received,
            "dropped": self.dropped,
            "lost": sum(sum(s.lost.values()) for s in self.splits.values()),
            "rejected": sum(self.rejected.values()),
            "rejected_by_kind": dict(self.rejected),
            "last_error": self.last_error,
            "runs": [
                {"run_id": s.key, "out_dir": str(s.split.out_dir), "split": s.split.split,
                 "rank": s.rank, "pid": s.pid, "host": s.host, "records": s.received,
                 "status": "running" if not s.finished else s.split.status,
                 "write_error": s.split.write_error, "job_id": s.split.info.get("job_id"),
                 "user": s.owner.name if s.owner else s.split.info.get("user")}
                for s in self.streams.values()
            ],
        }
