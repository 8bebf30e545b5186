"""Daemon snapshots for the tests of what reads them (the exporter, sd_notify): an idle
daemon's figures, the fields a test cares about given by name."""

from __future__ import annotations

from typing import Any

from sidecar.daemon.snapshot import Snapshot, SplitView


def snapshot(*splits: SplitView, **fields: Any) -> Snapshot:
    """A snapshot exporting ``splits``, of a daemon with no record, run, error or sampler
    yet (its loop at monotonic 0, samplers set up); ``fields`` set any other field."""
    idle: dict[str, Any] = {
        "pid": 1,
        "endpoint": "ipc://x",
        "root": None,
        "taken_unix": 0.0,
        "loop_monotonic": 0.0,
        "sampler_round_monotonic": None,
        "samplers_started": True,
        "records": 0,
        "dropped": 0,
        "lost": 0,
        "rejected": 0,
        "rejected_by_kind": {},
        "last_error": None,
        "records_per_s": 0.0,
        "rate_window_s": 0.0,
        "samplers": {},
        "runs": (),
    }
    return Snapshot(**{**idle, "splits": splits, **fields})
