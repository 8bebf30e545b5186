"""What the sidecar knows of its clients: one stream per training process (run id), the
splits they feed, and the counts of rejected input. Decoded messages come in here from
``sidecar.ingest.receiver``; writing is left to the server.

``Registry`` is the facade the server and the dispatcher use; the work is in
``hello`` (what a hello says, checked), ``resume`` (state restored, lineage and folder
claims), ``payload`` (parts of a large request), ``pending`` (records held for a hello)
and ``stream`` (one process). The records' checks stay here, on arrays.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from markers import wire
from markers.wire import P_BATCHES, P_END, P_FLAGS, P_PHASE, P_START
from sidecar.ingest import resume
from sidecar.ingest.hello_check import Hello, Refused, declarations, phase_id, phase_name
from sidecar.ingest.peers import Peer
from sidecar.ingest.pending import Pending
from sidecar.ingest.resume import Claim, Lineage
from sidecar.ingest.startup import note_startup
from sidecar.ingest.stream import HOSTNAME, Stream
from sidecar.model.aggregator import RankAggregator, RecordValues
from sidecar.model.split import RankInfo, Split

log = logging.getLogger("sidecar")

LAST_STANDARD_ID = wire.LAST_STANDARD_ID  # standard ids are 1 (Training is derived) to this
KNOWN_FLAGS = (
    wire.FLAG_IN_ITERATION
    | wire.FLAG_VALIDATION
    | wire.FLAG_GPU_DROPPED
    | wire.FLAG_INCOMPLETE
    | wire.FLAG_BEGIN
)


class Registry:
    """Streams, splits and reject counts. The daemon supplies its policy and the sinks'
    knowledge as callables: ``resolve_out_dir(out_dir, cwd, owner)`` places a run's folder
    for the user ``owner`` (a Peer, or None when unknown; raises Refused),
    ``previous_activity(folder, split)`` tells when the split's last process was last
    heard of (Unix s, from the run folder; None when unknown), ``claim(split_dir, rank)``
    takes a rank of the split for this sidecar (raises Refused when another live sidecar
    holds it; None when the folder cannot be used now, the writes will say why), ``alive(stream)``
    whether a stream's process still lives (False only when known to be gone).

    One writer per split and rank (docs/contract.md): a hello for a split and rank that a
    live run of this sidecar feeds, or that another sidecar claimed, is refused; other
    ranks of the split may be served by other sidecars (docs/multi-node.md). A resume
    takes only a state of the lineage of the last run started on the split
    (``resume.Lineage``).
    """

    def __init__(
        self,
        resolve_out_dir: Callable[[str, str, Peer | None], Path],
        on_stream: Callable[[Stream], None] = lambda stream: None,
        on_records: Callable[[Stream, np.ndarray], None] = lambda stream, values: None,
        previous_activity: Callable[[Path, int], float | None] = lambda f, s: None,
        claim: Callable[[Path, int], Claim | None] = lambda split_dir, rank: None,
        alive: Callable[[Stream], bool] = lambda stream: True,
    ) -> None:
        self.resolve_out_dir = resolve_out_dir
        self.previous_activity = previous_activity
        self.alive = alive
        self.lineage = Lineage(claim)
        self.on_stream = on_stream  # a new training process said hello
        self.on_records = on_records  # good records of a stream, after aggregation
        self.streams: dict[bytes, Stream] = {}
        self.splits: dict[tuple[Path, int], Split] = {}
        self.rejected: Counter[str] = Counter()
        self.records_received = 0
        self.last_error: str | None = None  # the latest refusal or write error, for status
        self.pending = Pending()

    # -- rejects --------------------------------------------------------------------

    def reject(self, kind: str, detail: str, count: int = 1, split: Split | None = None) -> None:
        """Count ``count`` rejected records/messages of ``kind``; log the first of each kind."""
        if not self.rejected[kind]:
            log.warning(
                "rejected %s: %s (further ones of this kind are counted, not logged)", kind, detail
            )
        self.rejected[kind] += count
        if split is not None:
            split.rejected += count
            split.dirty = True

    @property
    def dropped(self) -> int:
        """Records the markers of every split could not send, as they reported."""
        return sum(sum(s.dropped.values()) for s in self.splits.values())

    # -- hello ----------------------------------------------------------------------

    def hello(
        self, header: wire.Header, body: dict[str, Any], now_unix: float, owner: Peer | None = None
    ) -> dict[str, Any]:
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
        declarations(body)  # checked before anything changes
        asked = Hello.parse(body, now_unix)
        folder = self.resolve_out_dir(asked.out_dir, asked.cwd, owner)
        key = (folder, asked.split)
        split = self.splits.get(key)
        self._one_writer(key, split, header.rank)
        previous_end = self.previous_activity(folder, asked.split)
        old = split.ranks.get(header.rank) if split is not None else None
        if old is not None and old.sessions:
            previous_end = max(previous_end or 0.0, old.sessions[-1].last_unix)
        if split is None or (not asked.resume and header.rank in split.ranks):
            split = self.splits[key] = Split(folder, asked.split, asked.settings, asked.info)
        split.settings = asked.settings
        split.status, split.cause, split.end_unix = "running", None, None
        stream = Stream(
            header.run_id,
            split,
            header.rank,
            asked.pid,
            asked.host,
            asked.start_unix,
            asked.start_ns,
            previous_end,
            owner=owner,
        )
        agg, warning = (
            resume.resume_from_folder(stream, self.lineage, now_unix, asked.repeat)
            if asked.resume
            else (None, None)
        )
        if agg is None:
            agg = split.fresh_rank(header.rank) if asked.resume else split.rank(header.rank)
            agg.begin_session(asked.start_unix, asked.start_ns, stream.key)
            if asked.repeat:
                split.gaps.append((asked.start_unix, now_unix))
        if warning:
            log.warning("run %s: %s", header.run_id.hex(), warning)
        self.streams[header.run_id] = stream
        split.rank_info[header.rank] = RankInfo(asked.host or HOSTNAME)
        self._hello_news(stream, body)
        self.lineage.record(stream, agg)
        split.dirty = True
        self.on_stream(stream)
        for arrived, held_header, values in self.pending.take(header.run_id):
            self.records(held_header, values, arrived)
        reply: dict[str, Any] = {
            "ok": True,
            "session": agg.sessions[-1].number,
            "epoch": resume.next_epoch(agg),
            "out_dir": str(folder),
        }
        if warning:
            reply["warning"] = warning
        return reply

    def _hello_news(self, stream: Stream, body: dict[str, Any]) -> None:
        """What a (repeated) hello tells of a known process: its custom phases (a sidecar
        that took over never saw their declarations) and its DataLoader workers' phases."""
        stream.custom_names.update(declarations(body))
        self.note_worker_phases(stream, body.get("worker_phases"))
        note_startup(stream.split.rank(stream.rank).sessions[-1], body, stream.start_unix)

    def note_worker_phases(self, stream: Stream, count: Any) -> None:
        """The phases timed in ``stream``'s DataLoader workers so far (a running total;
        ignored unless a non-negative integer)."""
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            session = stream.split.rank(stream.rank).sessions[-1]
            if count > session.worker_phases:
                session.worker_phases = count
                stream.split.dirty = True

    @staticmethod
    def note_gpu_unfinished(stream: Stream, count: Any) -> None:
        """The phases of ``stream`` whose GPU time had not come when the markers' bounded
        wait at finish ended (ignored unless a positive integer)."""
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            stream.split.rank(stream.rank).sessions[-1].gpu_unfinished = count
            stream.split.dirty = True

    @staticmethod
    def note_loop(stream: Stream, start_ns: Any, end_ns: Any) -> None:
        """The framework's own training loop of ``stream``'s process ran from ``start_ns``
        to ``end_ns`` (its ``perf_counter_ns``; ignored unless both are integers in order)."""
        integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (start_ns, end_ns))
        if integers and start_ns <= end_ns:
            session = stream.split.rank(stream.rank).sessions[-1]
            session.loop_start_ns, session.loop_end_ns = start_ns, end_ns
            stream.split.dirty = True

    def load_state(self, stream: Stream, saved: Any) -> dict[str, Any]:
        """A ``load_state`` control (``resume.load_state``): continue ``stream``'s split
        from a state the user kept; the reply says the epoch to go on from, or why not."""
        return resume.load_state(stream, saved, self.lineage)

    def _one_writer(self, key: tuple[Path, int], split: Split | None, rank: int) -> None:
        """Refuse a second live writer of the split (Refused); claim its folder."""
        for other in self.streams.values():
            if other.split is not split or other.rank != rank or other.finished:
                continue
            if not self.alive(other):  # killed and restarted faster than the liveness check
                self.finish(
                    other,
                    "incomplete",
                    f"process {other.pid} ended without finish()",
                    None,
                    other.split.rank(rank).sessions[-1].last_unix,
                )
                continue
            raise Refused(
                f"split {key[1]} of {key[0]} (rank {rank}) is being written by "
                f"run {other.key[:8]} (pid {other.pid} on {other.host}) under this "
                "sidecar; one writer per split and rank: this run is not monitored"
            )
        self.lineage.take(key, rank)

    def release(self, split: Split) -> None:
        """Give up the claim on ``split``'s folder once none of its runs is live."""
        if not any(s.split is split and not s.finished for s in self.streams.values()):
            self.lineage.release(split)

    # -- records --------------------------------------------------------------------

    def records(self, header: wire.Header, values: RecordValues, now_unix: float) -> None:
        """Aggregate one RECORDS message (see ``records_batch``)."""
        self.records_batch([(header, values)], now_unix)

    def records_batch(
        self, messages: Sequence[tuple[wire.Header, RecordValues]], now_unix: float
    ) -> None:
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
                self._hold(header, records, now_unix)
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
            records = parts[0] if len(parts) == 1 else _joined(parts)
            agg = split.rank(stream.rank)
            good = self._checked(stream, records, agg)
            if len(good) < len(records):
                self.reject(
                    "bad_record",
                    "a record with an unknown phase, unknown flags, a "
                    "batch count off a loop record or end before start",
                    len(records) - len(good),
                    split,
                )
            agg.add_records(good)
            self.on_records(stream, good)
            self.records_received += len(good)
            split.dirty = True

    def _in_order(self, stream: Stream, header: wire.Header) -> bool:
        if header.seq <= stream.last_seq:
            self.reject(
                "out_of_order",
                f"message {header.seq} after {stream.last_seq} from run {stream.key}",
                split=stream.split,
            )
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
        good &= (batches == 0) | (
            (batches > 0) & ((phase == wire.TRAINING_LOOP) | (phase == wire.VALIDATION_LOOP))
        )
        return records if good.all() else records[good]

    def _hold(self, header: wire.Header, values: np.ndarray, now_unix: float) -> None:
        if not self.pending.hold(header, values, now_unix):
            self.reject(
                "unknown_run",
                f"records for run {header.run_id.hex()} that never said hello",
                len(values),
            )

    def expire_pending(self, now_unix: float) -> None:
        """Reject held records whose run's hello did not come in time (``pending``)."""
        for run_id, expired in self.pending.expire(now_unix).items():
            self.reject(
                "unknown_run", f"records for run {run_id.hex()} that never said hello", expired
            )

    # -- controls -------------------------------------------------------------------

    def stream_for(self, header: wire.Header, kind: str) -> Stream | None:
        """The stream of a control message, or None (rejected) for an unknown run."""
        stream = self.streams.get(header.run_id)
        if stream is None:
            self.reject(
                "unknown_run", f"{kind} for run {header.run_id.hex()} that never said hello"
            )
        elif not self._in_order(stream, header):
            return None
        return stream

    def declare_phase(self, stream: Stream, body: dict[str, Any]) -> None:
        """A custom phase id and name: the name is the phase's identity in the split.
        WireError("malformed") for an id out of range or declared with another name, or a
        name that is empty, too long or a standard label's."""
        number, name = phase_id(body.get("id")), phase_name(body.get("name"))
        if stream.custom_names.setdefault(number, name) != name:
            raise wire.WireError("malformed", f"phase id {number} declared again as {name!r}")

    def finish(
        self, stream: Stream, status: str, cause: str | None, end_ns: int | None, now_unix: float
    ) -> None:
        """The end of a stream's session: by its own finish or found dead by the server."""
        if stream.finished:
            return
        stream.finished = True
        split = stream.split
        split.rank(stream.rank).end_session(end_ns)
        split.set_status(status, cause)
        split.rank_info[stream.rank] = RankInfo(stream.host or HOSTNAME, status, cause)
        if all(s.finished for s in self.streams.values() if s.split is split):
            split.end_unix = now_unix

    def live_streams(self) -> list[Stream]:
        """Streams whose process has not finished."""
        return [s for s in self.streams.values() if not s.finished]

    def prune(self, now_unix: float, keep_s: float) -> list[Split]:
        """Forget splits that ended more than ``keep_s`` seconds ago and are written (a
        long-lived daemon must not grow with every job it served); returns them. Their
        files and state stay on disk for a resume.
        """
        gone = [
            split
            for key, split in self.splits.items()
            if split.end_unix is not None
            and now_unix - split.end_unix > keep_s
            and not split.dirty
            and self.splits.get(key) is split
        ]
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
            "lost": sum(s.record_counts().lost for s in self.splits.values()),
            "rejected": sum(self.rejected.values()),
            "rejected_by_kind": dict(self.rejected),
            "last_error": self.last_error,
            "runs": [
                {
                    "run_id": s.key,
                    "out_dir": str(s.split.out_dir),
                    "split": s.split.split,
                    "rank": s.rank,
                    "pid": s.pid,
                    "host": s.host,
                    "records": s.received,
                    "status": "running" if not s.finished else s.split.status,
                    "write_error": s.split.write_error,
                    "job_id": s.split.info.get("job_id"),
                    "user": s.owner.name if s.owner else s.split.info.get("user"),
                }
                for s in self.streams.values()
            ],
        }


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` (records × width each) one after another, in column order as the decoder
    gives them (the aggregation reads them column by column). Consecutive rows of one
    decoded read, the usual case (one sender's messages of one read), are taken as a view:
    a copy of a read's records cost a tenth of the ingest."""
    base = parts[0].base
    if (
        isinstance(base, np.ndarray)
        and base.ndim == 2
        and all(part.base is base and part.strides == base.strides for part in parts)
    ):
        # Each part's first row in ``base`` (a row is one item along its first axis).
        firsts = [(part.ctypes.data - base.ctypes.data) // base.strides[0] for part in parts]
        if all(a + len(p) == b for a, p, b in zip(firsts, parts, firsts[1:], strict=False)):
            return base[firsts[0] : firsts[-1] + len(parts[-1])]
    out = np.empty((sum(map(len, parts)), wire.RECORD_WIDTH), dtype=np.int64, order="F")
    return np.concatenate(parts, out=out)
