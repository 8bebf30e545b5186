"""One split served by several sidecars (one per node, or per task): each rank's figures in
a form a reader on another node can merge, and the merged view of the whole split that the
sidecar serving rank 0 writes the summary from (docs/multi-node.md).

A rank's figures (``RankFigures``) are exact counts, the streaming moments of each phase
(count, mean, M2: merged with Chan's formula they give the same figures as one stream),
the means of its stored rows, and the straggler input: per stored training iteration its
(epoch, iteration) and the seconds of data loading, forward, backward, optimization and the
loop (``sidecar.model.stragglers``), and, for a rank that reported a GPU, that GPU's
samples inside those iterations (``sidecar.model.straggler_gpu``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from markers import wire
from sidecar.model.aggregator import RankAggregator
from sidecar.model.straggler_gpu import GpuReadings, in_iterations
from sidecar.model.stragglers import RankIterations, Stragglers, stragglers
from sidecar.model.units import NS_PER_S

# The training phases compared across ranks (the step parts), as ``stragglers.PHASES``.
STRAGGLER_PHASES = tuple(p.phase for p in wire.STEP_PHASES)
# The iteration-level training phases of the ranks table (no Training, no Epoch).
TABLE_PHASES = tuple(
    p for p in wire.PHASES if not p.validation and p.phase not in (wire.TRAINING, wire.EPOCH)
)


@dataclass
class RankFigures:
    """What one rank's sidecar tells of it, for a summary written on another node."""

    rank: int
    host: str
    node_id: str
    status: str
    cause: str | None
    iterations: int  # stored training iterations
    measured: int  # every post-warmup training iteration (exact, past the cap too)
    samples: int  # samples of every measured training iteration of known batch size
    means_s: dict[str, float]  # phase label -> mean of its stored rows
    moments: dict[str, list[float]]  # phase label -> [count, mean, M2] of every measurement
    keys: list[list[int]] = field(default_factory=list)  # (epoch, iteration) per stored row
    phase_s: list[list[float]] = field(default_factory=list)  # per row: STRAGGLER_PHASES
    loop_s: list[float] = field(default_factory=list)  # per row: the Training loop
    gpu_uuid: str | None = None  # the GPU the rank reported using; None: a CPU rank
    # its samples inside stored iterations: epoch, iteration, then straggler_gpu's
    # READING_COLUMNS (None unknown)
    gpu: list[list[float | None]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``from_json`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankFigures:
        """The figures a node file holds; KeyError/TypeError/ValueError when malformed."""
        return cls(
            int(data["rank"]),
            str(data["host"]),
            str(data["node_id"]),
            str(data["status"]),
            data.get("cause"),
            int(data["iterations"]),
            int(data["measured"]),
            int(data["samples"]),
            {str(k): float(v) for k, v in data["means_s"].items()},
            {str(k): [float(x) for x in v] for k, v in data["moments"].items()},
            [[int(e), int(i)] for e, i in data["keys"]],
            [[float(x) for x in row] for row in data["phase_s"]],
            [float(x) for x in data["loop_s"]],
            data.get("gpu_uuid"),  # node files written before GPU figures lack both
            [[None if v is None else float(v) for v in row] for row in data.get("gpu") or []],
        )

    def iterations_view(self) -> RankIterations:
        """The straggler input (``sidecar.model.stragglers``)."""
        return RankIterations(
            self.host,
            np.array(self.keys, dtype=np.int64).reshape(-1, 2),
            np.array(self.phase_s, dtype=float).reshape(-1, len(STRAGGLER_PHASES)),
            np.array(self.loop_s, dtype=float),
            GpuReadings.from_rows(self.gpu) if self.gpu_uuid is not None else None,
        )


def _run_start_ns(agg: RankAggregator) -> int:
    """The rank's run start on this host's monotonic clock (ns): its rows' ``start_s``
    count from it (0 before its hello)."""
    if not agg.sessions:
        return 0
    session = agg.sessions[-1]
    return session.start_ns - round((session.start_unix - agg.run_start_unix) * NS_PER_S)


def figures_of(
    agg: RankAggregator,
    host: str,
    node_id: str,
    status: str,
    cause: str | None,
    gpu_uuid: str | None = None,
    gpu_samples: Callable[[int, int], np.ndarray] | None = None,
) -> RankFigures:
    """The figures of a rank this sidecar serves (its aggregator); ``gpu_uuid`` the GPU
    it reported (None: a CPU rank) and ``gpu_samples(from_ns, to_ns)`` that GPU's samples
    taken in that span of this host's monotonic clock, (m, 5): t_ns, then straggler_gpu's
    READING_COLUMNS (NaN unknown)."""
    means: dict[str, float] = {}
    moments: dict[str, list[float]] = {}
    rows_of: dict[int, dict[tuple[int, int], float]] = {}
    for definition in TABLE_PHASES:
        series = agg.series.get(definition.phase)
        if series is None:
            continue
        stored = [row.wall_s for row in series.rows]
        if stored:
            means[definition.summary_label] = statistics.fmean(stored)
        if series.wall.count:
            moments[definition.summary_label] = [
                series.wall.count,
                series.wall.mean,
                series.wall.m2,
            ]
        rows_of[definition.phase] = {(row.epoch, row.iteration): row.wall_s for row in series.rows}
    loop = rows_of.get(wire.TRAINING_LOOP, {})
    keys = sorted(loop)
    phase_s = [[rows_of.get(p, {}).get(key, 0.0) for p in STRAGGLER_PHASES] for key in keys]
    loop_series = agg.series.get(wire.TRAINING_LOOP)
    gpu: list[list[float | None]] = []
    if gpu_uuid is not None and gpu_samples is not None and loop_series and loop_series.rows:
        rows = loop_series.rows
        run_start_ns = _run_start_ns(agg)
        samples = gpu_samples(
            run_start_ns + int(min(r.start_s for r in rows) * NS_PER_S),
            run_start_ns + int(max(r.start_s + r.wall_s for r in rows) * NS_PER_S) + 1,
        )
        gpu = in_iterations(
            (samples[:, 0] - run_start_ns) / NS_PER_S,
            samples[:, 1:],
            np.array([[r.epoch, r.iteration] for r in rows], dtype=np.int64).reshape(-1, 2),
            np.array([r.start_s for r in rows], dtype=float),
            np.array([r.wall_s for r in rows], dtype=float),
        )
    return RankFigures(
        agg.rank,
        host,
        node_id,
        status,
        cause,
        agg.stored_iterations[False],
        loop_series.wall.count if loop_series is not None else 0,
        agg.samples[False] or 0,
        means,
        moments,
        [list(k) for k in keys],
        phase_s,
        [loop[k] for k in keys],
        gpu_uuid,
        gpu,
    )


@dataclass(frozen=True)
class MergedSplit:
    """Every rank of a split as the summary shows it: ``ranks`` by rank (this sidecar's
    and every other node's newest figures), ``missing`` the expected ranks (0 … world
    size − 1) without figures, ``stragglers`` the comparison (None under two ranks)."""

    ranks: list[RankFigures]
    missing: list[int]
    stragglers: Stragglers | None


def merged(
    own: Iterable[RankFigures], others: Iterable[RankFigures], world_size: int
) -> MergedSplit:
    """The view of a split from this sidecar's ranks (``own``, which win) and the figures
    read from other nodes' files (``others``, the newest first: a rank served by several
    nodes over time keeps the first one given)."""
    ranks: dict[int, RankFigures] = {figures.rank: figures for figures in own}
    for figures in others:
        ranks.setdefault(figures.rank, figures)
    expected = max(world_size, max(ranks, default=-1) + 1)
    missing = [rank for rank in range(expected) if rank not in ranks]
    ordered = [ranks[rank] for rank in sorted(ranks)]
    view = stragglers({f.rank: f.iterations_view() for f in ordered}) if len(ordered) >= 2 else None
    return MergedSplit(ordered, missing, view)
