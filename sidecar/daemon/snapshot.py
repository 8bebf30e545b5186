"""The frozen view of a sidecar that its loop publishes each tick. Readers on other threads
(``/metrics``) and the status control read a snapshot, never live state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RunView:
    """One training process (stream) as the status view shows it."""

    run_id: str  # hex
    out_dir: str
    split: int
    rank: int
    pid: int
    host: str
    records: int  # records received from it
    status: str  # running, completed, failed, incomplete
    write_error: str | None
    job_id: str | None  # the Slurm job id the run reported
    user: str | None  # the kernel's word on an ipc socket, else what the run reported


@dataclass(frozen=True)
class Snapshot:
    """The sidecar at one turn of its loop. Counts are records since the sidecar started."""

    pid: int
    endpoint: str
    root: str | None
    taken_unix: float  # wall clock when taken
    loop_monotonic: float  # time.monotonic() of the loop turn that took it
    sampler_round_monotonic: float | None  # when the samplers last completed a round
    samplers_started: bool  # every sampler is set up (NVML opened, or found unavailable)
    records: int
    dropped: int
    lost: int
    rejected: int
    rejected_by_kind: dict[str, int]
    last_error: str | None
    records_per_s: float  # over the trailing window below
    rate_window_s: float  # seconds the record rate covers (up to RATE_WINDOW_S)
    samplers: dict[str, Any]  # host, gpu (on / off with the reason), interval_s
    runs: tuple[RunView, ...]

    def as_status(self) -> dict[str, Any]:
        """The status view (``sidecar status --json``): JSON-compatible."""
        view = asdict(self)
        view["runs"] = [asdict(run) for run in self.runs]
        return view
