"""How a run ends when it does not say so itself: its process found gone (the death
watch's time when known), its remote connection dropped, its Slurm job ended; each such
run is ended as incomplete and its split written."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sidecar.daemon import slurm_jobs
from sidecar.daemon.access import Access
from sidecar.daemon.deaths import DeathWatch
from sidecar.daemon.liveness import gone_cause, pid_alive
from sidecar.ingest.peers import Peer
from sidecar.ingest.stream import Stream
from sidecar.ingest.streams import Registry
from sidecar.model.split import Split

log = logging.getLogger("sidecar")

LIVENESS_S = 0.4  # a process found gone is declared dead on the next check


class RunEndings:
    """Ends the runs of ``registry`` whose process, connection or job is gone; ``write``
    writes a split (``SplitWrites.write``). ``heartbeat_s``: after how long a silent
    remote client is dropped (said in the cause)."""

    def __init__(
        self,
        registry: Registry,
        access: Access,
        write: Callable[[Split], object],
        heartbeat_s: float,
    ) -> None:
        self.registry = registry
        self.access = access
        self._write = write
        self.heartbeat_s = heartbeat_s
        self._gone: dict[bytes, float] = {}  # run id -> when its process was first seen gone
        self.deaths = DeathWatch()  # when a local run's process died, to the millisecond
        # Runs whose hello was answered with a refusal: their connection ends, not dropped.
        self.sent_away: deque[bytes] = deque(maxlen=1024)

    def connection_lost(self, run_id: bytes, now_unix: float) -> bool:
        """A run's connection ended without a goodbye: a local run is left to the liveness
        check (True when its process is gone); a remote one, which only its connection
        tells of (ZMTP heartbeats drop a dead or unreachable host), ends with it. The
        connection of a run whose hello was refused ends as the markers hang up.
        """
        stream = self.registry.streams.get(run_id)
        if stream is None:
            return run_id in self.sent_away
        if stream.is_local():
            return not pid_alive(stream.pid)
        if not stream.finished:
            self.end_stream(
                stream,
                f"the connection from {stream.host or 'its host'} ended "
                f"without finish() (no heartbeat answered within "
                f"{self.heartbeat_s:g} s, or closed)",
                now_unix,
            )
        return True

    def check_processes(self, now_unix: float, job_cause: str | None) -> None:
        """Declare incomplete every local run whose process is gone without finishing;
        ``job_cause``: the end of the job of ``sidecar run``, when it ended (their cause)."""
        for stream in self.registry.live_streams():
            if not stream.is_local() or pid_alive(stream.pid):
                self._gone.pop(stream.run_id, None)
                continue
            first_seen = self._gone.setdefault(stream.run_id, now_unix)
            if now_unix - first_seen < LIVENESS_S:
                continue  # its last messages may still be on the way
            cause = job_cause or gone_cause(stream.pid)
            self.end_stream(stream, cause, now_unix, first_seen)

    def end_stream(
        self, stream: Stream, cause: str, now_unix: float, gone_unix: float | None = None
    ) -> None:
        """End ``stream`` as incomplete, at its process's death when known (the death watch;
        else ``gone_unix``, when it was first seen gone), else at its last record: the
        records of its last moments may have died with it, and the work after its last
        checkpoint (redone at a resume) runs up to its death."""
        log.warning("run %s (pid %d): %s; files marked incomplete", stream.key, stream.pid, cause)
        died = self.deaths.died_at(stream.run_id)
        died = died if died is not None else gone_unix
        session = stream.split.rank(stream.rank).sessions[-1]
        end_ns = None if died is None else max(session.last_ns, session.ns_at(died))
        self.registry.finish(stream, "incomplete", cause, end_ns, now_unix)
        self.deaths.forget(stream.run_id)
        self._write(stream.split)

    def finish_job(self, job_id: str, caller: Peer | None) -> dict[str, Any]:
        """End the running runs of Slurm job ``job_id`` that ``caller`` may end (on a
        shared daemon its own, root all) as incomplete and write them; the reply says how
        many (the Slurm epilog: ``sidecar finish --job``). Runs of the job whose process was
        found gone just before (Slurm kills a job's processes before its epilog) take the
        job's end as their cause and are written again."""
        now_unix = time.time()
        cause = f"Slurm job {job_id} ended"
        ended = 0
        for stream in list(self.registry.streams.values()):
            if stream.split.info.get("job_id") != job_id:
                continue
            if not self.access.may_end(caller, stream):
                continue
            if not stream.finished:
                self.end_stream(stream, cause, now_unix)
            elif slurm_jobs.ended_by_job(stream.split, gone_cause(stream.pid), cause, now_unix):
                self._write(stream.split)
            else:
                continue
            ended += 1
        return {"ok": True, "finished": ended}
