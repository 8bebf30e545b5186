"""A split's efficiency figures: each rank's wait for the slowest rank, the mean goodput
account, throughput in batches and the MFU estimate.

The straggler rule (``sidecar.model.stragglers``) compares the ranks' stored iterations;
``rank_iterations`` gives it one rank's, from the rows this sidecar stores
(``sidecar.model.derived`` runs it once per derivation).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from markers import wire
from sidecar.model.aggregator import RankAggregator
from sidecar.model.goodput import Account, total
from sidecar.model.peaks import Mfu, peak_tflops
from sidecar.model.stragglers import RankIterations, Stragglers

# The straggler rule's PHASES, as phase ids.
_PHASE_IDS = tuple(p.phase for p in wire.STEP_PHASES)
# A lone rank's iterations: the straggler rule needs two ranks, so none are read.
_NO_ITERATIONS = RankIterations(
    "", np.zeros((0, 2), dtype=np.int64), np.zeros((0, len(_PHASE_IDS))), np.zeros(0)
)


def rank_iterations(agg: RankAggregator, host: str = "") -> RankIterations:
    """The stored training iterations of ``agg``, keyed by (epoch, iteration); a later
    session's row of the same key (redone after a resume) replaces the earlier one."""

    def by_key(phase: int) -> dict[tuple[int, int], float]:
        series = agg.series.get(phase)
        return {(row.epoch, row.iteration): row.wall_s for row in series.rows} if series else {}

    loops = by_key(wire.TRAINING_LOOP)
    phases = [by_key(phase) for phase in _PHASE_IDS]
    keys = sorted(loops)
    return RankIterations(
        host,
        np.array(keys, dtype=np.int64).reshape(-1, 2),
        np.array([[phase.get(key, 0.0) for phase in phases] for key in keys], dtype=float).reshape(
            -1, len(_PHASE_IDS)
        ),
        np.array([loops[key] for key in keys], dtype=float),
    )


def waits_per_iteration(compared: Stragglers | None, ranks: Iterable[int]) -> dict[int, float]:
    """Seconds each rank waited for the slowest one per aligned iteration, from the
    straggler rule's ``compared`` view (0 for each of ``ranks`` without a view, with fewer
    than two ranks or no aligned iteration)."""
    if compared is None or not compared.aligned:
        return dict.fromkeys(ranks, 0.0)
    return {s.rank: s.waited_s / compared.aligned for s in compared.standings}


def mean(accounts: Sequence[Account]) -> Account:
    """The ranks' accounts averaged: the split's account in seconds of wall time."""
    added = total(accounts)
    share = 1.0 / max(1, len(accounts))
    return Account(
        added.wall_s * share,
        added.productive_s * share,
        {cause: value * share for cause, value in added.badput_s.items()},
        round(added.iterations * share),
        None if added.gpu_busy_s is None else added.gpu_busy_s * share,
    )


def batches_per_s(agg: RankAggregator) -> float | None:
    """Batches per second over the stored training steps of ``agg`` (None: none)."""
    series = agg.series.get(wire.TRAINING_LOOP)
    rows = [row for row in series.rows if row.batches] if series else []
    wall_s = sum(row.wall_s for row in rows)
    return sum(row.batches for row in rows) / wall_s if wall_s > 0 else None


def split_mfu(
    aggs: Sequence[RankAggregator], flops_per_batch: float | None, dtype: str, gpu_name: str | None
) -> Mfu | None:
    """The split's MFU estimate: each rank's batches per second over its stored steps,
    averaged (one GPU per rank), against ``gpu_name``'s peak for ``dtype``; None when no
    FLOPs per batch were given or no step was stored."""
    rates = [rate for rate in map(batches_per_s, aggs) if rate is not None]
    if not flops_per_batch or not rates:
        return None
    name = gpu_name or "no GPU"
    return Mfu(
        flops_per_batch,
        sum(rates) / len(rates),
        name,
        dtype,
        peak_tflops(name, dtype) if gpu_name else None,
    )
