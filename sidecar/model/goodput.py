"""The goodput account: a rank's wall time split into productive training and badput by
cause, the parts adding up to the wall time exactly (docs/goodput.md says where each part
comes from).

Per process session, ``Counters`` sums the records as they arrive (``count``, on arrays,
in nanoseconds of the training process's own clock); ``account`` turns a rank's sessions
and counters into seconds. The parts never overlap:

* *start-up*: the process's start to its first timed activity (an iteration, a
  validation pass, a checkpoint save), per session; the private sidecar's start (the
  markers' wait for it) told apart;
* *warmup*: the whole training iterations the warmup gate leaves out;
* *data-loading stall*: Training data loading inside measured training iterations (the
  time the step waited for its batch);
* *validation*: Validation passes (an unspanned validation loop: its iterations); the
  training iteration a pass interrupts already excludes it;
* *checkpoint save*: phases named ``checkpoint`` (outside iterations, or inside a
  measured training iteration, which is then charged without it);
* *straggler*: the time a rank waited for the slowest one (``sidecar.model.stragglers``),
  per measured iteration, taken off its productive time;
* *redone work* and *downtime*: the resume account of the aggregator (after a resume the
  counters are those of the checkpoint's state, so the redone span counts once);
* *productive*: measured training iterations less the stall, checkpoint and straggler
  parts inside them;
* *other*: the remainder (iterations cut short, time between loops, epoch ends).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from markers import wire
from markers.wire import P_BATCH, P_END, P_FLAGS, P_GPU, P_PHASE, P_START
from sidecar.model.units import NS_PER_S

# Custom phase names (lower case) whose time is a checkpoint save.
CHECKPOINT_NAMES = frozenset({"checkpoint", "checkpoint save", "save checkpoint"})


@dataclass(frozen=True, kw_only=True)
class Cause:
    """One badput cause, every name it goes by: the outputs take them from ``BADPUT``."""

    id: str  # its key in run.json, the resume state, metrics labels and report columns
    label: str  # its line in summary.log's Goodput block
    short: str  # its bar in the job report (``sidecar report --job``)
    # the job report's advice when it takes a large share of the wall time (None: a
    # finding of its own gives it: input-bound, straggler)
    advice: str | None
    colour: str  # its colour in report.html's goodput view


# The badput causes, in the order every output lists them.
BADPUT: tuple[Cause, ...] = (
    Cause(
        id="startup",
        label="start-up (process start to first iteration)",
        short="start-up",
        advice="start the training loop sooner: import and set up less before it, or "
        "load data lazily",
        colour="#4e79a7",
    ),
    Cause(
        id="sidecar_start",
        label="private sidecar start",
        short="sidecar start",
        advice="run the job under `sidecar run` (or a node daemon) instead of a private sidecar",
        colour="#f28e2b",
    ),
    Cause(
        id="data_stall",
        label="data-loading stall",
        short="data stall",
        advice=None,
        colour="#e15759",
    ),
    Cause(
        id="validation",
        label="validation",
        short="validation",
        advice="validate less often or on fewer batches",
        colour="#76b7b2",
    ),
    Cause(
        id="checkpoint",
        label="checkpoint save",
        short="checkpoint",
        advice="checkpoint less often, or save asynchronously",
        colour="#59a14f",
    ),
    Cause(
        id="redone",
        label="redone work after a resume",
        short="redone work",
        advice="checkpoint more often: the work after the last checkpoint was done again",
        colour="#edc948",
    ),
    Cause(
        id="downtime",
        label="downtime between sessions",
        short="downtime",
        advice="resubmit sooner after a failure (requeue, a longer time limit)",
        colour="#b07aa1",
    ),
    Cause(
        id="warmup",
        label="warmup / compile",
        short="warmup/compile",
        advice="compile once (cache the compiled graph) or shorten the warmup",
        colour="#ff9da7",
    ),
    Cause(
        id="straggler",
        label="waiting for the slowest rank",
        short="straggler wait",
        advice=None,
        colour="#9c755f",
    ),
    Cause(
        id="other",
        label="other",
        short="other",
        advice="time the code between steps with a phase to see where it goes",
        colour="#bab0ac",
    ),
)
CAUSES = tuple(cause.id for cause in BADPUT)
CAUSE_LABELS = {cause.id: cause.label for cause in BADPUT}
# The step parts timed on the GPU: their GPU time is the productive iterations' GPU time.
_GPU_PHASES = tuple(p.phase for p in wire.STEP_PHASES if p.gpu)


@dataclass
class Counters:
    """One session's sums, nanoseconds of the process's ``perf_counter_ns``."""

    first_ns: int | None = None  # start of the first timed activity
    warmup_ns: int = 0  # whole training iterations left out by warmup
    loop_ns: int = 0  # whole measured training iterations (Training loop)
    iterations: int = 0  # their count
    data_ns: int = 0  # Training data loading inside measured iterations
    checkpoint_in_ns: int = 0  # checkpoint phases inside measured training iterations
    checkpoint_ns: int = 0  # checkpoint phases outside iterations
    validation_ns: int = 0
    gpu_ns: int = 0  # GPU time of Forward, Backward, Optimization in measured iterations
    gpu_timed: int = 0  # records that carried a GPU time
    span_begin_ns: int | None = None  # a Validation pass begun, not ended

    def to_state(self) -> dict[str, Any]:
        """The counters as the resume state holds them."""
        return asdict(self)

    @classmethod
    def from_state(cls, saved: Mapping[str, Any]) -> Counters:
        """Inverse of ``to_state``; fields absent from ``saved`` keep their neutral value."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})


# What each standard phase is to the account (custom phases: 0, or a checkpoint save).
_LOOP, _DATA, _GPU, _CHECKPOINT, _SPAN, _VAL_LOOP = 1, 2, 3, 4, 5, 6
_ROLE = np.zeros(wire.FIRST_CUSTOM_ID + 1, dtype=np.int8)
_ROLE[[wire.TRAINING_LOOP, wire.TRAINING_DATA_LOADING, wire.VALIDATION, wire.VALIDATION_LOOP]] = (
    _LOOP,
    _DATA,
    _SPAN,
    _VAL_LOOP,
)
_ROLE[list(_GPU_PHASES)] = _GPU
# The sums ``count`` makes in one ``bincount``, by code.
_WARMUP_LOOP, _MEASURED_LOOP, _MEASURED_DATA, _CHECKPOINT_IN, _CHECKPOINT_OUT = 1, 2, 3, 4, 5


def count(
    counters: Counters, records: np.ndarray, warmup_iterations: int, checkpoint_keys: Iterable[int]
) -> None:
    """Add decoded records (records × ``wire.RECORD_WIDTH`` int64, in arrival order) of one
    session to ``counters``; ``checkpoint_keys`` are the phase keys named as checkpoint
    saves. One role lookup and one ``bincount``: it runs on every batch of records."""
    phase, flags = records[:, P_PHASE], records[:, P_FLAGS]
    role = _ROLE[np.minimum(phase, wire.FIRST_CUSTOM_ID)]
    keys = list(checkpoint_keys)
    if keys:
        role[np.isin(phase, keys)] = _CHECKPOINT
    in_iteration = (flags & wire.FLAG_IN_ITERATION) != 0
    train = (flags & (wire.FLAG_IN_ITERATION | wire.FLAG_VALIDATION)) == wire.FLAG_IN_ITERATION
    measured = train & (records[:, P_BATCH] >= warmup_iterations)
    code = np.zeros(len(records), dtype=np.int8)
    loops = (role == _LOOP) & train & ((flags & wire.FLAG_INCOMPLETE) == 0)
    code[loops] = np.where(measured[loops], _MEASURED_LOOP, _WARMUP_LOOP)
    code[(role == _DATA) & measured] = _MEASURED_DATA
    checkpoint = role == _CHECKPOINT
    code[checkpoint & measured] = _CHECKPOINT_IN
    code[checkpoint & ~in_iteration] = _CHECKPOINT_OUT
    wall = records[:, P_END] - records[:, P_START]
    sums = np.bincount(code, weights=wall, minlength=6).round().astype(np.int64).tolist()
    counters.warmup_ns += sums[_WARMUP_LOOP]
    counters.loop_ns += sums[_MEASURED_LOOP]
    counters.iterations += int(np.count_nonzero(code == _MEASURED_LOOP))
    counters.data_ns += sums[_MEASURED_DATA]
    counters.checkpoint_in_ns += sums[_CHECKPOINT_IN]
    counters.checkpoint_ns += sums[_CHECKPOINT_OUT]
    gpu = (role == _GPU) & measured & (records[:, P_GPU] >= 0)
    if gpu.any():
        counters.gpu_ns += int(records[gpu, P_GPU].sum())
        counters.gpu_timed += int(np.count_nonzero(gpu))
    timed = in_iteration | (role >= _CHECKPOINT)
    if timed.any():
        first = int(records[timed, P_START].min())
        counters.first_ns = first if counters.first_ns is None else min(counters.first_ns, first)
    spans = (role == _SPAN) | ((role == _VAL_LOOP) & in_iteration & ~train)
    if spans.any():
        _count_validation(counters, records[spans])


def _count_validation(counters: Counters, records: np.ndarray) -> None:
    """Validation passes, and validation iterations outside any pass, in order."""
    for phase, flags, start_ns, end_ns in records[:, [P_PHASE, P_FLAGS, P_START, P_END]].tolist():
        if phase == wire.VALIDATION_LOOP:
            if counters.span_begin_ns is None:
                counters.validation_ns += end_ns - start_ns
        elif flags & wire.FLAG_BEGIN:
            counters.span_begin_ns = start_ns
        else:
            counters.span_begin_ns = None
            counters.validation_ns += end_ns - start_ns


def end_session(counters: Counters, last_ns: int) -> None:
    """The process ended at ``last_ns``: a validation pass still open counts up to there."""
    if counters.span_begin_ns is not None:
        counters.validation_ns += max(0, last_ns - counters.span_begin_ns)
        counters.span_begin_ns = None


@dataclass(frozen=True)
class SessionTimes:
    """What the account needs of one session: its span on the process's clock (ns), and
    the time before ``start_run`` (process start to the hello, of which the private
    sidecar's start), seconds."""

    start_ns: int
    end_ns: int
    pre_run_s: float
    sidecar_wait_s: float


@dataclass(frozen=True)
class Account:
    """A wall time split into productive time and badput by cause, seconds. ``parts``
    add up to ``wall_s``; ``gpu_busy_s`` (None without a GPU time) is the GPU time of the
    productive iterations' Forward, Backward and Optimization."""

    wall_s: float
    productive_s: float
    badput_s: dict[str, float]  # by cause, in CAUSES order
    iterations: int
    gpu_busy_s: float | None

    def parts(self) -> dict[str, float]:
        """Productive time, then every cause."""
        return {"productive": self.productive_s, **self.badput_s}

    @classmethod
    def job_total(cls, splits: Sequence[Mapping[str, Any]]) -> Account | None:
        """The whole run folder's account: its splits' mean accounts, as their run.json
        entries hold them, added up (from the entries, so splits written by other sidecars
        count), seconds; None without any."""
        means = [
            s["goodput"]["mean"]
            for s in splits
            if isinstance(s.get("goodput"), dict) and isinstance(s["goodput"].get("mean"), dict)
        ]
        if not means:
            return None
        gpus = [m["gpu_busy_s"] for m in means if isinstance(m.get("gpu_busy_s"), (int, float))]
        return cls(
            wall_s=sum(float(m.get("wall_s", 0.0)) for m in means),
            productive_s=sum(float(m.get("productive_s", 0.0)) for m in means),
            badput_s={
                cause: sum(float((m.get("badput_s") or {}).get(cause, 0.0)) for m in means)
                for cause in CAUSES
            },
            iterations=sum(int(m.get("iterations", 0)) for m in means),
            gpu_busy_s=sum(gpus) if gpus else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The account as run.json holds it."""
        return {
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "badput_s": dict(self.badput_s),
            "iterations": self.iterations,
            "gpu_busy_s": self.gpu_busy_s,
        }


def account(
    sessions: list[SessionTimes],
    counters: list[Counters | None],
    downtime_s: float,
    redone_s: float,
    straggler_per_iteration_s: float = 0.0,
) -> Account:
    """The account of one rank from its sessions (in order) and their counters (None: not
    counted, an older state: its time is *other*), its resume figures, and the time it
    waited for the slowest rank per measured iteration (seconds).

    The wall time runs from the first process's start to the last session's end; a later
    process's time before ``start_run`` is taken from the downtime before it.
    """
    sums = dict.fromkeys(CAUSES, 0.0)
    productive = gpu = 0.0
    iterations = gpu_timed = 0
    wall_s = downtime_s + redone_s
    for index, (times, mine) in enumerate(zip(sessions, counters, strict=True)):
        wall_s += (times.end_ns - times.start_ns) / NS_PER_S
        # the first process's time before start_run adds to the wall time; a later one's
        # lies in the downtime before it
        pre_run_s = times.pre_run_s if index == 0 else min(times.pre_run_s, downtime_s)
        if index:
            downtime_s -= pre_run_s
        else:
            wall_s += pre_run_s
        sidecar_s = min(times.sidecar_wait_s, pre_run_s)
        sums["sidecar_start"] += sidecar_s
        sums["startup"] += pre_run_s - sidecar_s
        if mine is None:
            continue
        first_ns = times.end_ns if mine.first_ns is None else mine.first_ns
        sums["startup"] += max(0, first_ns - times.start_ns) / NS_PER_S
        sums["warmup"] += mine.warmup_ns / NS_PER_S
        sums["data_stall"] += mine.data_ns / NS_PER_S
        sums["validation"] += mine.validation_ns / NS_PER_S
        sums["checkpoint"] += (mine.checkpoint_ns + mine.checkpoint_in_ns) / NS_PER_S
        training_s = (mine.loop_ns - mine.data_ns - mine.checkpoint_in_ns) / NS_PER_S
        waited_s = min(straggler_per_iteration_s * mine.iterations, max(0.0, training_s))
        sums["straggler"] += waited_s
        productive += training_s - waited_s
        iterations += mine.iterations
        gpu += mine.gpu_ns / NS_PER_S
        gpu_timed += mine.gpu_timed
    sums["downtime"] = downtime_s
    sums["redone"] = redone_s
    sums["other"] = wall_s - productive - sum(v for k, v in sums.items() if k != "other")
    return Account(wall_s, productive, sums, iterations, gpu if gpu_timed else None)


def total(accounts: Iterable[Account]) -> Account:
    """Several accounts added up (ranks of a split, splits of a job): rank-seconds."""
    accounts = list(accounts)
    badput = {cause: sum(a.badput_s[cause] for a in accounts) for cause in CAUSES}
    gpus = [a.gpu_busy_s for a in accounts if a.gpu_busy_s is not None]
    return Account(
        sum(a.wall_s for a in accounts),
        sum(a.productive_s for a in accounts),
        badput,
        sum(a.iterations for a in accounts),
        sum(gpus) if gpus else None,
    )
