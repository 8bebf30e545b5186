"""MLflow: the split's figures as metrics of an MLflow run, logged with MLflow's own
client (``MlflowClient.log_batch``), in batches, on the exports thread.

The run is the training script's active one (its id and tracking URI came with the
hello), else the run this exporter created in the experiment ``mlflow_experiment`` (the
run folder's name by default), found again after a resume by its ``trainmon.lineage``
tag. Resources use the names of MLflow's own system metrics (``system/...``), so its
System metrics tab shows them; phases go under ``phases/``, goodput under ``goodput/``;
at the end the run folder's files become artifacts under ``trainmon/``.

A tracking server that is down or slow never blocks the sidecar: each request is bounded
(``REQUEST_TIMEOUT_S``, MLflow's own retries off), the points not logged are kept and
retried with a backoff up to ``MAX_PENDING`` points (the oldest beyond it are given up
and counted). A request that got no answer (it timed out, or the connection broke once
sent) may have been applied: its points are *not confirmed* (``unconfirmed``), retried
like the others, and never counted as lost; one the server refused, or that never
reached it, is not exported until a retry works.

MLflow's SQL stores keep one metric per (name, step, millisecond, value) of a run, and
drop the others silently. Two rows of one phase can share all four (validation
iterations of one step, microseconds long, equal to the timer's 10 ns): each point gets
a timestamp of its own (``Timestamps``), the next free millisecond, when it would share
one. A point is stamped once, when queued, so a request sent again after a timeout
repeats the same points, which a SQL store then keeps once.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import requests

from sidecar.exports.points import (
    Names,
    Slice,
    Stamped,
    Timestamps,
    cpu_share_pct,
    every_point,
    memory_used_pct,
    scaled,
)

# Bounded requests, no retry loop inside the client: the exporter retries itself.
REQUEST_TIMEOUT_S = 5
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")

from mlflow.entities import Metric  # noqa: E402  (after the settings above)
from mlflow.tracking import MlflowClient  # noqa: E402

BATCH = 1000  # MLflow's limit of metrics per log_batch
MAX_PENDING = 1_000_000  # points kept for a retry; older ones are given up beyond it
BACKOFF_S = (1.0, 2.0, 5.0, 10.0)  # after 1, 2, ... failures in a row
LINEAGE_TAG = "trainmon.lineage"
MB_PER_MIB = 1.048576  # MLflow's system metrics count megabytes of 10⁶ bytes


GPU_NAMES: Names = {
    "system/gpu_{i}_utilization_percentage": scaled("util_pct"),
    "system/gpu_{i}_memory_usage_megabytes": scaled("mem_used_mib", MB_PER_MIB),
    "system/gpu_{i}_memory_usage_percentage": memory_used_pct,
    "system/gpu_{i}_power_usage_watts": scaled("power_w"),
    "system/gpu_{i}_temperature_celsius": scaled("temperature_c"),
    "system/gpu_{i}_job_memory_megabytes": scaled("job_mem_mib", MB_PER_MIB),
}
HOST_NAMES: Names = {
    "system/cpu_utilization_percentage": cpu_share_pct,
    "system/system_memory_usage_percentage": scaled("system_mem_used_pct"),
    "system/job_memory_rss_megabytes": scaled("rss_mib", MB_PER_MIB),
}
_END_STATUS = {"completed": "FINISHED", "failed": "FAILED", "incomplete": "KILLED"}


class MlflowExporter:
    """Metrics of one split into one MLflow run, retried while the server is away."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.client = MlflowClient(tracking_uri=settings["mlflow_tracking_uri"])
        self.run_id: str | None = settings["mlflow_run_id"]
        self._own_run = False
        self.exported = 0
        self.awaiting = 0  # a request's answer confirms its points: nothing confirmed later
        self.dropped = 0
        self.error: str | None = None
        self._pending: deque[Stamped] = deque()
        self._timestamps = Timestamps()
        self._files: list[Any] = []
        self._end_status: str | None = None
        self._failures = 0  # in a row (the backoff)
        self.failed_attempts = 0
        self._next_try = 0.0
        # the first points of ``_pending`` sent in a request that got no answer
        self._unanswered = 0
        self._in_flight = 0  # the points of the request being made now
        self._unanswered_given_up = 0  # of ``dropped``: given up, but maybe applied

    @property
    def unconfirmed(self) -> int:
        """Of the points kept (``pending``) or given up (``dropped``), those sent with no
        answer: in a request under way, or one that timed out or broke once sent (the
        store may hold them); retried while kept."""
        return max(self._unanswered, self._in_flight) + self._unanswered_given_up

    def where(self) -> str:
        """The run and the tracking server."""
        return f"MLflow run {self.run_id or '(not created yet)'} at {self.client.tracking_uri}"

    def pending(self) -> int:
        """Points (and files, at the end) kept for a retry."""
        return len(self._pending) + len(self._files)

    def export(self, part: Slice) -> None:
        """Queue ``part``'s points (and, at the end, its files) and send what is queued."""
        stamp = self._timestamps.stamp
        self._pending.extend(stamp(p) for p in every_point(part, GPU_NAMES, HOST_NAMES))
        over = max(len(self._pending) - MAX_PENDING, 0)
        for _ in range(over):
            self._pending.popleft()
        unanswered = min(over, self._unanswered)
        self._unanswered -= unanswered
        self._unanswered_given_up += unanswered
        self.dropped += over
        if part.final:
            self._files = [path for path in part.files if path.is_file()]
            self._end_status = _END_STATUS.get(part.status)
        if self._lineage is None:
            self._lineage = part.lineage
        self._send()

    _lineage: str | None = None

    def retry(self, now_mono: float) -> None:
        """Send what is kept, when the backoff after the last failure is over."""
        if now_mono >= self._next_try:
            self._send()

    def _send(self) -> None:
        try:
            run_id = self._run()
            while self._pending:
                batch = [self._pending[i] for i in range(min(BATCH, len(self._pending)))]
                metrics = [Metric(name, value, ms, step) for name, value, step, ms in batch]
                self._in_flight = len(batch)
                try:
                    self.client.log_batch(run_id, metrics=metrics, synchronous=True)
                except Exception as exc:
                    if maybe_applied(exc):
                        self._unanswered = max(self._unanswered, len(batch))
                    raise
                finally:
                    self._in_flight = 0
                for _ in batch:
                    self._pending.popleft()
                self._unanswered = max(self._unanswered - len(batch), 0)
                self.exported += len(batch)
            while self._files:
                self.client.log_artifact(run_id, str(self._files[0]), artifact_path="trainmon")
                self._files.pop(0)
            if self._end_status is not None and self._own_run:
                self.client.set_terminated(run_id, self._end_status)
                self._end_status = None
        except Exception as exc:  # the client raises MlflowException, requests' errors, OSError
            self._failures += 1
            self.failed_attempts += 1
            wait_s = BACKOFF_S[min(self._failures, len(BACKOFF_S)) - 1]
            self._next_try = time.monotonic() + wait_s
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        else:
            self._failures = 0
            self.error = None

    def _run(self) -> str:
        """The run to log into: the script's, else ours (found by lineage, else created)."""
        if self.run_id is not None:
            return self.run_id
        name = self.settings["mlflow_experiment"]
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{LINEAGE_TAG}` = '{self._lineage}' and "
            f"tags.`trainmon.split` = '{self.settings['split']}'",
            max_results=1,
        )
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(
                experiment_id,
                run_name=self.settings["name"],
                tags={
                    LINEAGE_TAG: str(self._lineage),
                    "trainmon.split": str(self.settings["split"]),
                },
            )
            self.run_id = run.info.run_id
        self._own_run = True
        return self.run_id

    def close(self) -> None:
        """Nothing held open (the client is stateless between requests)."""


def maybe_applied(exc: BaseException) -> bool:
    """Whether a failed request may have been applied by the server: it was sent and
    no answer came (a read timeout, a connection broken after sending). A refused
    connection, a connect timeout or an error answer mean it was not."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, requests.exceptions.ConnectTimeout):
            return False
        if isinstance(seen, requests.exceptions.ReadTimeout | TimeoutError):
            return True
        if isinstance(seen, requests.exceptions.ConnectionError):
            text = str(seen)
            return "Connection refused" not in text and "NewConnectionError" not in text
        seen = seen.__cause__ or seen.__context__
    return False
