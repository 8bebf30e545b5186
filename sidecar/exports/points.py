"""What one write of a split adds to its exports, taken on the sidecar's loop thread as
references (``Slice``: no row is copied or formatted there), and turned into points on
the exporters' thread (``phase_points``, ``resource_points``, ``goodput_points``).

A point is ``(name, value, step, wall unix s)``. The step is the optimizer step counted
from the run's start across resumes (``Session.first_step`` + the iteration number):

* a training iteration's rows: its own step;
* any other row (validation, epochs, custom phases outside iterations) and a resource
  sample: the step in progress at its start (the last training iteration begun then,
  from ``StepTimeline``), the session's first step before any.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from markers import wire
from markers.wire import P_FLAGS, P_ITERATION, P_START
from sidecar.model.aggregator import RankAggregator
from sidecar.model.goodput import Account
from sidecar.model.series import Row
from sidecar.model.units import NS_PER_S
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml_gpu import GpuSample
from sidecar.sinks import layout

Point = tuple[str, float, int, float]  # name, value, optimizer step, wall time (Unix s)
Stamped = tuple[str, float, int, int]  # name, value, optimizer step, timestamp (Unix ms)
PHASE_PREFIX = "phases/"  # every phase figure's name starts with it (docs/exports.md)
THROUGHPUT_PREFIX = "throughput/"  # and every throughput figure's
_TRAINING_KIND = wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION
_METRIC = {row.phase: row.metric for row in wire.PHASES}
_TRAINING_PHASES = frozenset(r.phase for r in layout.TRAIN_ROWS if r.capped)


def slug(name: str) -> str:
    """A custom phase name as a metric name part: lower case, runs of characters other
    than letters, digits, '-' and '.' as one '_'."""
    return re.sub(r"[^a-z0-9.\-]+", "_", name.lower()).strip("_") or "_"


class StepTimeline:
    """When each training iteration of a split began (Unix s) and its step, learnt from
    the records as they arrive: one entry per iteration, appended in order."""

    def __init__(self) -> None:
        self._starts: list[np.ndarray] = []
        self._steps: list[np.ndarray] = []
        self._last_step = -1

    def note(self, agg: RankAggregator, records: np.ndarray) -> None:
        """Take the training iterations ``records`` (records × RECORD_WIDTH of ``agg``'s
        current session) begin; one mask and one ``unique`` per read."""
        session = agg.sessions[-1]
        training = (records[:, P_FLAGS] & _TRAINING_KIND) == wire.FLAG_IN_ITERATION
        if not training.any():
            return
        iterations, first = np.unique(records[training, P_ITERATION], return_index=True)
        steps = iterations + session.first_step
        new = steps > self._last_step
        if not new.any():
            return
        starts_ns = records[training, P_START][first[new]]
        self._starts.append(session.start_unix + (starts_ns - session.start_ns) / NS_PER_S)
        self._steps.append(steps[new])
        self._last_step = int(steps[new][-1])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(start Unix s, step) of every iteration noted, in order (joined once here)."""
        if len(self._starts) > 1:
            self._starts = [np.concatenate(self._starts)]
            self._steps = [np.concatenate(self._steps)]
        if not self._starts:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        return self._starts[0], self._steps[0]


@dataclass
class Slice:
    """What one write of a split adds to its exports: the stored rows and resource samples
    new since the last slice (references), the step axis, and the goodput account at a
    checkpoint or the end. Built by ``sidecar.exports.feed`` on the loop thread."""

    split_dir: Any  # Path of training/split-<k>/
    out_dir: Any  # Path of the run folder
    lineage: str  # the run id of the split's first session: one MLflow run per lineage
    rows: dict[tuple[int, str], list[Row]]  # (phase, its name) -> rows new since the last
    first_steps: dict[int, int]  # session number -> its first step
    session_starts: list[tuple[float, int]]  # each session's start (Unix s), first step
    # at the first slice of a session: the rows the store keeps of the earlier ones
    earlier_rows: dict[tuple[int, str], list[Row]]
    run_start_unix: float
    timeline: tuple[np.ndarray, np.ndarray]
    gpu_samples: list[GpuSample]  # new since the last slice
    host_samples: list[HostSample]
    run_start_ns: int
    step_now: int
    now_unix: float
    cpu_count: int  # the host's logical CPUs: the job's CPU as a share of the machine
    rank_gpu_index: int  # the GPU the exported rank's allocator peaks are of
    goodput: Account | None = None  # at a checkpoint write and at the end
    final: bool = False  # the split ended: its files are complete
    status: str = "running"  # the split's status (run.json's)
    files: list[Any] = field(default_factory=list)  # the run files (Paths), at the end

    def step_at(self, unix: float) -> int:
        """The step in progress at ``unix``: the last training iteration begun then, or
        the first step of the session running then when it began none yet."""
        starts, steps = self.timeline
        i = int(np.searchsorted(starts, unix, side="right")) - 1
        begun = [first for start, first in self.session_starts if start <= unix]
        session_first = begun[-1] if begun else 0
        return max(int(steps[i]), session_first) if i >= 0 else session_first

    def sample_unix(self, t_ns: int) -> float:
        """A resource sample's monotonic time as Unix s."""
        return self.run_start_unix + (t_ns - self.run_start_ns) / NS_PER_S


def phase_name(phase: int, name: str, what: str) -> str:
    """The exported name of a phase figure: ``phases/<metric>_<what>`` (``what``: wall_s,
    gpu_s, gpu_max_memory_mib), custom phases under ``phases/custom/``."""
    metric = _METRIC.get(phase)
    return f"{PHASE_PREFIX}{metric if metric else 'custom/' + slug(name)}_{what}"


def phase_points(part: Slice, earlier: bool = False) -> Iterator[Point]:
    """One point per stored row of each phase (its wall time, and on a GPU its GPU time
    and peak memory), and the throughput of each stored loop row (samples / wall s); of
    the rows new in ``part``, or (``earlier``) those of its earlier sessions."""
    for (phase, name), rows in (part.earlier_rows if earlier else part.rows).items():
        training = phase in _TRAINING_PHASES
        wall_name = phase_name(phase, name, "wall_s")
        gpu_name = phase_name(phase, name, "gpu_s")
        peak_name = phase_name(phase, name, "gpu_max_memory_mib")
        throughput = {
            wire.TRAINING_LOOP: "throughput/training_samples_per_s",
            wire.VALIDATION_LOOP: "throughput/validation_samples_per_s",
        }.get(phase)
        for row in rows:
            start_unix = part.run_start_unix + row.start_s
            if training:
                step = part.first_steps.get(row.session, 0) + row.iteration
            else:
                step = part.step_at(start_unix)
            wall = start_unix + row.wall_s
            yield wall_name, row.wall_s, step, wall
            if row.gpu_s is not None:
                yield gpu_name, row.gpu_s, step, wall
            if row.peak_mib is not None:
                yield peak_name, row.peak_mib, step, wall
            if throughput is not None and row.samples is not None and row.wall_s > 0:
                yield throughput, row.samples / row.wall_s, step, wall


# How a resource field becomes a point: (name template with {i} for the GPU index, the
# value from the sample and the slice). Each exporter gives its own table.
Names = dict[str, Callable[[Any, Slice], float | None]]


def resource_points(part: Slice, gpu: Names, host: Names) -> Iterator[Point]:
    """One point per resource sample and named field (``gpu``/``host``: name template ->
    value of a sample, None: not known), at the step in progress when it was taken."""
    for samples, names in ((part.gpu_samples, gpu), (part.host_samples, host)):
        for sample in samples:
            wall = part.sample_unix(sample.t_ns)
            step = part.step_at(wall)
            index = getattr(sample, "gpu_index", 0)
            for template, value_of in names.items():
                value = value_of(sample, part)
                if value is not None and value == value:  # NaN: not read
                    yield template.format(i=index), float(value), step, wall


def goodput_points(part: Slice) -> list[Point]:
    """The goodput parts (seconds) and the productive share (%) at the current step, when
    the slice holds an account (checkpoints and the end)."""
    account = part.goodput
    if account is None:
        return []
    out: list[Point] = [
        (f"goodput/{cause}_s", value, part.step_now, part.now_unix)
        for cause, value in account.parts().items()
    ]
    out.append(("goodput/wall_s", account.wall_s, part.step_now, part.now_unix))
    if account.wall_s > 0:
        share = account.productive_s / account.wall_s * 100
        out.append(("goodput/productive_pct", share, part.step_now, part.now_unix))
    return out


def memory_used_pct(sample: Any, _part: Slice | None = None) -> float | None:
    """A GPU sample's memory used of its total, % (``GpuSample.mem_used_pct``), as a
    value of an exporter's name table."""
    return sample.mem_used_pct


def cpu_share_pct(sample: Any, part: Slice) -> float:
    """A host sample's job CPU as a share of the machine's cores, % (100: every core busy)."""
    return float(sample.cpu_pct) / part.cpu_count


def scaled(attribute: str, factor: float = 1.0) -> Callable[[Any, Slice], float | None]:
    """The value of a sample's ``attribute`` times ``factor`` (None when not read)."""

    def value(sample: Any, _part: Slice) -> float | None:
        read = getattr(sample, attribute, None)
        return None if read is None else float(read) * factor

    return value


def every_point(part: Slice, gpu: Names, host: Names) -> Iterable[Point]:
    """Every point of ``part`` for an exporter naming resources with ``gpu``/``host``."""
    yield from phase_points(part)
    yield from resource_points(part, gpu, host)
    yield from goodput_points(part)


class Timestamps:
    """Each point's timestamp in Unix ms, distinct from those of the points of the same
    name, step and value before it: its wall time in ms, else the next free ms (MLflow's
    SQL stores keep one point per name, step, ms and value; ``sidecar.exports.mlflow``).

    Kept per name for its latest step only: a name's points come in step order (rows in
    stored order, samples in time order), so bounded by the points of one step.
    """

    def __init__(self) -> None:
        self._taken: dict[str, tuple[int, set[tuple[int, float]]]] = {}

    def stamp(self, point: Point) -> Stamped:
        """``point`` with its timestamp."""
        name, value, step, wall = point
        ms = int(wall * 1000)
        last_step, taken = self._taken.get(name, (None, set()))
        if last_step != step:
            taken = set()
            self._taken[name] = (step, taken)
        while (ms, value) in taken:
            ms += 1
        taken.add((ms, value))
        return name, value, step, ms
